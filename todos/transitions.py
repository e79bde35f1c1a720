"""Every write that moves a todo through its lifecycle (docs/reference.md#todo-states).

Each transition is ONE guarded statement (``UPDATE … WHERE id = … AND state = … RETURNING``)
plus its todo event row, in one transaction:

* PostgreSQL: the event is written by a data-modifying CTE in the same statement: no more
  than the bare UPDATE costs, where UPDATE and INSERT as two round trips cut claim throughput
  steeply (bench/queue.py measures claim throughput).
* SQLite (embedded default): SQLite has no data-modifying CTEs, so the UPDATE … RETURNING and
  the event INSERT run as two statements inside one IMMEDIATE transaction; SQLite's single
  writer makes that equally atomic.

No transition reads, checks in Python, then writes. When a guard does not match, the statement
changed nothing; only then do we read the row once to say *why* (``Refusal.code``), and that read
never feeds a write.

Times are computed in Python from one clock read per operation and passed as parameters (no SQL
date arithmetic), so both backends share the SQL and tests drive the clock with ``now=``.
"""

import functools
import json
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import IntegrityError, connection, models, transaction
from django.utils import timezone

from channels_push.bus import publish
from switchboard import json_input
from switchboard.db import sql as dialect
from switchboard.db import statements
from switchboard.db.sql import is_postgres as _is_postgres

from . import queries
from .models import (MAX_SCHEDULE_AHEAD, NOT_BEFORE_PAST_TOLERANCE, PRIORITY_DEFAULT,
                     PRIORITY_MAX, PRIORITY_MIN, State, Todo, Trust)

# A todo's title is folded to one line and cut to its column's width.
MAX_TITLE_CHARS = Todo._meta.get_field("title").max_length
MIN_LEASE = timedelta(seconds=1)
MAX_LEASE = timedelta(hours=24)
FIRST_RETRY_BACKOFF = timedelta(seconds=30)
MAX_RETRY_BACKOFF = timedelta(minutes=15)
# attempts >= this many all share the capped backoff (30 s * 2**5 = 960 s > 900 s).
_BACKOFF_STEPS = 6



