"""The guarded SQL the verbs of ``todos.transitions`` run, built here beside each other: the
statement that changes a todo and writes its event (``apply_transition``), the guards and
fences it is given, the create statement ingest's one-statement delivery shares, the claim's
candidate pick and capacity guard, and the sweeps' batches. Only ``todos`` writes
``todos_todo``; other apps call its transitions (docs/architecture.md#the-layers)."""

import functools
import json
import secrets
from datetime import timedelta

from django.db import connection, transaction

from switchboard.db import sql as dialect
from switchboard.db import statements as db_statements
from switchboard.db.sql import is_postgres as _is_postgres

from .models import State, Todo


def lease_hint(lease_id, owner) -> dict:
    """How an event names a lease: hints, like the wire shape's lease_owner, enough to tell
    leases apart in the history, nothing an agent could present as its lease."""
    return {"lease_id": (lease_id or "")[:8], "lease_owner": (owner or "")[:8]}


@functools.cache
def _todo_columns() -> tuple:
    """The todo columns every statement RETURNs, in model field order, so rows become Todo
    instances without looking at cursor.description (which psycopg builds per execute)."""
    return tuple(field.column for field in Todo._meta.concrete_fields)


def returning() -> str:
    return ", ".join(_todo_columns())


def fetch_todos(sql: str, params: dict) -> list[Todo]:
    """Execute a statement that RETURNs ``returning()`` columns; the rows as Todo instances."""
    return [db_statements.instance_from_fetched(Todo, "todos_todo", row)
            for row in db_statements.fetch_all(sql, params)]


# What a ``from_prior`` event adds (the lease it overrode, the trust it raised), from the locked
# prior row ``o`` and the updated ``t``; ``_prior_detail`` is SQLite's copy.
_PRIOR_DETAIL_SQL = (
    "jsonb_strip_nulls(jsonb_build_object("
    "'override', CASE WHEN o.state = 'claimed' THEN true END, "
    "'overridden_lease', CASE WHEN o.state = 'claimed' THEN jsonb_build_object("
    "'lease_id', left(o.lease_id, 8), 'lease_owner', left(o.lease_owner, 8)) END, "
    "'from_trust', CASE WHEN t.trust <> o.trust THEN o.trust END))"
)


def _prior_detail(prior: dict, trust_after: str) -> dict:
    detail = {}
    if prior["state"] == State.CLAIMED:
        detail["override"] = True
        detail["overridden_lease"] = lease_hint(prior["lease_id"], prior["lease_owner"])
    if trust_after != prior["trust"]:
        detail["from_trust"] = prior["trust"]
    return detail


# The outbox entry of a transition (docs/write-back.md#the-outbox), from the updated row ``t``:
# only for a todo whose source hears every change. ``create`` writes its own (``_CREATE_OUTBOX``).
_OUTBOX_COLUMNS = "todo_id, action, at"
_OUTBOX_WHERE = "t.write_back = 'status'"