class Refusal(Exception):
    """A transition that did not apply, with a machine-readable code
    (docs/reference.md#refusal-codes): ``not_found``, ``not_in_scope``, ``not_claimable``,
    ``lease_lost``, ``already_done``, ``paused``, ``scheduled``, ``at_capacity``,
    ``awaiting_approval``, ``invalid_argument``."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Caller:
    """Who is acting: the endpoint whose todos they may touch, the queues they may see (None =
    all of the endpoint's queues) and the name recorded as lease owner and event actor."""

    endpoint: object
    actor: str
    queues: tuple | None = None
    # An agent of an endpoint that refuses unverified todos (``accept_unverified`` off): they
    # are invisible to its claims and lists, exactly like a todo outside its scope.
    hides_unverified: bool = False
    is_operator: bool = False

    @classmethod
    def agent(cls, endpoint, session_id: str) -> "Caller":
        queues = None if endpoint.all_queues else tuple(endpoint.scope)
        return cls(endpoint=endpoint, actor=session_id, queues=queues,
                   hides_unverified=refuses_unverified(endpoint))

    @classmethod
    def operator(cls, endpoint, username: str) -> "Caller":
        # The endpoint's owner (or a superuser) sees every queue of it.
        return cls(endpoint=endpoint, actor=username, queues=None, is_operator=True)

    def covers(self, queue: str) -> bool:
        return self.queues is None or queue in self.queues


@dataclass(frozen=True)
class HeldLease:
    """The lease an operator override acts on, as the operator saw it (board or admin). The
    override is fenced by both values, so it acts on exactly that lease or on nothing, and the
    event can name the lease it overrode without reading the row first."""

    lease_id: str
    owner: str

    @classmethod
    def of(cls, todo) -> "HeldLease":
        return cls(lease_id=todo.lease_id or "", owner=todo.lease_owner or "")

    def as_detail(self) -> dict:
        # Hints, like the wire shape's lease_owner: enough to tell leases apart in the history,
        # nothing an agent could present as its lease.
        return {"lease_id": self.lease_id[:8], "lease_owner": self.owner[:8]}


# The operator's verbs as the console and admin name them once done.
ACTION_DONE = {
    "claim": "claimed", "complete": "completed", "fail": "failed", "extend": "extended the lease of",
    "release": "released", "retry": "re-queued", "promote": "promoted (now trust operator)",
    "priority": "set the priority of", "run_now": "made ready now",
    "approve": "approved", "reject": "rejected", "cancel": "cancelled",
}
OVERRIDABLE = frozenset({"complete", "fail", "extend", "release"})


def agent_lease_to_override(todo, username: str, action: str) -> HeldLease | None:
    """The lease an operator's action overrides: an agent's (anyone's but theirs) claim, or
    None when the operator acts on their own lease or on no lease."""
    if action in OVERRIDABLE and todo.state == State.CLAIMED and todo.lease_owner != username:
        return HeldLease.of(todo)
    return None


# -- SQL plumbing --------------------------------------------------------------------------------


@functools.cache
def _todo_columns() -> tuple:
    """The todo columns every statement RETURNs, in model field order, so rows become Todo
    instances without looking at cursor.description (which psycopg builds per execute)."""
    return tuple(field.column for field in Todo._meta.concrete_fields)


def todo_columns() -> tuple:
    """The columns a create statement RETURNs, in the order ``todo_from_row`` reads them."""
    return _todo_columns()


def _returning() -> str:
    return ", ".join(_todo_columns())


def _fetch_todos(sql: str, params: dict) -> list[Todo]:
    """Execute a statement that RETURNs ``_returning()`` columns; the rows as Todo instances."""
    return [statements.instance_from_fetched(Todo, "todos_todo", row)
            for row in statements.fetch_all(sql, params)]


def _todo_from_row(row) -> Todo:
    return statements.instance_from_loaded_row(Todo, "todos_todo", row)


# The event detail a transition from any of several states adds about the row it changed
# (``from_prior``): the lease it overrode when the todo was claimed, the trust it raised.
# PostgreSQL builds it from the locked prior row ``o`` and the updated row ``t``;
# ``_prior_detail`` is the same for SQLite, from the prior row read in the transaction.
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
        detail["overridden_lease"] = HeldLease(
            lease_id=prior["lease_id"] or "", owner=prior["lease_owner"] or "").as_detail()
    if trust_after != prior["trust"]:
        detail["from_trust"] = prior["trust"]
    return detail


def _apply(*, set_sql: str, where_sql: str, params: dict, action_sql: str, from_state_sql: str,
           actor: str, now, detail=None, endpoint=None, from_prior=False) -> list[Todo]:
    """Run one guarded UPDATE and write one todo event per changed row.

    ``action_sql`` and ``from_state_sql`` are SQL expressions over the updated row ``t``; they
    let one statement record, e.g., ``fail`` or ``dead_letter`` depending on the attempts left.
    ``from_prior``: a transition of the one todo ``%(todo_id)s`` from any of several states
    (``from_state_sql`` is then unused). The event's from state is the row's state before the
    statement, which RETURNING cannot give: PostgreSQL locks and reads the row first in the
    same statement (``o``, which the UPDATE's WHERE depends on, so it runs first; a change
    committed while ``o`` waited for the lock is what both then see), SQLite reads it inside
    the write transaction (one writer). ``_PRIOR_DETAIL_SQL`` adds what the prior row says.
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
    event_select = (
        f"SELECT t.id, {action_sql}, {from_state_sql}, t.state, %(actor)s, %(now)s, "
        f"{detail_sql}"
    )
    event_columns = "todo_id, action, from_state, to_state, actor, at, detail"
    update = (
        f"UPDATE todos_todo SET {set_sql}, updated_at = %(now)s WHERE {where_sql} "
        f"RETURNING {_returning()}"
    )
    if _is_postgres():
        sql = (
            f"WITH {prelude}t AS ({update}), "
            f"e AS (INSERT INTO todos_todoevent ({event_columns}) {event_select} FROM {event_from}) "
            f"SELECT * FROM t"
        )
        rows = _fetch_todos(sql, params)
    else:
        with transaction.atomic():
            if from_prior:
                prior = Todo.objects.filter(pk=params["todo_id"]).values(
                    "state", "trust", "lease_id", "lease_owner").first()
            rows = _fetch_todos(update, params)
            if rows and from_prior:
                params["from_state"] = prior["state"]
                params["detail"] = json.dumps(
                    {**(detail or {}), **_prior_detail(prior, rows[0].trust)})
            if rows:
                params["ids"] = json.dumps([row.pk for row in rows])
                with connection.cursor() as cursor:
                    cursor.execute(
                        f"INSERT INTO todos_todoevent ({event_columns}) {event_select} "
                        f"FROM todos_todo t WHERE t.id IN (SELECT value FROM json_each(%(ids)s))",
                        params,
                    )
    for row in rows:
        if endpoint is not None and row.endpoint_id == endpoint.pk:
            # Spare the serializer a query per row; set as select_related does (the field's
            # descriptor would check the instance's type and state first).
            row._state.fields_cache["endpoint"] = endpoint
    return rows


def _one(rows):
    return rows[0] if rows else None


def _lease_ttl(caller: Caller, lease_ttl_seconds) -> timedelta:
    if lease_ttl_seconds is None:
        return caller.endpoint.effective_lease
    if isinstance(lease_ttl_seconds, bool) or not isinstance(lease_ttl_seconds, (int, float)):
        raise Refusal("invalid_argument", "lease_ttl_seconds must be a number of seconds")
    # Range-check the number before building a timedelta: NaN fails every comparison (so it is
    # refused here) and a huge value would overflow timedelta.
    if not MIN_LEASE.total_seconds() <= lease_ttl_seconds <= MAX_LEASE.total_seconds():
        raise Refusal("invalid_argument", "lease_ttl_seconds must be between 1 and 86400")
    return timedelta(seconds=lease_ttl_seconds)


def _check_storable(**values) -> None:
    # Text or numbers no database can store (NUL, a lone surrogate, NaN, too deep): refused
    # naming the field, by the one walk every surface uses (switchboard/json_input.py).
    problem = json_input.find_unstorable(values)
    if problem is not None:
        raise Refusal("invalid_argument", problem)


def _visible_guard(caller: Caller, params: dict) -> str:
    """The guard that makes a todo outside the caller's endpoint or scope invisible."""
    params["endpoint_id"] = caller.endpoint.pk
    guard = "endpoint_id = %(endpoint_id)s"
    if caller.queues is not None:
        params["queues"] = dialect.text_list(caller.queues)
        guard += " AND " + dialect.text_in("queue", "queues")
    return guard


def _by_id(guard: str) -> str:
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


def _todo_id(todo_id) -> int:
    # Ids are ASCII decimal strings (or ints): int() alone would also take " 4" or "٤".
    if isinstance(todo_id, int) and not isinstance(todo_id, bool):
        value = todo_id
    elif isinstance(todo_id, str) and todo_id.isascii() and todo_id.isdigit() and len(todo_id) < 20:
        value = int(todo_id)
    else:
        raise Refusal("not_found", f"no todo {str(todo_id)[:40]!r}")
    if not 0 < value < 2**63:
        raise Refusal("not_found", f"no todo {todo_id!r}")
    return value


def _explain_refusal(caller: Caller, todo_id: int, lease_id=None, *, claiming=False, now=None,
                     completing=False, overriding=None) -> Refusal:
    """After a guard missed: read the row once and say why. Invisible looks like missing."""
    todo = Todo.objects.filter(pk=todo_id, endpoint_id=caller.endpoint.pk).first()
    # An unverified todo hidden from this agent (accept_unverified off) is missing for every
    # verb, not only claim: a fenced verb's "lease_lost … is pending" told it exists.
    # Its holder (a claim from before the setting changed) still hears about its own lease.
    hidden = (caller.hides_unverified and todo is not None and todo.trust == Trust.UNVERIFIED
              and (claiming or todo.lease_owner != caller.actor))
    if todo is None or not caller.covers(todo.queue) or hidden:
        return Refusal("not_found", f"no todo {todo_id}")
    if claiming and todo.state == State.AWAITING_APPROVAL:
        return Refusal("awaiting_approval", f"todo {todo_id} waits for its operator's approval; "
                                            "it cannot be claimed until it is approved")
    if claiming and todo.state == "pending" and caller.endpoint.is_paused(todo.queue):
        return Refusal("paused", f"queue {todo.queue} of this endpoint is paused by its operator")
    if (claiming and todo.state == "pending" and todo.not_before is not None
            and (now is None or todo.not_before > now)):
        return Refusal("scheduled", f"todo {todo_id} is scheduled: not before "
                                    f"{queries.iso_time(todo.not_before)}; claim it then")
    if claiming and todo.state == "pending" and caller.endpoint.has_claim_caps:
        # Pending, visible and not paused: the capacity guard is what held it back.
        return Refusal("at_capacity", f"this endpoint (or queue {todo.queue}) has as many todos "
                                      "claimed as its cap allows; claim again when one settles")
    if claiming:
        return Refusal("not_claimable", f"todo {todo_id} is {todo.state}, not pending")
    if overriding is not None:
        return Refusal("lease_lost", f"todo {todo_id} is {todo.state} and the agent's lease "
                                     "you acted on has ended or changed; nothing was changed")
    held = todo.lease_id == lease_id if lease_id else todo.lease_owner == caller.actor
    holder = "you" if caller.is_operator else ("this lease" if lease_id else "this session")
    if held and todo.state == State.DONE and completing:
        # The same lease already completed it: a retry after a lost answer, not a conflict.
        return Refusal("already_done", f"todo {todo_id} is already done: {holder} completed it "
                                       "and the result was recorded; nothing more to do")
    if held and todo.state == State.CLAIMED and now is not None and todo.lease_expires_at <= now:
        whose = "your lease" if lease_id or caller.is_operator else "the lease this session held"
        return Refusal("lease_lost", f"{whose} on todo {todo_id} lapsed at "
                                     f"{todo.lease_expires_at.isoformat()}; the todo goes back to "
                                     "the queue: stop working on it")
    if todo.state == State.CANCELLED:
        return Refusal("lease_lost", f"todo {todo_id} was cancelled by its operator: stop "
                                     "working on it; nothing was changed")
    if todo.state == State.PENDING:
        return Refusal("lease_lost", f"todo {todo_id} is pending and not held by {holder}; "
                                     "claim it again to work on it")
    return Refusal("lease_lost", f"todo {todo_id} is {todo.state} and not held by {holder}")


def _fence(params: dict, caller: Caller, lease_id, overriding=None) -> str:
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


def _lease_set(params: dict, caller: Caller, ttl: timedelta, now) -> str:
    params.update(
        lease_id=secrets.token_urlsafe(16),
        owner=caller.actor,
        expires=dialect.db_time(now + ttl),
        ttl=dialect.db_duration(ttl),
    )
    return (
        "state = 'claimed', lease_id = %(lease_id)s, lease_owner = %(owner)s, "
        "lease_expires_at = %(expires)s, lease_ttl = %(ttl)s, attempts = attempts + 1, "
        "retry_at = NULL, not_before = NULL"
    )


def _announce(todos, action: str):
    for todo in todos:
        publish.publish_on_commit(todo, action)


# -- create --------------------------------------------------------------------------------------


# The create statement's pieces, shared with ingest's one-statement delivery
# (ingest.transitions), which inserts the todo in the statement that records its delivery.
_CREATE_COLUMNS = (
    "endpoint_id, queue, state, title, kind, source, payload, idempotency_key, delivery_event_id,"
    " trust, attempts, max_attempts, created_at, updated_at, ring_attempts, priority, not_before"
)
# Which todos hold their idempotency key (the partial unique index todo_live_idempotency_key).
# The conflict target names that index by its columns and predicate, spelled exactly as the
# migration wrote it: SQLite matches the predicate textually.
_LIVE_KEY_PREDICATE = (
    "\"idempotency_key\" IS NOT NULL AND (\"state\" IN ('pending', 'claimed', 'awaiting_approval')"
    " OR "
    "(\"dead_lettered_at\" IS NULL AND \"state\" = 'failed'))"
)
_LIVE_KEY_CONFLICT = (
    f"ON CONFLICT (endpoint_id, idempotency_key) WHERE ({_LIVE_KEY_PREDICATE}) DO NOTHING")
# SQL over ``create_todo_params``: true when a live todo of the endpoint already holds the key,
# so the create would insert nothing. For a statement that would rather not start writing
# (ingest's one-statement delivery); the conflict clause stays what decides under a race.
LIVE_KEY_HELD_SQL = (
    "EXISTS (SELECT 1 FROM todos_todo WHERE endpoint_id = %(endpoint_id)s"
    f" AND idempotency_key = %(key)s AND {_LIVE_KEY_PREDICATE})"
)
_CREATE_EVENT_COLUMNS = "todo_id, action, from_state, to_state, actor, at, detail"


def _create_values(delivery_event_sql: str) -> str:
    return (f"%(endpoint_id)s, %(queue)s, %(state)s, %(title)s, %(kind)s, %(source)s, "
            f"{dialect.jsonb('payload')}, %(key)s, {delivery_event_sql}, %(trust)s, 0, %(max_attempts)s, "
            "%(now)s, %(now)s, 0, %(priority)s, %(not_before)s")


def create_todo_params(*, endpoint, queue: str, title: str, actor: str, payload=None,
                       kind: str = "", source: str = "", idempotency_key: str | None = None,
                       delivery_event_id=None, trust: str = Trust.UNVERIFIED, now,
                       payload_storable: bool = False, priority: int = PRIORITY_DEFAULT,
                       not_before=None, requires_approval: bool = False) -> dict:
    """The parameters of a create statement (``create_todo``, ``create_todo_ctes``): the title
    folded to one line of at most ``MAX_TITLE_CHARS``. Refuses ``invalid_argument`` for a value no
    database can store; ``payload_storable`` says the caller already knows the payload is
    (ingest: ``json_input.is_plainly_storable`` of the text it was parsed from).
    ``priority`` (``check_priority``) and ``not_before`` (``resolve_not_before``: a future
    time, or None for ready at once) are the work-control settings it starts with;
    ``requires_approval``: the todo is created ``awaiting_approval`` instead of ``pending``."""
    title = " ".join(str(title).split())[:MAX_TITLE_CHARS] or "(untitled)"
    check_priority(priority)
    _check_storable(title=title, kind=kind or "", queue=queue,
                    **({} if payload_storable else {"payload": payload}))
    return {
        "endpoint_id": endpoint.pk,
        "queue": queue,
        "state": State.AWAITING_APPROVAL if requires_approval else State.PENDING,
        "title": title,
        "kind": kind or "",
        "source": source or "",
        "payload": json.dumps(payload if payload is not None else {}),
        "key": idempotency_key,
        "delivery_event_id": delivery_event_id,
        "trust": trust,
        "max_attempts": endpoint.max_attempts,
        "priority": priority,
        "not_before": dialect.db_time(not_before),
        "now": dialect.db_time(now),
        "actor": actor,
        "detail": json.dumps({"delivery_event": delivery_event_id}),
    }


@functools.cache
def create_todo_ctes(*, delivery_event_sql: str = "%(delivery_event_id)s", source_sql: str = "",
                     where_sql: str = "") -> str:
    """PostgreSQL: the todo INSERT (``t``, RETURNing the whole row, nothing when a live todo
    holds the key) and its ``create`` event (``e``) as data-modifying CTEs, over the params of
    ``create_todo_params``. ``source_sql``/``where_sql`` make it an INSERT … SELECT (``FROM x
    WHERE …``), so another statement can feed it the delivery event id it just inserted."""
    values = _create_values(delivery_event_sql)
    rows = f"SELECT {values} {source_sql}{where_sql}" if source_sql else f"VALUES ({values})"
    return (
        f"t AS (INSERT INTO todos_todo ({_CREATE_COLUMNS}) {rows} {_LIVE_KEY_CONFLICT}"
        f" RETURNING {_returning()}), e AS (INSERT INTO todos_todoevent ({_CREATE_EVENT_COLUMNS})"
        f" SELECT t.id, 'create', NULL, t.state, %(actor)s, %(now)s,"
        " jsonb_build_object('delivery_event', t.delivery_event_id) FROM t)"
    )


def announce_created(todo: Todo, endpoint) -> None:
    """A created todo, announced once its transaction commits (doorbell, board). One awaiting
    approval reaches the board; the doorbell and long polls act only on pending todos, so it
    rings nobody until ``approve_todo`` announces it ready."""
    todo.endpoint = endpoint
    publish.publish_on_commit(todo, "create")


def todo_from_row(row) -> Todo:
    """A Todo from a PostgreSQL row of the whole-row RETURNING columns (``create_todo_ctes``)."""
    return _todo_from_row(row)


def create_todo(*, endpoint, queue: str, title: str, actor: str, payload=None, kind: str = "",
                source: str = "", idempotency_key: str | None = None, delivery_event=None,
                trust: str = Trust.UNVERIFIED, now=None,
                payload_storable: bool = False, priority: int = PRIORITY_DEFAULT,
                not_before=None, requires_approval: bool = False) -> tuple[Todo, bool]:
    """Create a pending todo (``awaiting_approval`` with ``requires_approval``: not claimable,
    never rung until approved), or return the live todo that already holds ``idempotency_key``.
    ``payload_storable``: the caller has checked the payload (``create_todo_params``).

    Returns ``(todo, created)``. Concurrent creates with one key collapse on the partial unique
    index ``todo_live_idempotency_key``: the loser's INSERT … ON CONFLICT DO NOTHING waits for the
    winner to commit, inserts nothing, and we return the winner's row. Only ``create`` is
    announced; a duplicate announces nothing.
    """
    now = now or timezone.now()
    params = create_todo_params(
        endpoint=endpoint, queue=queue, title=title, actor=actor, payload=payload, kind=kind,
        source=source, idempotency_key=idempotency_key, trust=trust, now=now,
        delivery_event_id=getattr(delivery_event, "pk", delivery_event),
        payload_storable=payload_storable, priority=priority, not_before=not_before,
        requires_approval=requires_approval)
    # A duplicate whose holder finishes between our conflict and our read frees the key; the
    # next INSERT then succeeds. Three rounds is more than that race can need.
    for _ in range(3):
        if _is_postgres():
            created = _one(_fetch_todos(f"WITH {create_todo_ctes()} SELECT * FROM t", params))
        else:
            with transaction.atomic():
                created = _one(_fetch_todos(
                    f"INSERT INTO todos_todo ({_CREATE_COLUMNS})"
                    f" VALUES ({_create_values('%(delivery_event_id)s')}) {_LIVE_KEY_CONFLICT}"
                    f" RETURNING {_returning()}", params))
                if created is not None:
                    params["todo_id"] = created.pk
                    with connection.cursor() as cursor:
                        cursor.execute(
                            f"INSERT INTO todos_todoevent ({_CREATE_EVENT_COLUMNS}) VALUES"
                            " (%(todo_id)s, 'create', NULL, %(state)s, %(actor)s, %(now)s,"
                            f" {dialect.jsonb('detail')})", params)
        if created is not None:
            announce_created(created, endpoint)
            return created, True
        existing = queries.live_todo_holding_key(endpoint, idempotency_key)
        if existing is not None:
            existing.endpoint = endpoint
            return existing, False
    raise RuntimeError(f"idempotency key {idempotency_key!r} kept conflicting")


# -- agent (and operator) verbs -----------------------------------------------------------------


def claim_todo(caller: Caller, todo_id, *, lease_ttl_seconds=None, now=None) -> Todo:
    """pending -> claimed for ``todo_id`` under a fresh lease; counts one attempt.

    Refuses ``not_found`` (missing or invisible to the caller), ``not_claimable`` (not pending),
    ``paused`` (its queue is paused), ``scheduled`` (its ``not_before`` has not come),
    ``at_capacity`` (the endpoint or the queue has as many todos claimed as its cap allows),
    ``invalid_argument`` (lease ttl outside 1 s … 24 h). A scheduled todo whose time has come
    is claimable at once, before the due sweep has cleared its ``not_before``.
    """
    now = now or timezone.now()
    ttl = _lease_ttl(caller, lease_ttl_seconds)
    todo_id = _todo_id(todo_id)
    params = {"todo_id": todo_id}
    where = _by_id(_visible_guard(caller, params) + " AND state = 'pending'"
                   + " AND (not_before IS NULL OR not_before <= %(now)s)"
                   + _trust_filter(caller.hides_unverified)
                   + _unpaused_where(caller.endpoint, params)
                   + _claim_cap_guard(caller.endpoint, params, lock_row_first=True))
    todo = _one(_apply(
        set_sql=_lease_set(params, caller, ttl, now), where_sql=where, params=params,
        action_sql="'claim'", from_state_sql="'pending'", actor=caller.actor, now=now,
        endpoint=caller.endpoint,
    ))
    if todo is None:
        raise _explain_refusal(caller, todo_id, claiming=True, now=now)
    _announce([todo], "claim")
    return todo


def _trust_filter(hide_unverified: bool, column: str = "trust") -> str:
    """The clause that hides unverified todos from a caller that refuses them; a
    constant, no parameter. Checked on the rows the claim indexes yield in order, so a queue
    whose head is unverified costs a step past it, not a different plan."""
    return f" AND {column} <> 'unverified'" if hide_unverified else ""


def _unpaused_where(endpoint, params: dict) -> str:
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
# A cap must hold against concurrent claims, so it is checked inside the claim's one statement,
# never read first in Python. Of the two ways to do that under READ COMMITTED, a guarded counter
# row would have to be decremented by every transition that ends a claim (complete, fail,
# release, the reaper, overrides, cancel), in their statements, and drift the day one forgot;
# counting the claimed todos needs no upkeep but must count after a per-endpoint lock, with a
# snapshot taken after it, hence a function (docs/decisions/claim-caps-in-the-statement.md).
# Only endpoints with a cap pay for it: for the rest the statement is unchanged.


def _claim_cap_guard(endpoint, params: dict, *, lock_row_first: bool = False) -> str:
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
                " %(max_claimed)s::integer, (%(queue_limits)s::jsonb ->> todos_todo.queue)::integer)")
    claimed = ("SELECT count(*) FROM todos_todo c WHERE c.endpoint_id = todos_todo.endpoint_id"
               " AND c.state = 'claimed'")
    # A queue without a cap compares with NULL, which COALESCE turns into "fits".
    return (f" AND (%(max_claimed)s IS NULL OR ({claimed}) < %(max_claimed)s)"
            f" AND COALESCE(({claimed} AND c.queue = todos_todo.queue) < (SELECT value FROM"
            " json_each(%(queue_limits)s) WHERE key = todos_todo.queue), 1)")


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
        full = (f"ARRAY(SELECT l.key FROM jsonb_each_text(%(queue_limits)s::jsonb) l"
                f" WHERE ({claimed} AND c.queue = l.key) >= l.value::integer)")
        return (f" AND (%(max_claimed)s::integer IS NULL OR ({claimed}) < %(max_claimed)s::integer)"
                f" AND {column} <> ALL({full})")
    full = (f"SELECT l.key FROM json_each(%(queue_limits)s) l"
            f" WHERE ({claimed} AND c.queue = l.key) >= l.value")
    return (f" AND (%(max_claimed)s IS NULL OR ({claimed}) < %(max_claimed)s)"
            f" AND {column} NOT IN ({full})")