def apply_transition(*, set_sql: str, where_sql: str, params: dict, action_sql: str, from_state_sql: str,
           actor: str, now, detail=None, endpoint=None, from_prior=False, also=None,
           detail_sql_over_t: str = "", tells_source=True,
           outbox_where: str = _OUTBOX_WHERE, prior_column: str = "") -> list[Todo]:
    """Run one guarded UPDATE and write one todo event per changed row, and one outbox entry
    per changed row whose source hears every change (``write_back = 'status'``), unless the
    transition does not ``tells_source`` (a heartbeat changes nothing the source shows);
    ``outbox_where`` (over ``t``) widens that for a transition every listening source hears.

    ``action_sql`` and ``from_state_sql`` are SQL expressions over the updated row ``t``; they
    let one statement record, e.g., ``fail`` or ``dead_letter`` depending on the attempts left.
    ``from_prior``: a transition of the one todo ``%(todo_id)s`` from any of several states
    (``from_state_sql`` is then unused). The event's from state is the row's state before the
    statement, which RETURNING cannot give: PostgreSQL locks and reads the row first in the
    same statement (``o``, which the UPDATE's WHERE depends on, so it runs first; a change
    committed while ``o`` waited for the lock is what both then see), SQLite reads it inside
    the write transaction (one writer). ``_PRIOR_DETAIL_SQL`` adds what the prior row says.

    ``also``: a function of the updated rows' source SQL (``t``) giving one more write in the
    same statement (PostgreSQL: a CTE; SQLite: in the transaction), or None.
    ``detail_sql_over_t``: a JSON object over the updated row ``t`` merged into the detail.
    ``prior_column``: a column of the one todo ``%(todo_id)s`` as it was just before the
    statement, set on the returned row as ``prior_<column>`` (read under the row's lock, as
    ``from_prior`` reads; not with ``from_prior``).
    """
    params = {
        **params,
        "now": dialect.db_time(now),
        "actor": actor,
        "detail": json.dumps(detail or {}),
    }
    detail_sql = dialect.jsonb("detail")
    event_from = "t"
    prelude = ""
    if from_prior and _is_postgres():
        prelude = ("o AS (SELECT id, state, trust, lease_id, lease_owner FROM todos_todo"
                   " WHERE id = %(todo_id)s FOR UPDATE), ")
        where_sql += " AND id = (SELECT id FROM o)"
        from_state_sql, event_from = "o.state", "t JOIN o ON o.id = t.id"
        detail_sql = f"{detail_sql} || {_PRIOR_DETAIL_SQL}"
    elif from_prior:
        from_state_sql = "%(from_state)s"
    final = "SELECT * FROM t"
    if prior_column and _is_postgres():
        prelude = (f"p AS (SELECT id, {prior_column} FROM todos_todo WHERE id = %(todo_id)s"
                   " FOR UPDATE), ")
        where_sql += " AND id = (SELECT id FROM p)"
        final = f"SELECT t.*, p.{prior_column} FROM t JOIN p ON p.id = t.id"
    if detail_sql_over_t:
        detail_sql = dialect.json_merge(detail_sql, detail_sql_over_t)
    event_select = (
        f"SELECT t.id, {action_sql}, {from_state_sql}, t.state, %(actor)s, %(now)s, "
        f"{detail_sql}"
    )
    event_columns = "todo_id, action, from_state, to_state, actor, at, detail"
    update = (
        f"UPDATE todos_todo SET {set_sql}, updated_at = %(now)s WHERE {where_sql} "
        f"RETURNING {returning()}"
    )
    outbox_select = f"SELECT t.id, {action_sql}, %(now)s"
    if _is_postgres():
        outbox = (f", n AS (INSERT INTO todos_outboxentry ({_OUTBOX_COLUMNS}) {outbox_select}"
                  f" FROM t WHERE {outbox_where})" if tells_source else "")
        extra = also("t") if also else None
        sql = (
            f"WITH {prelude}t AS ({update}), "
            f"e AS (INSERT INTO todos_todoevent ({event_columns}) {event_select} FROM {event_from})"
            + (f", s AS ({extra})" if extra else "")
            + f"{outbox} {final}"
        )
        if prior_column:
            fetched = db_statements.fetch_all(sql, params)
            rows = [_with_prior(row[:-1], prior_column, row[-1]) for row in fetched]
        else:
            rows = fetch_todos(sql, params)
    else:
        with transaction.atomic():
            if from_prior:
                prior = Todo.objects.filter(pk=params["todo_id"]).values(
                    "state", "trust", "lease_id", "lease_owner").first()
            if prior_column:
                before = Todo.objects.filter(pk=params["todo_id"]).values_list(
                    prior_column, flat=True).first()
            rows = fetch_todos(update, params)
            if prior_column:
                rows = [_with_prior(row, prior_column, before) for row in rows]
            if rows and from_prior:
                params["from_state"] = prior["state"]
                params["detail"] = json.dumps(
                    {**(detail or {}), **_prior_detail(prior, rows[0].trust)})
            if rows:
                changed = dialect.id_in("t.id", "ids", params, [row.pk for row in rows])
                rows_sql = f"todos_todo t WHERE {changed}"
                with connection.cursor() as cursor:
                    cursor.execute(
                        f"INSERT INTO todos_todoevent ({event_columns}) {event_select} "
                        f"FROM {rows_sql}",
                        params,
                    )
                    if tells_source and any(row.write_back != "off" for row in rows):
                        cursor.execute(
                            f"INSERT INTO todos_outboxentry ({_OUTBOX_COLUMNS}) {outbox_select}"
                            f" FROM {rows_sql} AND {outbox_where}", params)
                    extra = also(rows_sql) if also else None
                    if extra:
                        cursor.execute(extra, params)
    for row in rows:
        if endpoint is not None and row.endpoint_id == endpoint.pk:
            # Spare the serializer a query per row; set as select_related does (the field's
            # descriptor would check the instance's type and state first).
            row._state.fields_cache["endpoint"] = endpoint
    return rows


def _with_prior(row, column: str, value) -> Todo:
    todo = row if isinstance(row, Todo) else db_statements.instance_from_fetched(
        Todo, "todos_todo", row)
    setattr(todo, f"prior_{column}", value)
    return todo


def visible_guard(caller, params: dict) -> str:
    """The guard that makes a todo outside the caller's endpoint or scope invisible."""
    params["endpoint_id"] = caller.endpoint.pk
    guard = "endpoint_id = %(endpoint_id)s"
    if caller.queues is not None:
        params["queues"] = dialect.text_list(caller.queues)
        guard += " AND " + dialect.text_in("queue", "queues")
    return guard


def by_id(guard: str) -> str:
    """The WHERE of a transition on the one todo ``%(todo_id)s``: found by its primary key, then
    held to ``guard``.

    Written as ``(guard) IS TRUE`` so that no clause of the guard is an index condition: a fenced
    verb's ``state = 'claimed'`` matches todo_by_state and the partial todo_reaper, whose
    "claimed" range also keeps an entry for every lease ended since the last vacuum. Statistics
    rarely sample a claimed row (few are claimed at any moment), so the planner costed that
    range at under one row and chose it over the primary key: every complete then walked it
    (its buffers growing with every complete, against a handful by primary key). In a WHERE,
    ``IS TRUE`` keeps the guard's meaning (false and NULL both leave the row alone);
    todos/tests/test_plans.py pins the plan.
    """
    return f"id = %(todo_id)s AND ({guard}) IS TRUE"


def lease_fence(params: dict, caller, lease_id, overriding=None) -> str:
    """Fenced writes: only the current, unexpired lease may act — by lease_id when given, else
    by owner. ``lease_expires_at > now`` makes a lapsed lease lost at once, before the reaper
    gets to the row (the reaper still is what moves it back). An operator override is fenced
    by the lease it saw instead, expired or not: acting on a stuck lease is its purpose."""
    if overriding is not None:
        params.update(held_lease_id=overriding.lease_id, held_owner=overriding.owner)
        return ("state = 'claimed' AND lease_id = %(held_lease_id)s "
                "AND lease_owner = %(held_owner)s")
    if lease_id is not None:
        params["lease_id"] = str(lease_id)
        fence = "state = 'claimed' AND lease_id = %(lease_id)s"
    else:
        params["owner"] = caller.actor
        fence = "state = 'claimed' AND lease_owner = %(owner)s"
    return fence + " AND lease_expires_at > %(now)s"


def lease_set(params: dict, caller, ttl: timedelta, now) -> str:
    params.update(
        lease_id=secrets.token_urlsafe(16),
        owner=caller.actor,
        expires=dialect.db_time(now + ttl),
        ttl=dialect.db_duration(ttl),
    )
    return (
        "state = 'claimed', lease_id = %(lease_id)s, lease_owner = %(owner)s, "
        "lease_expires_at = %(expires)s, lease_ttl = %(ttl)s, attempts = attempts + 1, "
        "retry_at = NULL, not_before = NULL, progress = NULL, "
        # The claimer gets every follow-up in the todo it is answered with.
        "followups_given = followup_count"
    )