def held_back_by_cap(caller: Caller, wanted, hide_unverified: bool) -> bool:
    """After an empty claim_next: whether a cap is what left it empty — the endpoint is at its
    cap with a todo it could claim pending, or such a todo waits in a queue at its own cap
    (the pick skipped those queues, so what it missed elsewhere was a race, and the caller
    retries). A read for the answer's sake only; the claim statement's guard enforces caps."""
    endpoint = caller.endpoint
    claimed = dict(Todo.objects.filter(endpoint_id=endpoint.pk, state=State.CLAIMED)
                   .values_list("queue").annotate(n=models.Count("id")).values_list("queue", "n"))
    if endpoint.max_claimed is not None and sum(claimed.values()) >= endpoint.max_claimed:
        return _claimable_exists(caller, wanted, hide_unverified)
    full = [queue for queue, cap in (endpoint.queue_limits or {}).items()
            if claimed.get(queue, 0) >= cap and (wanted is None or queue in wanted)
            and not endpoint.is_paused(queue)]
    return bool(full) and _claimable_exists(caller, full, hide_unverified)
# Ready to claim, over a todo row (``{t}``: its alias and a dot, or nothing): the predicate of
# the claim indexes, spelled so the planner sees that it implies it.
_READY_SQL = "{t}state = 'pending' AND {t}not_before IS NULL"
# The claim order, the claim indexes' key order after endpoint (and queue).
_CLAIM_ORDER = "{t}priority DESC, {t}created_at, {t}id"