# -- create --------------------------------------------------------------------------------------


# The create statement's pieces, shared with ingest's one-statement delivery
# (ingest.transitions), which inserts the todo in the statement that records its delivery.
_CREATE_COLUMNS = (
    "endpoint_id, queue, state, title, kind, source, payload, idempotency_key, delivery_event_id,"
    " trust, attempts, max_attempts, created_at, updated_at, ring_attempts, priority, not_before,"
    " write_back, max_cost_usd, traceparent, thread, thread_live_key"
)
# A created todo's outbox entry, for any source that hears of it (its ack).
_CREATE_OUTBOX = (f"INSERT INTO todos_outboxentry ({_OUTBOX_COLUMNS})"
                  " SELECT t.id, 'create', %(now)s FROM {source} WHERE {only}t.write_back <> 'off'")


# Which todos hold their idempotency key (the partial unique index todo_live_idempotency_key).
# The conflict target names that index by its columns and predicate, spelled exactly as the
# migration wrote it: SQLite matches the predicate textually.
_LIVE_KEY_PREDICATE = (
    "\"idempotency_key\" IS NOT NULL AND (\"state\" IN ('pending', 'claimed', 'awaiting_approval')"
    " OR "
    "(\"dead_lettered_at\" IS NULL AND \"state\" = 'failed'))"
)


# No conflict target: a live todo holding the key (todo_live_idempotency_key) or the thread
# (todo_live_thread) both make the create insert nothing; the caller then finds which. Also
# shorter, which the one-statement delivery's text needs (docs/decisions/one-statement-delivery.md).
_LIVE_KEY_CONFLICT = "ON CONFLICT DO NOTHING"


# SQL over ``create_todo_params``: true when a live todo of the endpoint already holds the key,
# so the create would insert nothing. For a statement that would rather not start writing
# (ingest's one-statement delivery); the conflict clause stays what decides under a race.
LIVE_KEY_HELD_SQL = (
    "EXISTS (SELECT 1 FROM todos_todo WHERE endpoint_id = %(endpoint_id)s"
    f" AND idempotency_key = %(key)s AND {_LIVE_KEY_PREDICATE})"
)


# SQL over ``create_todo_params``: true when a live todo of the endpoint holds the thread
# (todo_live_thread), as LIVE_KEY_HELD_SQL is for the key.
LIVE_THREAD_HELD_SQL = (
    "EXISTS (SELECT 1 FROM todos_todo WHERE endpoint_id = %(endpoint_id)s"
    " AND thread_live_key = %(thread_live_key)s AND cancel_requested_at IS NULL"
    f" AND {_LIVE_KEY_PREDICATE.partition(' AND ')[2]})"
)


_CREATE_EVENT_COLUMNS = "todo_id, action, from_state, to_state, actor, at, detail"


def _create_values(delivery_event_sql: str) -> str:
    return (f"%(endpoint_id)s, %(queue)s, %(state)s, %(title)s, %(kind)s, %(source)s, "
            f"{dialect.jsonb('payload')}, %(key)s, {delivery_event_sql}, %(trust)s, 0, %(max_attempts)s, "
            "%(now)s, %(now)s, 0, %(priority)s, %(not_before)s, %(write_back)s, %(max_cost_usd)s,"
            " %(traceparent)s, %(thread)s, %(thread_live_key)s")


def insert_todo_sql() -> str:
    """SQLite: the todo INSERT alone, RETURNing the whole row (nothing when a live todo holds
    the key); ``insert_create_event_sql`` writes its event in the same transaction."""
    return (f"INSERT INTO todos_todo ({_CREATE_COLUMNS})"
            f" VALUES ({_create_values('%(delivery_event_id)s')}) {_LIVE_KEY_CONFLICT}"
            f" RETURNING {returning()}")


def insert_create_event_sql() -> str:
    """SQLite: the ``create`` event of the todo ``%(todo_id)s`` that ``insert_todo_sql`` made."""
    return (f"INSERT INTO todos_todoevent ({_CREATE_EVENT_COLUMNS}) VALUES"
            " (%(todo_id)s, 'create', NULL, %(state)s, %(actor)s, %(now)s,"
            f" {dialect.jsonb('detail')})")


def insert_create_outbox_sql() -> str:
    """SQLite: the outbox entry of the todo ``%(todo_id)s`` that ``insert_todo_sql`` made,
    when its source hears of it (nothing otherwise)."""
    return _CREATE_OUTBOX.format(source="todos_todo t", only="t.id = %(todo_id)s AND ")


@functools.cache
def create_todo_ctes(*, delivery_event_sql: str = "%(delivery_event_id)s", source_sql: str = "",
                     where_sql: str = "", writes_back: bool = True) -> str:
    """PostgreSQL: the todo INSERT (``t``, RETURNing the whole row, nothing when a live todo
    holds the key), its ``create`` event (``e``) and, when ``writes_back`` (the params'
    ``write_back`` is not ``off``), its outbox entry (``n``) as data-modifying CTEs, over the
    params of ``create_todo_params``. ``source_sql``/``where_sql`` make it an INSERT … SELECT
    (``FROM x WHERE …``), so another statement can feed it the delivery event id it just
    inserted."""
    values = _create_values(delivery_event_sql)
    rows = f"SELECT {values} {source_sql}{where_sql}" if source_sql else f"VALUES ({values})"
    # Left out for a todo its source hears nothing of, nearly every one: no INSERT for
    # PostgreSQL to set up that would write no row, and a shorter text for psycopg to keep
    # within its parse cache (docs/decisions/one-statement-delivery.md).
    outbox = f", n AS ({_CREATE_OUTBOX.format(source='t', only='')})" if writes_back else ""
    return (
        f"t AS (INSERT INTO todos_todo ({_CREATE_COLUMNS}) {rows} {_LIVE_KEY_CONFLICT}"
        f" RETURNING {returning()}), e AS (INSERT INTO todos_todoevent ({_CREATE_EVENT_COLUMNS})"
        f" SELECT t.id, 'create', NULL, t.state, %(actor)s, %(now)s,"
        f" jsonb_build_object('delivery_event', t.delivery_event_id) FROM t){outbox}"
    )


def take_outbox_entries(*, limit: int) -> list[tuple]:
    """``transitions.take_outbox_entries``' statement: the oldest entries deleted, returned
    oldest first."""
    params = {"limit": limit}
    # Picked once, in a materialized CTE: as a plain IN (sub-select) PostgreSQL may rescan
    # it inside a semi-join, and with SKIP LOCKED each rescan can pick other rows, so one call
    # took more than ``limit`` (seen: three entries for a limit of two).
    pick = f"SELECT id FROM todos_outboxentry ORDER BY id LIMIT %(limit)s{dialect.skip_locked()}"
    with connection.cursor() as cursor:
        cursor.execute(f"WITH pick AS MATERIALIZED ({pick}) DELETE FROM todos_outboxentry"
                       " WHERE id IN (SELECT id FROM pick) RETURNING id, todo_id, action", params)
        rows = sorted(cursor.fetchall())
    return [(todo_id, action) for _, todo_id, action in rows]


def todo_from_row(row) -> Todo:
    """A Todo from a PostgreSQL row of the whole-row RETURNING columns (``create_todo_ctes``)."""
    return db_statements.instance_from_loaded_row(Todo, "todos_todo", row)


# -- claim -------------------------------------------------------------------------------------


def trust_filter(hide_unverified: bool, column: str = "trust") -> str:
    """The clause that hides unverified todos from a caller that refuses them; a
    constant, no parameter. Checked on the rows the claim indexes yield in order, so a queue
    whose head is unverified costs a step past it, not a different plan."""
    return f" AND {column} <> 'unverified'" if hide_unverified else ""