def claim_candidate_sql(params: dict, queues, *, hide_unverified: bool = False,
                        endpoint=None) -> str:
    """The sub-select that picks (and on PostgreSQL locks) claim_next's candidate: the ready
    todo of ``params["endpoint_id"]`` with the highest priority, then the oldest, in ``queues``
    (None = every queue not paused on ``endpoint``), unverified ones left out when
    ``hide_unverified``. Kept apart so the plan test can EXPLAIN exactly what claim_next runs.

    Ready is ``state = 'pending' AND not_before IS NULL`` (``_READY_SQL``): the predicate of
    both claim indexes, whose key order is ``_CLAIM_ORDER``; a scheduled todo becomes ready
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
                f" AND p.queue = q.name AND {_READY_SQL.format(t='p.')}"
                f"{_trust_filter(hide_unverified, 'p.trust')}{room}"
                f" ORDER BY {_CLAIM_ORDER.format(t='p.')}", "h.id, h.priority, h.created_at",
                endpoint)
            + f") c ORDER BY {_CLAIM_ORDER.format(t='c.')} LIMIT 1"
        )
    queue_filter = ""
    if queues is not None:
        params["queues"] = dialect.text_list(queues)
        queue_filter = " AND " + dialect.text_in("queue", "queues")
    elif endpoint is not None:
        queue_filter = _unpaused_where(endpoint, params)
    ordered = (
        f"SELECT id FROM todos_todo WHERE endpoint_id = %(endpoint_id)s AND {_READY_SQL.format(t='')}"
        f"{queue_filter}{_trust_filter(hide_unverified)}{room}"
        f" ORDER BY {_CLAIM_ORDER.format(t='')}"
    )
    return _first_unheld(ordered, "h.id", endpoint) if _is_postgres() else ordered + " LIMIT 1"


def _first_unheld(ordered_sql: str, columns: str, endpoint) -> str:
    """PostgreSQL: the first row of ``ordered_sql`` (the claim order) that no other claim
    holds, now held by this one (``todo_claim_hold``: a claim's own advisory lock, and the row
    re-read fresh). Not a row lock with SKIP LOCKED: a digest or a ring stamping
    last_ringed_at locks rows too, and a todo held only by that bookkeeping is still the one
    to hand out (the claim's UPDATE waits the moment it takes). The function is applied
    outside the ordered sub-select, which PostgreSQL neither flattens (it has an ORDER BY) nor
    pushes a volatile condition into, so it runs on rows in claim order and stops at the
    first it holds, whatever plan reads them. An endpoint with caps has its cap lock taken
    first, so its claims pick in turn (a claim that passed over a held todo must not take the
    last slot before the claim holding it is checked)."""
    capped = (", FALSE, %(endpoint_id)s::bigint"
              if endpoint is not None and endpoint.has_claim_caps else "")
    return f"SELECT {columns} FROM ({ordered_sql}) h WHERE todo_claim_hold(h.id{capped}) LIMIT 1"


def claim_next_todo(caller: Caller, *, queues=None, lease_ttl_seconds=None, verified_only=False,
                    now=None) -> Todo | None:
    """Atomically claim the ready todo with the highest priority, then the oldest, in the
    caller's granted queues (or the given subset of them); None when there is none. Concurrent callers each get a different todo.
    ``verified_only``: skip ``unverified`` todos (as an endpoint that refuses them always does),
    so a worker that runs commands claims only what an authenticated sender handed over.

    PostgreSQL: the candidate is held by the claim's own lock inside the same statement
    (``_first_unheld``), so a competing worker skips it instead of waiting, while a todo that
    only a digest or a ring holds for a moment is still handed out in its turn. With a list of
    queues, each queue is probed on its own (LATERAL … LIMIT 1 on ``todo_claim_by_queue``) and
    the best head wins: ``queue = ANY(…) ORDER BY created_at`` cannot use the index order, so it
    sorts the matching rows instead. SQLite: the same statement without the lock clause; its
    single writer serializes claims. Refuses
    ``not_in_scope`` when ``queues`` names a queue outside the caller's grant, and ``at_capacity``
    when only a cap keeps it from claiming (``held_back_by_cap``; the MCP tool answers that as an
    empty result, not an error).
    """
    now = now or timezone.now()
    ttl = _lease_ttl(caller, lease_ttl_seconds)
    if queues is not None:
        if isinstance(queues, str) or not all(isinstance(q, str) for q in queues) or not queues:
            raise Refusal("invalid_argument", "queues must be a non-empty list of queue names")
        outside = sorted(q for q in set(queues) if not caller.covers(q))
        if outside:
            raise Refusal("not_in_scope", f"queues outside this endpoint's scope: {outside}")
        wanted = sorted(set(queues))
    else:
        wanted = None if caller.queues is None else sorted(caller.queues)
    # Pause: paused queues are skipped; with every wanted queue paused there is nothing.
    wanted = caller.endpoint.unpaused(wanted)
    if wanted == [] or caller.endpoint.paused_all:
        return None
    params = {"endpoint_id": caller.endpoint.pk}
    hide_unverified = caller.hides_unverified or bool(verified_only)
    pick = claim_candidate_sql(params, wanted, hide_unverified=hide_unverified,
                               endpoint=caller.endpoint)
    for pause_seconds in (*CLAIM_PAUSES_WHILE_LOCKED_SECONDS, None):
        todo = _one(_apply(
            set_sql=_lease_set(params, caller, ttl, now),
            where_sql=f"id = ({pick}) AND {_READY_SQL.format(t='')}"
                      + _claim_cap_guard(caller.endpoint, params), params=params,
            action_sql="'claim'", from_state_sql="'pending'", actor=caller.actor, now=now,
            endpoint=caller.endpoint,
        ))
        if todo is not None:
            _announce([todo], "claim")
            return todo
        # A cap holding it back is an answer, not a lock to wait out: no retry.
        if caller.endpoint.has_claim_caps and held_back_by_cap(caller, wanted, hide_unverified):
            raise Refusal("at_capacity", "as many todos are claimed as this endpoint's caps "
                                         "allow; claim again when one settles")
        if pause_seconds is None or not _is_postgres() or not _claimable_exists(
                caller, wanted, hide_unverified):
            if pause_seconds is None and caller.endpoint.has_claim_caps:
                # Every try lost to concurrent claims filling the cap as fast as it freed.
                raise Refusal("at_capacity", "this endpoint's caps are taken by concurrent "
                                             "claims; claim again when one settles")
            return None
        time.sleep(pause_seconds)
    return None


# The pick passes over rows other claims hold, and one of those may stay pending (its claim's
# guard refused it: a cap, a pause); a claim by id or an operator's action may also take the
# picked row between the pick and the UPDATE. Either way the claim found "nothing" while a todo
# waited. So an empty claim looks once more, without locks: while a claimable row exists it
# tries again after a short pause. A row another claim holds stops existing as pending when
# that claim commits, so contention costs a retry or two, and an empty queue one extra index
# probe.
CLAIM_PAUSES_WHILE_LOCKED_SECONDS = (0.002, 0.005, 0.01, 0.02, 0.04)


def _claimable_exists(caller: Caller, wanted, hide_unverified: bool) -> bool:
    todos = Todo.objects.filter(endpoint_id=caller.endpoint.pk, state=State.PENDING,
                                not_before__isnull=True)
    if wanted is not None:
        todos = todos.filter(queue__in=wanted)
    elif caller.endpoint.paused_queues:
        todos = todos.exclude(queue__in=caller.endpoint.paused_queues)
    if hide_unverified:
        todos = todos.exclude(trust=Trust.UNVERIFIED)
    return todos.exists()


def _fenced(caller: Caller, todo_id, lease_id, *, set_sql, params, action_sql, action, now,
            detail=None, overriding=None) -> Todo:
    todo_id = _todo_id(todo_id)
    params["todo_id"] = todo_id
    where = _by_id(_visible_guard(caller, params) + " AND "
                   + _fence(params, caller, lease_id, overriding))
    if overriding is not None:
        if not caller.is_operator:
            raise ValueError("only an operator overrides another holder's lease")
        detail = {**(detail or {}), "override": True, "overridden_lease": overriding.as_detail()}
    todo = _one(_apply(
        set_sql=set_sql, where_sql=where, params=params, action_sql=action_sql,
        from_state_sql="'claimed'", actor=caller.actor, now=now, detail=detail,
        endpoint=caller.endpoint,
    ))
    if todo is None:
        raise _explain_refusal(caller, todo_id, lease_id, now=now, completing=action == "complete",
                               overriding=overriding)
    _announce([todo], action)
    return todo


# An override that ends the lease (complete, fail) takes the row out of the agent's hands: the
# lease it saw is cleared and the operator is recorded as the last holder, so the agent's retry
# is lease_lost (not already_done: the agent did not complete it).
_TAKE_OVER_SQL = ", lease_id = NULL, lease_owner = %(actor)s"


def heartbeat_todo(caller: Caller, todo_id, *, lease_id=None, lease_ttl_seconds=None, now=None,
                   overriding: HeldLease | None = None) -> Todo:
    """Extend the caller's lease. Fenced: refuses ``lease_lost`` unless the todo is claimed by
    this lease (``lease_id``) or, without one, by this caller, and that lease has not lapsed.

    With ``lease_ttl_seconds`` the lease expires at ``now + ttl`` and that ttl becomes the
    lease's length; without, it expires at ``now +`` the lease's own stored length (the ttl it
    was granted), so a heartbeat never shortens a lease the caller did not ask to shorten.
    ``overriding``: an operator extends an agent's lease (the agent keeps it).
    """
    now = now or timezone.now()
    if lease_ttl_seconds is None:
        params = {"default_ttl": dialect.db_duration(caller.endpoint.effective_lease)}
        # COALESCE: leases granted before the length was stored extend by the default.
        set_sql = "lease_expires_at = " + dialect.plus_duration(
            "now", "COALESCE(lease_ttl, %(default_ttl)s)")
    else:
        ttl = _lease_ttl(caller, lease_ttl_seconds)
        params = {"expires": dialect.db_time(now + ttl), "ttl": dialect.db_duration(ttl)}
        set_sql = "lease_expires_at = %(expires)s, lease_ttl = %(ttl)s"
    return _fenced(caller, todo_id, lease_id, set_sql=set_sql, params=params,
                   action_sql="'heartbeat'", action="heartbeat", now=now, overriding=overriding)


def complete_todo(caller: Caller, todo_id, *, lease_id=None, result=None, now=None,
                  overriding: HeldLease | None = None) -> Todo:
    """claimed -> done (terminal), storing ``result``. Fenced like heartbeat. The row keeps the
    completing lease, so the same lease completing again is told ``already_done`` (a retry
    after a lost answer), anyone else ``lease_lost``. Refuses ``invalid_argument`` for a result
    no database can store (NaN, NUL, …)."""
    now = now or timezone.now()
    _check_storable(result=result)
    params = {"result": json.dumps(result) if result is not None else None}
    set_sql = f"state = 'done', result = {dialect.jsonb('result')}, lease_expires_at = NULL"
    if overriding is not None:
        set_sql += _TAKE_OVER_SQL
    return _fenced(caller, todo_id, lease_id, params=params, action_sql="'complete'",
                   action="complete", set_sql=set_sql, now=now, overriding=overriding)


def _retry_at_by_attempts(now) -> tuple[str, dict]:
    """A CASE over ``attempts`` giving now + 30 s * 2**(attempts-1), capped at 15 min."""
    params, branches = {}, []
    for attempt in range(1, _BACKOFF_STEPS):
        backoff = min(FIRST_RETRY_BACKOFF * 2 ** (attempt - 1), MAX_RETRY_BACKOFF)
        params[f"retry_{attempt}"] = dialect.db_time(now + backoff)
        branches.append(f"WHEN attempts <= {attempt} THEN %(retry_{attempt})s")
    params["retry_cap"] = dialect.db_time(now + MAX_RETRY_BACKOFF)
    return "CASE " + " ".join(branches) + " ELSE %(retry_cap)s END", params


def fail_todo(caller: Caller, todo_id, *, lease_id=None, error=None, result=None, now=None,
              overriding: HeldLease | None = None) -> Todo:
    """claimed -> failed. With attempts left, ``retry_at = now + backoff`` (30 s doubling, cap
    15 min); with attempts spent, a dead letter (``retry_at`` null, ``dead_lettered_at`` set).
    Fenced like heartbeat."""
    now = now or timezone.now()
    if error is not None and not isinstance(error, str):
        raise Refusal("invalid_argument", "error must be a string")
    _check_storable(error=error, result=result)
    retry_case, params = _retry_at_by_attempts(now)
    params.update(error=error, result=json.dumps(result) if result is not None else None)
    spent = "attempts >= max_attempts"
    set_sql = (
        f"state = 'failed', last_error = %(error)s, result = COALESCE({dialect.jsonb('result')}, result), "
        f"lease_expires_at = NULL, "
        f"dead_lettered_at = CASE WHEN {spent} THEN %(now)s ELSE NULL END, "
        f"retry_at = CASE WHEN {spent} THEN NULL ELSE {retry_case} END"
    )
    if overriding is not None:
        set_sql += _TAKE_OVER_SQL
    return _fenced(
        caller, todo_id, lease_id, set_sql=set_sql, params=params, action="fail", now=now,
        action_sql="CASE WHEN t.dead_lettered_at IS NULL THEN 'fail' ELSE 'dead_letter' END",
        detail={"error": error} if error else None, overriding=overriding,
    )


def release_todo(caller: Caller, todo_id, *, lease_id=None, now=None,
                 overriding: HeldLease | None = None) -> Todo:
    """claimed -> pending at once, refunding the attempt the claim counted. Fenced; with
    ``overriding``, an operator frees an agent's (possibly stuck) lease."""
    now = now or timezone.now()
    set_sql = (
        "state = 'pending', lease_id = NULL, lease_owner = NULL, lease_expires_at = NULL, "
        "lease_ttl = NULL, attempts = CASE WHEN attempts > 0 THEN attempts - 1 ELSE 0 END"
    )
    return _fenced(caller, todo_id, lease_id, set_sql=set_sql, params={}, now=now,
                   action_sql="'release'", action="release", overriding=overriding)


# -- humans --------------------------------------------------------------------------------------


def requeue_todo(caller: Caller, todo_id, *, now=None) -> Todo:
    """failed (waiting or dead) -> pending with a fresh attempt budget ("retry now").

    Refuses ``not_found``, ``not_claimable`` (not failed) and ``conflict`` when a dead letter's
    idempotency key has since been taken by a newer live todo.
    """
    now = now or timezone.now()
    todo_id = _todo_id(todo_id)
    params = {"todo_id": todo_id}
    where = _by_id(_visible_guard(caller, params) + " AND state = 'failed'")
    try:
        with transaction.atomic():
            todo = _one(_apply(
                set_sql="state = 'pending', attempts = 0, retry_at = NULL, dead_lettered_at = NULL, "
                        "lease_id = NULL, lease_owner = NULL, lease_expires_at = NULL, "
                        "lease_ttl = NULL, ring_attempts = 0, last_ringed_at = NULL",
                where_sql=where, params=params, action_sql="'requeue'", from_state_sql="'failed'",
                actor=caller.actor, now=now, endpoint=caller.endpoint,
            ))
    except IntegrityError:
        raise Refusal("conflict", f"todo {todo_id}'s idempotency key is held by a newer live todo") from None
    if todo is None:
        todo_row = Todo.objects.filter(pk=todo_id, endpoint_id=caller.endpoint.pk).first()
        if todo_row is None or not caller.covers(todo_row.queue):
            raise Refusal("not_found", f"no todo {todo_id}")
        raise Refusal("not_claimable", f"todo {todo_id} is {todo_row.state}, not failed")
    _announce([todo], "requeue")
    return todo


def promote_todo(caller: Caller, todo_id, *, now=None) -> Todo:
    """The operator vouches for an unverified todo (docs/reference.md#trust): pending or
    awaiting approval and ``unverified`` -> trust ``operator``, in the same state, with a fresh
    ring budget, recorded as a ``promote`` event naming the operator (the actor). Announced as
    ready, so a pending one rings like a new todo and an endpoint that refuses unverified todos
    now hands it out; one awaiting approval stays gated (the doorbell rings only pending todos)
    until approved, which never changes trust itself.

    Refuses ``not_found`` (missing or invisible) and ``not_claimable`` (not pending or awaiting
    approval, or not unverified). Only operator surfaces (board, admin, API, command) call it.
    """
    return _operator_transition(
        caller, todo_id,
        guard="state IN ('awaiting_approval', 'pending') AND trust = 'unverified'",
        set_sql="trust = 'operator', ring_attempts = 0, last_ringed_at = NULL",
        action="promote", from_state_sql="t.state", detail={"from_trust": Trust.UNVERIFIED},
        now=now, wanted="only a pending or awaiting-approval unverified todo can be promoted")


def _operator_transition(caller: Caller, todo_id, *, guard: str, set_sql: str, action: str,
                         now, params=None, detail=None, from_state_sql: str = "'pending'",
                         wanted: str) -> Todo:
    """An operator's guarded change of the one todo ``todo_id`` (promote, priority, run now):
    the statement, its ``action`` event, the announcement. When ``guard`` (SQL over the row)
    does not hold: ``_wrong_state``'s refusal, ``wanted`` saying which todos it takes."""
    now = now or timezone.now()
    todo_id = _todo_id(todo_id)
    params = {**(params or {}), "todo_id": todo_id}
    todo = _one(_apply(
        set_sql=set_sql, where_sql=_by_id(_visible_guard(caller, params) + f" AND {guard}"),
        params=params, action_sql=f"'{action}'", from_state_sql=from_state_sql,
        actor=caller.actor, now=now, detail=detail, endpoint=caller.endpoint,
    ))
    if todo is None:
        raise _wrong_state(caller, todo_id, wanted)
    _announce([todo], action)
    return todo


# -- work control: priority and scheduled todos (docs/work-control.md) ---------------------------


def check_priority(value, *, field: str = "priority") -> int:
    """``value`` as a priority, or ``invalid_argument`` naming ``field``: an integer (not a
    bool, not 1.0) from PRIORITY_MIN to PRIORITY_MAX."""
    if (isinstance(value, bool) or not isinstance(value, int)
            or not PRIORITY_MIN <= value <= PRIORITY_MAX):
        raise Refusal("invalid_argument", f"{field} must be an integer from {PRIORITY_MIN} to "
                                          f"{PRIORITY_MAX}, got {str(value)[:40]!r}")
    return value


def resolve_not_before(*, not_before=None, delay_seconds=None, now):
    """When a new todo becomes ready, from a hand-over's ``not_before`` (ISO-8601 text with a
    time zone, or an aware datetime) or ``delay_seconds`` (0 … 30 days): the time, or None for
    at once. Refuses ``invalid_argument`` naming the field: both given, not a time or a number,
    more than MAX_SCHEDULE_AHEAD ahead, or a ``not_before`` more than
    NOT_BEFORE_PAST_TOLERANCE in the past (a mistake, not "run at once"). A time already come
    is None: the todo is ready at once, like any new one."""
    if not_before is not None and delay_seconds is not None:
        raise Refusal("invalid_argument", "not_before, delay_seconds: give one of them, not both")
    if delay_seconds is not None:
        limit = MAX_SCHEDULE_AHEAD.total_seconds()
        if (isinstance(delay_seconds, bool) or not isinstance(delay_seconds, (int, float))
                or not 0 <= delay_seconds <= limit):
            raise Refusal("invalid_argument", f"delay_seconds must be a number of seconds from 0 "
                                              f"to {int(limit)}")
        return now + timedelta(seconds=delay_seconds) if delay_seconds > 0 else None
    if not_before is None:
        return None
    when = not_before
    if isinstance(not_before, str):
        try:
            when = datetime.fromisoformat(not_before)
        except ValueError:
            when = None
    if not isinstance(when, datetime) or when.tzinfo is None:
        raise Refusal("invalid_argument",
                      "not_before must be an ISO-8601 time with a time zone, "
                      "such as YYYY-MM-DDTHH:MM:SSZ")
    if when < now - NOT_BEFORE_PAST_TOLERANCE:
        raise Refusal("invalid_argument", "not_before is in the past (more than a minute ago)")
    if when > now + MAX_SCHEDULE_AHEAD:
        raise Refusal("invalid_argument", f"not_before is more than "
                                          f"{MAX_SCHEDULE_AHEAD.days} days ahead")
    return when if when > now else None


def set_priority_todo(caller: Caller, todo_id, priority, *, now=None) -> Todo:
    """An operator changes the priority of a todo that waits: awaiting approval, pending
    (scheduled or not) or failed (waiting to retry, or dead, for when it is requeued). One
    ``prioritize`` event,
    its detail the new priority. Refuses ``invalid_argument`` (``check_priority``), ``not_found``
    and ``not_claimable`` (claimed or done: nothing waits to be ordered)."""
    check_priority(priority)
    return _operator_transition(
        caller, todo_id, guard="state IN ('awaiting_approval', 'pending', 'failed')",
        set_sql="priority = %(priority)s", params={"priority": priority}, action="prioritize",
        from_state_sql="t.state", detail={"priority": priority}, now=now,
        wanted="only a waiting todo's priority can change (awaiting approval, pending or "
               "failed)")


# A todo that becomes ready after waiting for its time starts with a fresh ring budget and no
# ring on record, as a new todo does: its doorbell and the heartbeat's backoff count from now.
_BECOMES_READY_SQL = "not_before = NULL, ring_attempts = 0, last_ringed_at = NULL"


def run_now_todo(caller: Caller, todo_id, *, now=None) -> Todo:
    """An operator runs a scheduled todo now: pending with ``not_before`` -> ready (cleared),
    announced as ready (doorbell, long-poll wake-up). One ``run_now`` event naming the
    operator. Refuses ``not_found`` and ``not_claimable`` (not a scheduled pending todo)."""
    return _operator_transition(
        caller, todo_id, guard="state = 'pending' AND not_before IS NOT NULL",
        set_sql=_BECOMES_READY_SQL, action="run_now", now=now,
        wanted="only a scheduled pending todo can run now")


# -- work control: cancel and the approval gate --------------------------------------------------


MAX_REASON_CHARS = 500


def _reason_detail(reason) -> dict:
    if reason is None:
        return {}
    if not isinstance(reason, str):
        raise Refusal("invalid_argument", "reason must be a string")
    reason = " ".join(reason.split())
    if len(reason) > MAX_REASON_CHARS:
        raise Refusal("invalid_argument", f"reason must be at most {MAX_REASON_CHARS} characters")
    _check_storable(reason=reason)
    return {"reason": reason} if reason else {}


def _operator_only(caller: Caller, verb: str) -> None:
    if not caller.is_operator:
        raise Refusal("verb_not_allowed", f"{verb} is for the endpoint's operator")


def _wrong_state(caller: Caller, todo_id: int, wanted: str) -> Refusal:
    """After an operator verb's guard missed: ``not_found`` for a todo the caller cannot see,
    else ``not_claimable`` naming the todo, the state it is in and which todos the verb takes
    (``wanted``): a conflict with the todo's state, the operator API's 409."""
    todo = Todo.objects.filter(pk=todo_id, endpoint_id=caller.endpoint.pk).only(
        "state", "queue").first()
    if todo is None or not caller.covers(todo.queue):
        return Refusal("not_found", f"no todo {todo_id}")
    return Refusal("not_claimable", f"todo {todo_id} is {todo.state}; {wanted}")


_CANCELLED_SET_SQL = (
    "state = 'cancelled', cancelled_at = %(now)s, lease_id = NULL, lease_owner = NULL, "
    "lease_expires_at = NULL, lease_ttl = NULL, retry_at = NULL"
)


def cancel_todo(caller: Caller, todo_id, *, reason=None, now=None) -> Todo:
    """awaiting_approval, pending, failed (waiting or dead) or claimed -> cancelled (terminal),
    ``cancelled_at = now``, the operator and the optional ``reason`` in its ``cancel`` event.

    Cancelling a claimed todo overrides the agent's lease (the event says ``override`` and
    names the lease): the lease is cleared in the same statement, so the agent's next fenced
    call is ``lease_lost``, and a complete racing the cancel either commits first (the cancel
    then finds it done) or finds it cancelled; one of them wins. The todo's operator secrets
    are deleted in the statement, and its idempotency key is free (cancelled is not live).

    Refuses ``not_found`` (missing or not the operator's), ``not_claimable`` (already done
    or cancelled), ``invalid_argument`` (a reason that is not a short string),
    ``verb_not_allowed`` (not an operator).
    """
    now = now or timezone.now()
    _operator_only(caller, "cancel")
    detail = _reason_detail(reason)
    todo_id = _todo_id(todo_id)
    params = {"todo_id": todo_id}
    where = _by_id(_visible_guard(caller, params)
                   + " AND state IN ('awaiting_approval', 'pending', 'failed', 'claimed')")
    todo = _one(_apply(
        set_sql=_CANCELLED_SET_SQL, where_sql=where, params=params, action_sql="'cancel'",
        from_state_sql="", actor=caller.actor, now=now, detail=detail, endpoint=caller.endpoint,
        from_prior=True,
    ))
    if todo is None:
        raise _wrong_state(caller, todo_id, "only awaiting_approval, pending, failed or claimed "
                                            "todos can be cancelled")
    _announce([todo], "cancel")
    return todo


def approve_todo(caller: Caller, todo_id, *, now=None) -> Todo:
    """awaiting_approval -> pending, ready exactly as a new todo (announced ``approve``: rung,
    long polls woken), with a fresh ring budget; the ``approve`` event names the approver. The
    todo keeps its trust: the yes lets agents take it, it does not vouch for its sender
    (raising ``unverified`` is ``promote_todo``, a separate operator action).

    Refuses ``not_found``, ``not_claimable`` (not awaiting approval), ``verb_not_allowed``.
    """
    now = now or timezone.now()
    _operator_only(caller, "approve")
    todo_id = _todo_id(todo_id)
    params = {"todo_id": todo_id}
    where = _by_id(_visible_guard(caller, params) + " AND state = 'awaiting_approval'")
    todo = _one(_apply(
        set_sql="state = 'pending', ring_attempts = 0, last_ringed_at = NULL",
        where_sql=where, params=params, action_sql="'approve'",
        from_state_sql="'awaiting_approval'", actor=caller.actor, now=now,
        endpoint=caller.endpoint,
    ))
    if todo is None:
        raise _wrong_state(caller, todo_id, "only a todo awaiting approval can be approved")
    _announce([todo], "approve")
    return todo


def reject_todo(caller: Caller, todo_id, *, reason=None, now=None) -> Todo:
    """awaiting_approval -> cancelled, as ``cancel_todo`` does, recorded as ``reject`` with
    the optional ``reason``. Refuses as ``approve_todo`` does (and a bad ``reason``)."""
    now = now or timezone.now()
    _operator_only(caller, "reject")
    detail = _reason_detail(reason)
    todo_id = _todo_id(todo_id)
    params = {"todo_id": todo_id}
    where = _by_id(_visible_guard(caller, params) + " AND state = 'awaiting_approval'")
    todo = _one(_apply(
        set_sql=_CANCELLED_SET_SQL, where_sql=where, params=params, action_sql="'reject'",
        from_state_sql="'awaiting_approval'", actor=caller.actor, now=now, detail=detail,
        endpoint=caller.endpoint,
    ))
    if todo is None:
        raise _wrong_state(caller, todo_id, "only a todo awaiting approval can be rejected")
    _announce([todo], "reject")
    return todo


# -- sweeps' statements (called by todos/sweeps.py) ---------------------------------------------


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


def release_due_scheduled(*, now, limit: int) -> list[Todo]:
    """Scheduled todos whose ``not_before <= now`` become ready: ``not_before`` cleared, one
    ``due`` event each, announced as ready exactly like a new todo (doorbell, long-poll
    wake-up). At most ``limit`` rows, skipping rows another sweep (or an operator's run now)
    holds; the UPDATE re-checks the guard, so a row is released once."""
    todos = _apply(
        set_sql=_BECOMES_READY_SQL,
        where_sql=(f"id IN ({due_scheduled_sql()}) AND state = 'pending'"
                   " AND not_before <= %(now)s"),
        params={"limit": limit}, action_sql="'due'", from_state_sql="'pending'",
        actor="scheduler", now=now,
    )
    _announce(todos, "due")
    return todos


def return_lapsed_leases(*, now, limit: int) -> list[Todo]:
    """claimed with ``lease_expires_at <= now`` -> pending, or -> failed as a dead letter when its
    attempts are spent. At most ``limit`` rows; rows another sweep holds are skipped, so two
    overlapping reapers split the work instead of waiting on each other."""
    spent = "attempts >= max_attempts"
    todos = _apply(
        set_sql=(
            f"state = CASE WHEN {spent} THEN 'failed' ELSE 'pending' END, "
            f"dead_lettered_at = CASE WHEN {spent} THEN %(now)s ELSE NULL END, "
            "last_error = CASE WHEN " + spent + " THEN 'lease lapsed on the last attempt' "
            "ELSE last_error END, lease_id = NULL, lease_owner = NULL, lease_expires_at = NULL, "
            "lease_ttl = NULL"
        ),
        where_sql=f"id IN ({lapsed_leases_sql()}) AND state = 'claimed' AND lease_expires_at <= %(now)s",
        params={"limit": limit}, action_sql="'lease_lapsed'", from_state_sql="'claimed'",
        actor="reaper", now=now,
    )
    _announce(todos, "lease_lapsed")
    return todos


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


def cancel_stale_approvals(*, now, limit: int) -> list[Todo]:
    """awaiting_approval for longer than the endpoint's ``approval_timeout_seconds`` ->
    cancelled, as ``cancel_todo`` does, each with a ``cancel`` event of actor
    ``approval-timeout`` and reason ``approval_timeout``. At most ``limit`` rows, skipping rows
    another sweep (or an operator's approve) holds; the outer guard re-checks the state."""
    todos = _apply(
        set_sql=_CANCELLED_SET_SQL,
        where_sql=f"id IN ({stale_approvals_sql()}) AND state = 'awaiting_approval'",
        params={"limit": limit}, action_sql="'cancel'", from_state_sql="'awaiting_approval'",
        actor="approval-timeout", now=now, detail={"reason": "approval_timeout"},
    )
    _announce(todos, "cancel")
    return todos


def promote_due_retries(*, now, limit: int) -> list[Todo]:
    """failed with ``retry_at <= now`` -> pending (dead letters have no retry_at). At most
    ``limit`` rows, skipping rows another sweep holds."""
    todos = _apply(
        set_sql="state = 'pending', retry_at = NULL, lease_id = NULL, lease_owner = NULL",
        where_sql=f"id IN ({due_retries_sql()}) AND state = 'failed' AND retry_at <= %(now)s",
        params={"limit": limit}, action_sql="'retry'", from_state_sql="'failed'",
        actor="retry-promoter", now=now,
    )
    _announce(todos, "retry")
    return todos


# -- ring bookkeeping: what a doorbell spends -------------------------------------------------
#
# A todo's ring_attempts and last_ringed_at are not lifecycle states, but they are this table's
# columns: the doorbell (channels_push.doorbells) decides who is rung and calls these to spend
# or mark its rings. Each is one guarded statement, so overlapping publishers and sweeps agree
# without locks held across round trips; none writes a todo event.

# A todo is rung at most this many times in all, its creation ring included
# (channels_push.doorbells.sweeps.RING_SCHEDULE names each of them); the partial index
# todo_doorbell_due spells the same number.
MAX_RING_ATTEMPTS = 5


def charge_ring(*, todo_id) -> bool:
    """Count one ring toward todo ``todo_id``'s budget (``ring_attempts``, never past
    MAX_RING_ATTEMPTS) if it may still ring (``queries.ring_eligible_sql``), in one guarded
    UPDATE. ``last_ringed_at`` is left alone, so the heartbeat's next step still counts from
    creation (or the last sweep ring or digest), as its schedule is written. False: the todo
    may not ring (claimed, scheduled, gone meanwhile) and nothing changed."""
    sql = ("UPDATE todos_todo SET ring_attempts = CASE WHEN ring_attempts < %(max_rings)s"
           " THEN ring_attempts + 1 ELSE ring_attempts END"
           f" WHERE id = %(todo_id)s AND {queries.ring_eligible_sql('todos_todo')} RETURNING id")
    with connection.cursor() as cursor:
        cursor.execute(sql, {"todo_id": todo_id, "max_rings": MAX_RING_ATTEMPTS})
        return cursor.fetchone() is not None


def _pairs_sql(alias: str, pairs, params: dict, name: str) -> str:
    """``(alias.endpoint_id, alias.queue)`` is one of ``pairs``, as SQL."""
    if _is_postgres():
        params[f"{name}_ids"] = [endpoint_id for endpoint_id, _ in pairs]
        params[f"{name}_queues"] = [queue for _, queue in pairs]
        return (f"({alias}.endpoint_id, {alias}.queue) IN (SELECT * FROM"
                f" unnest(%({name}_ids)s::bigint[], %({name}_queues)s::text[]))")
    params[f"{name}_pairs"] = json.dumps(list(pairs))
    return (f"EXISTS (SELECT 1 FROM json_each(%({name}_pairs)s) j"
            f" WHERE json_extract(j.value, '$[0]') = {alias}.endpoint_id"
            f" AND json_extract(j.value, '$[1]') = {alias}.queue)")


def _ring_scope_sql(alias: str, endpoint_ids, params: dict) -> str:
    """``alias``'s queue is covered by its endpoint's scope ('*' covers all) and not paused
    (a paused queue's todos keep their ring budget), for the endpoints ``endpoint_ids``, as
    SQL; the scopes are read here and passed as parameters."""
    from endpoints.models import ALL_QUEUES, Endpoint

    everything, pairs, paused = [], [], []
    rows = Endpoint.objects.filter(pk__in=endpoint_ids).values_list("pk", "scope", "paused_queues")
    for endpoint_id, scope, paused_queues in rows:
        if ALL_QUEUES in (paused_queues or []):
            continue
        paused.extend((endpoint_id, str(queue)) for queue in paused_queues or [])
        if ALL_QUEUES in scope:
            everything.append(endpoint_id)
        else:
            pairs.extend((endpoint_id, str(queue)) for queue in scope)
    clauses = []
    if everything:
        clauses.append(dialect.id_in(f"{alias}.endpoint_id", "scope_all", params, everything))
    if pairs:
        clauses.append(_pairs_sql(alias, pairs, params, "scope"))
    if not clauses:
        return "FALSE"
    covered = "(" + " OR ".join(clauses) + ")"
    if paused:
        covered += f" AND NOT {_pairs_sql(alias, paused, params, 'paused')}"
    return covered


def record_sweep_rings(*, receivers: dict, schedule, limit: int, now=None) -> list[Todo]:
    """The heartbeat sweep's statement: select up to ``limit`` due todos, round-robin across
    ``receivers`` (``{endpoint_id: when its sessions were last rung, or None}``: the endpoints
    that can receive a ring right now), and charge each a ring, in ONE statement. Returns the
    rung todos, oldest first.

    Due: pending, may ring (``queries.ring_eligible_sql``), in the endpoint's scope (a todo
    its agent may not claim is never rung and never spends budget), fewer than
    MAX_RING_ATTEMPTS rings, and ``COALESCE(last_ringed_at, created_at) <= now -
    schedule[min(ring_attempts, last)]`` — the interval counts from the last ring (or digest)
    else creation, and the attempt count only picks which interval. Round-robin: every
    endpoint's most overdue todo comes before any endpoint's second, and among endpoints the
    one whose sessions were rung least recently goes first, so a flooded endpoint cannot
    starve the others across sweeps.

    Two overlapping sweeps may pick the same row; the UPDATE re-checks the due guard on the
    row it locks, and the loser's guard then fails (last_ringed_at is now), so a todo is not
    rung twice — the loser just rings fewer this round.
    """
    statement = sweep_rings_sql(receivers=receivers, schedule=schedule, limit=limit, now=now)
    if statement is None:
        return []
    return sorted(_fetch_todos(*statement), key=lambda todo: (todo.created_at, todo.pk))


def _receivers_param(receivers: dict) -> str:
    """``{endpoint_id: rung_at}`` as the JSON list of pairs the sweep's statement reads, each
    time as the backend compares it (SQLite: its stored text)."""
    def as_sql_time(value):
        if value is None or isinstance(value, str):
            return value
        return value.isoformat() if _is_postgres() else connection.ops.adapt_datetimefield_value(value)

    return json.dumps([[endpoint_id, as_sql_time(rung_at)]
                       for endpoint_id, rung_at in receivers.items()])


def sweep_rings_sql(*, receivers: dict, schedule, limit: int, now=None, select_only=False):
    """The statement ``record_sweep_rings`` runs, as ``(sql, params)`` (None: no receivers).
    ``select_only``: just the selecting query (what picks the todos), so a test can EXPLAIN the
    very SQL the sweep runs."""
    endpoint_ids = list(receivers)
    if not endpoint_ids:
        return None
    now = now or timezone.now()
    # schedule[n] is the wait before ring n + 1; ring 1 is the publisher's, on creation. The
    # sweep only re-rings: a todo whose first ring reached nobody (ring_attempts 0: nobody was
    # attached, or it was held) waits the first re-ring step too, from creation or from the
    # digest that summarised it, never zero.
    waits = [schedule[max(attempts, 1)] for attempts in range(len(schedule))]
    params = {"now": dialect.db_time(now), "limit": limit, "max_rings": MAX_RING_ATTEMPTS,
              "due_first": dialect.db_time(now - min(waits)), "receivers": _receivers_param(receivers)}
    branches = []
    for attempts, interval in enumerate(waits):
        params[f"due_{attempts}"] = dialect.db_time(now - interval)
        if attempts < len(waits) - 1:
            branches.append(f"WHEN {{t}}.ring_attempts = {attempts} THEN %(due_{attempts})s")
    due_case = "CASE " + " ".join(branches) + f" ELSE %(due_{len(waits) - 1})s END"

    def due(alias):
        return (f"COALESCE({alias}.last_ringed_at, {alias}.created_at) <= "
                + due_case.replace("{t}", alias))

    receiver_rows = (
        "SELECT (r.value->>0)::bigint AS endpoint_id, (r.value->>1)::timestamptz AS rung_at"
        " FROM jsonb_array_elements(%(receivers)s::jsonb) r" if _is_postgres() else
        "SELECT json_extract(r.value, '$[0]') AS endpoint_id,"
        " json_extract(r.value, '$[1]') AS rung_at FROM json_each(%(receivers)s) r")
    in_scope = _ring_scope_sql("p", endpoint_ids, params)
    select = (
        f"WITH receivers AS ({receiver_rows}),"
        " candidates AS ("
        " SELECT p.id, r.rung_at, COALESCE(p.last_ringed_at, p.created_at) AS base,"
        " row_number() OVER (PARTITION BY p.endpoint_id"
        "  ORDER BY COALESCE(p.last_ringed_at, p.created_at), p.id) AS n"
        " FROM todos_todo p JOIN receivers r ON r.endpoint_id = p.endpoint_id"
        # The first three conditions are todo_doorbell_due's predicate and range.
        f" WHERE p.state = 'pending' AND p.ring_attempts < {MAX_RING_ATTEMPTS}"
        f" AND p.trust IN {queries.RING_TRUST_SQL}"
        " AND COALESCE(p.last_ringed_at, p.created_at) <= %(due_first)s"
        f" AND {due('p')} AND {in_scope} AND {queries.ring_eligible_sql('p')}),"
        " picked AS MATERIALIZED (SELECT id FROM candidates"
        "  ORDER BY n, rung_at ASC NULLS FIRST, base, id LIMIT %(limit)s)"
    )
    if select_only:
        return select + " SELECT id FROM picked", params
    sql = select + (
        " UPDATE todos_todo SET ring_attempts = ring_attempts + 1, last_ringed_at = %(now)s"
        " WHERE id IN (SELECT id FROM picked) AND state = 'pending'"
        f" AND ring_attempts < %(max_rings)s AND {due('todos_todo')} RETURNING {_returning()}"
    )
    return sql, params


def refuses_unverified(endpoint) -> bool:
    """Whether claim_next withholds ``trust: unverified`` todos from this endpoint's agents
    (``accept_unverified`` off): ``Caller.agent`` and the digest's count both ask here."""
    return not endpoint.accept_unverified


def _claimable_sql(alias: str, endpoint, params: dict) -> str:
    """SQL over the todo row ``alias``: what claim_next would hand ``endpoint``'s agents now —
    pending and not scheduled, in its scope, not in a paused queue, and (when the endpoint
    refuses them) not unverified. The digest counts exactly this."""
    if endpoint.paused_all:
        return "FALSE"
    params["claimable_endpoint_id"] = endpoint.pk
    sql = (f"{alias}.endpoint_id = %(claimable_endpoint_id)s AND {alias}.state = 'pending'"
           f" AND {alias}.not_before IS NULL")
    if not endpoint.all_queues:
        sql += " AND " + dialect.id_in(f"{alias}.queue", f"{alias}_scope", params, endpoint.scope)
    paused = list(endpoint.paused_queues or [])
    if paused:
        sql += " AND NOT " + dialect.id_in(f"{alias}.queue", f"{alias}_paused", params, paused)
    if refuses_unverified(endpoint):
        sql += f" AND {alias}.trust <> 'unverified'"
    return sql


def record_digest(*, endpoint, now=None, cooldown=None) -> list[tuple[str, object, str]]:
    """Mark every todo claim_next would hand ``endpoint`` (``_claimable_sql``) as just rung
    (last_ringed_at = now) WITHOUT spending a ring attempt, and return what was counted as
    ``[(queue, created_at, trust)]``: the digest's content and the mark are one statement, so
    the heartbeat's next ring counts its backoff from exactly the digest that was sent.

    With ``cooldown`` (the reconnect digest): nothing is marked or counted unless at least one
    of those todos was not rung or digested within it, so a flapping stream is not handed the
    same summary again and again (nor does it keep pushing the heartbeat's backoff out)."""
    now = now or timezone.now()
    params = {"now": dialect.db_time(now)}
    fresh = ""
    if cooldown is not None:
        params["cooled"] = dialect.db_time(now - cooldown)
        fresh = (" AND EXISTS (SELECT 1 FROM todos_todo c"
                 f" WHERE {_claimable_sql('c', endpoint, params)}"
                 " AND (c.last_ringed_at IS NULL OR c.last_ringed_at <= %(cooled)s))")
    if _is_postgres():
        # Every digest of the endpoint marks the same rows: locked in one order (by id) before
        # the update, or two streams opening together (whose plans visit the rows' versions in
        # table order, which differs between two snapshots once rows have moved) each wait
        # for a row the other holds, and PostgreSQL aborts one: its stream gets no digest.
        sql = (
            "WITH marked AS (SELECT t.id FROM todos_todo t"
            f" WHERE {_claimable_sql('t', endpoint, params)}{fresh}"
            " ORDER BY t.id FOR UPDATE OF t)"
            " UPDATE todos_todo SET last_ringed_at = %(now)s FROM marked"
            " WHERE todos_todo.id = marked.id AND todos_todo.state = 'pending'"
            " RETURNING todos_todo.queue, todos_todo.created_at, todos_todo.trust"
        )
    else:  # SQLite runs one writer at a time, and has no row locks to order
        sql = (
            "UPDATE todos_todo SET last_ringed_at = %(now)s WHERE id IN ("
            f" SELECT t.id FROM todos_todo t WHERE {_claimable_sql('t', endpoint, params)})"
            f" AND state = 'pending'{fresh} RETURNING queue, created_at, trust"
        )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    if not _is_postgres():
        field = Todo._meta.get_field("created_at")
        rows = [(queue, connection.ops.convert_datetimefield_value(created, field, connection),
                 trust) for queue, created, trust in rows]
    return rows