def unpaused_where(endpoint, params: dict) -> str:
    """Pause (docs/reference.md#pausing): the guard clause that keeps paused queues out of a
    claim."""
    if endpoint.paused_all:
        return " AND FALSE"
    if not endpoint.paused_queues:
        return ""
    params["paused"] = dialect.text_list(endpoint.paused_queues)
    return " AND NOT " + dialect.text_in("queue", "paused")

# -- concurrency caps (docs/work-control.md#caps) -------------------------------------------------
#
# Checked inside the claim's one statement, by a function that counts after a per-endpoint lock
# (docs/decisions/claim-caps-in-the-statement.md); endpoints without a cap pay nothing.


def claim_cap_guard(endpoint, params: dict, *, lock_row_first: bool = False) -> str:
    """The clause that refuses a claim which would exceed ``endpoint``'s caps, checked on the
    row being claimed (``todos_todo``); empty when the endpoint has none. PostgreSQL: under the
    endpoint's transaction lock, held until the claim commits. SQLite: a sub-select (its single
    writer serializes claims).

    Whoever holds the endpoint's lock must never wait for a row lock another claim holds, or a
    claim holding a row and waiting for the lock deadlocks with it (measured: a claim by id
    waiting on the row a claim_next had picked). claim_next's pick holds its todo's claim lock
    (``todo_claim_hold``) before the guard runs, and may then wait only for bookkeeping (a
    digest, a ring), which never takes this lock; a claim by id passes ``lock_row_first`` to
    take that claim lock and then its row lock (by ``%(todo_id)s``) in the guard, before the
    function."""
    if not endpoint.has_claim_caps:
        return ""
    params["max_claimed"] = endpoint.max_claimed
    params["queue_limits"] = json.dumps(endpoint.queue_limits or {})
    if _is_postgres():
        first = (" AND id = (SELECT id FROM todos_todo WHERE id = %(todo_id)s"
                 " AND todo_claim_hold(id, TRUE) FOR UPDATE)" if lock_row_first else "")
        return (f"{first} AND endpoint_claim_fits(todos_todo.endpoint_id, todos_todo.queue,"
                f" %(max_claimed)s::integer,"
                f" {dialect.json_member('queue_limits', 'todos_todo.queue')}::integer)")
    claimed = ("SELECT count(*) FROM todos_todo c WHERE c.endpoint_id = todos_todo.endpoint_id"
               " AND c.state = 'claimed'")
    # A queue without a cap compares with NULL, which COALESCE turns into "fits".
    return (f" AND (%(max_claimed)s IS NULL OR ({claimed}) < %(max_claimed)s)"
            f" AND COALESCE(({claimed} AND c.queue = todos_todo.queue)"
            f" < {dialect.json_member('queue_limits', 'todos_todo.queue')}, 1)")


def _cap_room_filter(endpoint, params: dict, column: str) -> str:
    """For claim_next's candidate pick: leave out queues (``column``) already at their cap, and
    everything when the endpoint is, so the pick finds a todo it may claim instead of locking
    one the guard will refuse. Read from the statement's snapshot, so only a hint: the guard
    decides. Each sub-select is uncorrelated (evaluated once per statement)."""
    if not endpoint.has_claim_caps:
        return ""
    params["max_claimed"] = endpoint.max_claimed
    params["queue_limits"] = json.dumps(endpoint.queue_limits or {})
    claimed = ("SELECT count(*) FROM todos_todo c WHERE c.endpoint_id = %(endpoint_id)s"
               " AND c.state = 'claimed'")
    if _is_postgres():
        full = (f"ARRAY(SELECT l.key FROM {dialect.json_entries('queue_limits')} l"
                f" WHERE ({claimed} AND c.queue = l.key) >= l.value::integer)")
        return (f" AND (%(max_claimed)s::integer IS NULL OR ({claimed}) < %(max_claimed)s::integer)"
                f" AND {column} <> ALL({full})")
    full = (f"SELECT l.key FROM {dialect.json_entries('queue_limits')} l"
            f" WHERE ({claimed} AND c.queue = l.key) >= l.value")
    return (f" AND (%(max_claimed)s IS NULL OR ({claimed}) < %(max_claimed)s)"
            f" AND {column} NOT IN ({full})")


# Ready to claim, over a todo row (``{t}``: its alias and a dot, or nothing): the predicate of
# the claim indexes, spelled so the planner sees that it implies it.
READY_SQL = "{t}state = 'pending' AND {t}not_before IS NULL"


# The claim order, the claim indexes' key order after endpoint (and queue).
CLAIM_ORDER = "{t}priority DESC, {t}created_at, {t}id"


def claim_candidate_sql(params: dict, queues, *, hide_unverified: bool = False,
                        endpoint=None) -> str:
    """The sub-select that picks (and on PostgreSQL locks) claim_next's candidate: the ready
    todo of ``params["endpoint_id"]`` with the highest priority, then the oldest, in ``queues``
    (None = every queue not paused on ``endpoint``), unverified ones left out when
    ``hide_unverified``. Kept apart so the plan test can EXPLAIN exactly what claim_next runs.

    Ready is ``state = 'pending' AND not_before IS NULL`` (``READY_SQL``): the predicate of
    both claim indexes, whose key order is ``CLAIM_ORDER``; a scheduled todo becomes ready
    when the due sweep clears its ``not_before``."""
    # Caps: queues at their cap (and everything, at the endpoint's) are left out of the pick.
    room = "" if endpoint is None else _cap_room_filter(
        endpoint, params, "p.queue" if _is_postgres() and queues is not None else "queue")
    if _is_postgres() and queues is not None:
        params["queues"] = dialect.text_list(queues)
        return (
            "SELECT c.id FROM unnest(%(queues)s::text[]) AS q(name) CROSS JOIN LATERAL ("
            + _first_unheld(
                "SELECT p.id, p.priority, p.created_at FROM todos_todo p"
                " WHERE p.endpoint_id = %(endpoint_id)s"
                f" AND p.queue = q.name AND {READY_SQL.format(t='p.')}"
                f"{trust_filter(hide_unverified, 'p.trust')}{room}"
                f" ORDER BY {CLAIM_ORDER.format(t='p.')}", "h.id, h.priority, h.created_at",
                endpoint)
            + f") c ORDER BY {CLAIM_ORDER.format(t='c.')} LIMIT 1"
        )
    queue_filter = ""
    if queues is not None:
        params["queues"] = dialect.text_list(queues)
        queue_filter = " AND " + dialect.text_in("queue", "queues")
    elif endpoint is not None:
        queue_filter = unpaused_where(endpoint, params)
    ordered = (
        f"SELECT id FROM todos_todo WHERE endpoint_id = %(endpoint_id)s AND {READY_SQL.format(t='')}"
        f"{queue_filter}{trust_filter(hide_unverified)}{room}"
        f" ORDER BY {CLAIM_ORDER.format(t='')}"
    )
    return _first_unheld(ordered, "h.id", endpoint) if _is_postgres() else ordered + " LIMIT 1"


def _first_unheld(ordered_sql: str, columns: str, endpoint) -> str:
    """PostgreSQL: the first row of ``ordered_sql`` (the claim order) that no other claim
    holds, now held by this one (``todo_claim_hold``: a claim's own advisory lock, and the row
    re-read fresh). Not a row lock with SKIP LOCKED: a digest or a ring stamping
    last_ringed_at locks rows too, and a todo held only by that bookkeeping is still the one
    to hand out (the claim's UPDATE waits the moment it takes). The function is applied
    outside the ordered sub-select, fenced by OFFSET 0 (PostgreSQL pushes no condition into a
    sub-select with a LIMIT or OFFSET), so it runs on rows in claim order and stops at the
    first it holds, whatever plan reads them. Without the fence PostgreSQL pushed it, volatile
    as it is, into a sequential scan's filter below the sort: the claim then held every
    pending todo (todos/tests/test_plans.py pins this). An endpoint with caps has its cap lock taken
    first, so its claims pick in turn (a claim that passed over a held todo must not take the
    last slot before the claim holding it is checked)."""
    capped = (", FALSE, %(endpoint_id)s::bigint"
              if endpoint is not None and endpoint.has_claim_caps else "")
    return (f"SELECT {columns} FROM ({ordered_sql} OFFSET 0) h"
            f" WHERE todo_claim_hold(h.id{capped}) LIMIT 1")


# -- the sweeps' batches (todos.transitions' sweep verbs) ----------------------------------------


def lapsed_leases_sql() -> str:
    """The reaper's batch: claimed todos whose lease lapsed by %(now)s (index todo_reaper)."""
    return ("SELECT id FROM todos_todo WHERE state = 'claimed' AND lease_expires_at <= %(now)s"
            f" ORDER BY lease_expires_at LIMIT %(limit)s{dialect.skip_locked()}")


def due_retries_sql() -> str:
    """The promoter's batch: failed todos due to retry by %(now)s (index todo_retry_promoter)."""
    return ("SELECT id FROM todos_todo WHERE state = 'failed' AND retry_at <= %(now)s"
            f" ORDER BY retry_at LIMIT %(limit)s{dialect.skip_locked()}")


def due_scheduled_sql() -> str:
    """The due sweep's batch: scheduled todos whose time came by %(now)s (index
    todo_scheduled_due)."""
    return ("SELECT id FROM todos_todo WHERE state = 'pending' AND not_before <= %(now)s"
            f" ORDER BY not_before LIMIT %(limit)s{dialect.skip_locked()}")


def stale_approvals_sql() -> str:
    """The approval-timeout sweep's batch: todos awaiting approval longer than their endpoint's
    ``approval_timeout_seconds`` at %(now)s (index todo_awaiting_approval, per endpoint that
    has a timeout; endpoints without one are never read past their own row)."""
    overdue = "a.created_at <= " + dialect.minus_seconds("now", "e.approval_timeout_seconds")
    return ("SELECT a.id FROM endpoints_endpoint e JOIN todos_todo a ON a.endpoint_id = e.id"
            " AND a.state = 'awaiting_approval'"
            f" WHERE e.approval_timeout_seconds IS NOT NULL AND {overdue}"
            " ORDER BY a.created_at LIMIT %(limit)s"
            # Lock the todos only: the endpoint row is read, never changed here.
            + dialect.skip_locked(of="a"))


# -- threads (docs/work-control.md#threads) ------------------------------------------------------


# Live for its thread (todos.models.LIVE_FOR_THREAD): the guard of a follow-up.
LIVE_FOR_THREAD_SQL = ("(state IN ('awaiting_approval', 'pending', 'claimed')"
                       " OR (state = 'failed' AND dead_lettered_at IS NULL))"
                       " AND cancel_requested_at IS NULL")
# Live but not held: what a stop cancels outright.
UNHELD_LIVE_SQL = ("(state IN ('awaiting_approval', 'pending')"
                   " OR (state = 'failed' AND dead_lettered_at IS NULL))")


def insert_followup_sql(rows_sql: str) -> str:
    """The follow-up row of each todo in ``rows_sql`` (``t``, just counted): its seq is the
    todo's new ``followup_count``, so the count's guarded UPDATE hands out each seq once."""
    return ("INSERT INTO todos_followup (todo_id, seq, delivery_event_id, kind, title, actor,"
            " trust, payload, at) SELECT t.id, t.followup_count, %(delivery_event_id)s,"
            f" %(kind)s, %(title)s, %(followup_actor)s, %(trust)s, {dialect.jsonb('payload')},"
            f" %(now)s FROM {rows_sql}")
