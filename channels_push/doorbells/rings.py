"""Ring bookkeeping: which attached sessions a doorbell goes to, and what a ring spends
(CONTRACT §7).

The statements below write ring bookkeeping: a session's last doorbell time, and a todo's
ring_attempts / last_ringed_at. Neither is a todo lifecycle state (todos/transitions.py owns
those); each is still one guarded statement, so overlapping publishers and sweeps agree
without locks held across round trips.
"""

import json
from datetime import timedelta

from django.db import connection, transaction
from django.utils import timezone

from channels_push.sessions import queries

# A todo is rung at most this many times in all, its creation ring included (SPEC-0011
# "Doorbell Heartbeat"; sweeps.RING_SCHEDULE names each of them); the partial index
# todo_doorbell_due (migration 0002) spells the same number.
MAX_RING_ATTEMPTS = 5
PUSH_TRUST_SQL = "('signed', 'operator')"
# A re-attach does not ring the same todo again within this long (SPEC-0011 "Reconnecting
# session is rung"): an agent whose stream flaps must not be woken again and again.
RECONNECT_COOLDOWN = timedelta(seconds=60)


def _postgres() -> bool:
    return connection.vendor == "postgresql"


def _time(value):
    return connection.ops.adapt_datetimefield_value(value)


def _id_list(column: str, param: str, params: dict, values) -> str:
    if _postgres():
        params[param] = list(values)
        return f"{column} = ANY(%({param})s)"
    params[param] = json.dumps(list(values))
    return f"{column} IN (SELECT value FROM json_each(%({param})s))"


# The sender gate as SQL over a todo row ``alias``: still pending and not scheduled (a
# scheduled todo is rung when it comes due), trusted, attributed to a human through its
# delivery event (ADR-0003, ADR-0008).
def _eligible_sql(alias: str) -> str:
    return (
        f"{alias}.state = 'pending' AND {alias}.not_before IS NULL"
        f" AND {alias}.trust IN {PUSH_TRUST_SQL} AND EXISTS ("
        f"SELECT 1 FROM ingest_deliveryevent d WHERE d.id = {alias}.delivery_event_id "
        "AND d.attributed_to_id IS NOT NULL)"
    )


def choose_sessions(*, endpoint_id: int, limit: int, todo_id: int | None = None,
                    charge: bool = False, now=None) -> list[tuple[str, bool]]:
    """Pick up to ``limit`` attached sessions of ``endpoint_id`` (``queries.attached_sql``) and
    stamp them as just rung, in one UPDATE … RETURNING: sessions with an open stream first,
    then the least recently rung, so the pool takes turns (a todo doorbell picks one, a digest
    one per waiting todo). A session without an open stream is chosen only when fewer than
    ``limit`` sessions stream (for a todo doorbell: none does); its push is then dropped at the
    transport (the lossy contract). Returns ``[(session_id, has_open_stream)]``; empty when
    none is attached or (with ``todo_id``) the todo is no longer eligible to ring.

    ``charge`` (with ``todo_id``): the ring also counts toward the todo's ring budget
    (``ring_attempts``, never past MAX_RING_ATTEMPTS) in the same statement, only when a
    session was chosen: a ring nobody could receive spends nothing. ``last_ringed_at`` is left
    alone, so the heartbeat's next step still counts from creation (or the last sweep ring or
    digest), as the schedule is written.

    PostgreSQL: SKIP LOCKED lets concurrent publishers each take a different session of the
    pool. The streamless ones are left out by counting the streaming sessions from the
    snapshot, not from the rows the statement could lock: a streaming session that a
    concurrent publisher holds for a moment is skipped, never traded for a streamless one
    (whose doorbell would be dropped). When every candidate is held, the statement is
    repeated without SKIP LOCKED (waiting milliseconds for the holder's commit) rather than
    dropping the doorbell.
    """
    now = now or timezone.now()
    params = {"endpoint_id": endpoint_id, "todo_id": todo_id, "now": _time(now), "limit": limit}
    attached = queries.attached_sql("s", params, now)
    stream_open = queries.stream_open_sql("s", params, now)
    # How many sessions stream, up to ``limit`` (reading no further than that): the cheap
    # open-stream test first, so a pool of streamless long-pollers costs a column check each.
    streaming_peers = (
        "(SELECT count(*) FROM (SELECT 1 FROM channels_push_mcpsession o"
        f" WHERE o.endpoint_id = %(endpoint_id)s AND {queries.stream_open_sql('o', params, now)}"
        f" AND {queries.attached_sql('o', params, now)} LIMIT %(limit)s) streaming)")
    eligible = "" if todo_id is None else (
        " AND EXISTS (SELECT 1 FROM todos_todo t WHERE t.id = %(todo_id)s"
        f" AND t.endpoint_id = s.endpoint_id AND {_eligible_sql('t')})")
    charge = charge and todo_id is not None
    params["max_rings"] = MAX_RING_ATTEMPTS
    charge_sql = ("UPDATE todos_todo SET ring_attempts = CASE WHEN ring_attempts < %(max_rings)s"
                  " THEN ring_attempts + 1 ELSE ring_attempts END WHERE id = %(todo_id)s")
    for lock in ((" FOR UPDATE SKIP LOCKED", "") if _postgres() else ("",)):
        # MATERIALIZED: an ``IN (… LIMIT n FOR UPDATE SKIP LOCKED)`` sub-select may be re-run
        # during the semi-join and stamp more than n rows; the CTE is evaluated once.
        picked = (
            "WITH picked AS MATERIALIZED (SELECT s.id FROM channels_push_mcpsession s"
            f" WHERE s.endpoint_id = %(endpoint_id)s AND {attached}{eligible}"
            f" AND ({stream_open} OR {streaming_peers} < %(limit)s)"
            f" ORDER BY {stream_open} DESC, s.last_doorbell_at ASC NULLS FIRST, s.id"
            f" LIMIT %(limit)s{lock})"
        )
        if charge and _postgres():
            # The charge rides in the same statement (a data-modifying CTE), guarded by the
            # pick: it happens exactly when a session was chosen for the todo.
            picked += f", charged AS ({charge_sql} AND EXISTS (SELECT 1 FROM picked))"
        sql = (
            picked + " UPDATE channels_push_mcpsession SET last_doorbell_at = %(now)s"
            " WHERE id IN (SELECT id FROM picked) RETURNING id,"
            f" {queries.stream_open_sql('channels_push_mcpsession', params, now)}"
        )
        if charge and not _postgres():
            # SQLite has no data-modifying CTE: the charge follows in the same transaction
            # (its writers are serialised anyway).
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(sql, params)
                rows = cursor.fetchall()
                if rows:
                    cursor.execute(charge_sql, params)
        else:
            with connection.cursor() as cursor:
                cursor.execute(sql, params)
                rows = cursor.fetchall()
        if rows:
            # Streaming sessions first, as they were picked.
            return sorted(((row[0], bool(row[1])) for row in rows), key=lambda r: not r[1])
        if not queries.has_attached_session(endpoint_id, now):
            return []
    return []


def choose_doorbell_session(*, endpoint_id: int, todo_id: int, charge: bool = False,
                            now=None) -> tuple[str, bool] | None:
    """ONE attached session to ring for ``todo_id`` (``choose_sessions``; ``charge``: count the
    ring toward the todo's budget), as ``(session_id, has_open_stream)``; None when nobody is
    attached or the todo may not ring."""
    chosen = choose_sessions(endpoint_id=endpoint_id, limit=1, todo_id=todo_id, charge=charge,
                             now=now)
    return chosen[0] if chosen else None


def _ringed_todos(sql: str, params: dict):
    from todos.models import Todo

    rows = list(Todo.objects.raw(sql, params))
    return sorted(rows, key=lambda todo: (todo.created_at, todo.pk))


def record_sweep_rings(*, endpoint_ids, schedule, limit: int, now=None):
    """The heartbeat sweep's statement: select up to ``limit`` due todos, round-robin across
    ``endpoint_ids`` (endpoints that can receive a ring right now), and charge each a ring, in
    ONE statement. Returns the rung todos.

    Due: pending, push-eligible, in the endpoint's scope (a todo its agent may not claim is
    never rung and never spends budget), fewer than MAX_RING_ATTEMPTS rings, and
    ``COALESCE(last_ringed_at, created_at) <= now - schedule[min(ring_attempts, last)]`` — the
    interval counts from the last ring (or digest) else creation, and the attempt count only
    picks which interval. Round-robin: every endpoint's most overdue todo comes before any
    endpoint's second, and among endpoints the one whose sessions were rung least recently
    goes first, so a flooded endpoint cannot starve the others across sweeps.

    Two overlapping sweeps may pick the same row; the UPDATE re-checks the due guard on the
    row it locks, and the loser's guard then fails (last_ringed_at is now), so a todo is not
    rung twice — the loser just rings fewer this round.
    """
    statement = sweep_rings_sql(endpoint_ids=endpoint_ids, schedule=schedule, limit=limit,
                                now=now)
    if statement is None:
        return []
    return _ringed_todos(*statement)


def _pairs_sql(alias: str, pairs, params: dict, name: str) -> str:
    """``(alias.endpoint_id, alias.queue)`` is one of ``pairs``, as SQL."""
    if _postgres():
        params[f"{name}_ids"] = [endpoint_id for endpoint_id, _ in pairs]
        params[f"{name}_queues"] = [queue for _, queue in pairs]
        return (f"({alias}.endpoint_id, {alias}.queue) IN (SELECT * FROM"
                f" unnest(%({name}_ids)s::bigint[], %({name}_queues)s::text[]))")
    params[f"{name}_pairs"] = json.dumps(list(pairs))
    return (f"EXISTS (SELECT 1 FROM json_each(%({name}_pairs)s) j"
            f" WHERE json_extract(j.value, '$[0]') = {alias}.endpoint_id"
            f" AND json_extract(j.value, '$[1]') = {alias}.queue)")


def _scope_sql(alias: str, endpoint_ids, params: dict) -> str:
    """``alias``'s queue is covered by its endpoint's scope ('*' covers all) and not paused
    (§14: a paused queue's todos keep their ring budget), for the endpoints ``endpoint_ids``,
    as SQL; the scopes are read here and passed as parameters."""
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
        clauses.append(_id_list(f"{alias}.endpoint_id", "scope_all", params, everything))
    if pairs:
        clauses.append(_pairs_sql(alias, pairs, params, "scope"))
    if not clauses:
        return "FALSE"
    covered = "(" + " OR ".join(clauses) + ")"
    if paused:
        covered += f" AND NOT {_pairs_sql(alias, paused, params, 'paused')}"
    return covered


def sweep_rings_sql(*, endpoint_ids, schedule, limit: int, now=None, select_only=False):
    """The statement ``record_sweep_rings`` runs, as ``(sql, params)`` (None: no receivers).
    ``select_only``: just the selecting query (what picks the todos), so a test can EXPLAIN the
    very SQL the sweep runs."""
    endpoint_ids = list(endpoint_ids)
    if not endpoint_ids:
        return None
    now = now or timezone.now()
    # schedule[n] is the wait before ring n + 1; ring 1 is the publisher's, on creation. The
    # sweep only re-rings: a todo whose first ring reached nobody (ring_attempts 0: nobody was
    # attached, or it was held) waits the first re-ring step too, from creation or from the
    # digest that summarised it, never zero.
    waits = [schedule[max(attempts, 1)] for attempts in range(len(schedule))]
    params = {"now": _time(now), "limit": limit, "max_rings": MAX_RING_ATTEMPTS,
              "due_first": _time(now - min(waits))}
    branches = []
    for attempts, interval in enumerate(waits):
        params[f"due_{attempts}"] = _time(now - interval)
        if attempts < len(waits) - 1:
            branches.append(f"WHEN {{t}}.ring_attempts = {attempts} THEN %(due_{attempts})s")
    due_case = "CASE " + " ".join(branches) + f" ELSE %(due_{len(waits) - 1})s END"

    def due(alias):
        return (f"COALESCE({alias}.last_ringed_at, {alias}.created_at) <= "
                + due_case.replace("{t}", alias))

    receivers = _id_list("s.endpoint_id", "endpoints", params, endpoint_ids)
    in_scope = _scope_sql("p", endpoint_ids, params)
    select = (
        "WITH receivers AS ("
        " SELECT s.endpoint_id, MAX(s.last_doorbell_at) AS rung_at FROM channels_push_mcpsession s"
        f" WHERE {queries.attached_sql('s', params, now)} AND {receivers} GROUP BY s.endpoint_id),"
        " candidates AS ("
        " SELECT p.id, r.rung_at, COALESCE(p.last_ringed_at, p.created_at) AS base,"
        " row_number() OVER (PARTITION BY p.endpoint_id"
        "  ORDER BY COALESCE(p.last_ringed_at, p.created_at), p.id) AS n"
        " FROM todos_todo p JOIN receivers r ON r.endpoint_id = p.endpoint_id"
        # The first three conditions are todo_doorbell_due's predicate and range.
        f" WHERE p.state = 'pending' AND p.ring_attempts < {MAX_RING_ATTEMPTS}"
        f" AND p.trust IN {PUSH_TRUST_SQL}"
        " AND COALESCE(p.last_ringed_at, p.created_at) <= %(due_first)s"
        f" AND {due('p')} AND {in_scope} AND {_eligible_sql('p')}),"
        " picked AS MATERIALIZED (SELECT id FROM candidates"
        "  ORDER BY n, rung_at ASC NULLS FIRST, base, id LIMIT %(limit)s)"
    )
    if select_only:
        return select + " SELECT id FROM picked", params
    sql = select + (
        " UPDATE todos_todo SET ring_attempts = ring_attempts + 1, last_ringed_at = %(now)s"
        " WHERE id IN (SELECT id FROM picked) AND state = 'pending'"
        f" AND ring_attempts < %(max_rings)s AND {due('todos_todo')} RETURNING *"
    )
    return sql, params


def refuses_unverified(endpoint) -> bool:
    """Whether claim_next withholds ``trust: unverified`` todos from this endpoint's agents
    (``accept_unverified`` off, CONTRACT §12; ``todos.transitions.Caller.agent`` reads it the
    same way)."""
    return not endpoint.accept_unverified


def claimable_sql(alias: str, endpoint, params: dict) -> str:
    """SQL over the todo row ``alias``: what claim_next would hand ``endpoint``'s agents now —
    pending and not scheduled, in its scope, not in a paused queue, and (when the endpoint
    refuses them) not unverified. The digest counts exactly this."""
    if endpoint.paused_all:
        return "FALSE"
    params["claimable_endpoint_id"] = endpoint.pk
    sql = (f"{alias}.endpoint_id = %(claimable_endpoint_id)s AND {alias}.state = 'pending'"
           f" AND {alias}.not_before IS NULL")
    if not endpoint.all_queues:
        sql += " AND " + _id_list(f"{alias}.queue", f"{alias}_scope", params, endpoint.scope)
    paused = list(endpoint.paused_queues or [])
    if paused:
        sql += " AND NOT " + _id_list(f"{alias}.queue", f"{alias}_paused", params, paused)
    if refuses_unverified(endpoint):
        sql += f" AND {alias}.trust <> 'unverified'"
    return sql


def record_digest(*, endpoint, now=None, cooldown=None) -> list[tuple[str, object, str]]:
    """Mark every todo claim_next would hand ``endpoint`` (``claimable_sql``) as just rung
    (last_ringed_at = now) WITHOUT spending a ring attempt, and return what was counted as
    ``[(queue, created_at, trust)]``: the digest's content and the mark are one statement, so
    the heartbeat's next ring counts its backoff from exactly the digest that was sent.

    With ``cooldown`` (the reconnect digest): nothing is marked or counted unless at least one
    of those todos was not rung or digested within it, so a flapping stream is not handed the
    same summary again and again (nor does it keep pushing the heartbeat's backoff out)."""
    now = now or timezone.now()
    params = {"now": _time(now)}
    fresh = ""
    if cooldown is not None:
        params["cooled"] = _time(now - cooldown)
        fresh = (f" AND EXISTS (SELECT 1 FROM todos_todo c WHERE {claimable_sql('c', endpoint, params)}"
                 " AND (c.last_ringed_at IS NULL OR c.last_ringed_at <= %(cooled)s))")
    if connection.vendor == "postgresql":
        # Every digest of the endpoint marks the same rows: locked in one order (by id) before
        # the update, or two streams opening together (whose plans visit the rows' versions in
        # table order, which differs between two snapshots once rows have moved) each wait
        # for a row the other holds, and PostgreSQL aborts one: its stream gets no digest.
        sql = (
            "WITH marked AS (SELECT t.id FROM todos_todo t"
            f" WHERE {claimable_sql('t', endpoint, params)}{fresh}"
            " ORDER BY t.id FOR UPDATE OF t)"
            " UPDATE todos_todo SET last_ringed_at = %(now)s FROM marked"
            " WHERE todos_todo.id = marked.id AND todos_todo.state = 'pending'"
            " RETURNING todos_todo.queue, todos_todo.created_at, todos_todo.trust"
        )
    else:  # SQLite runs one writer at a time, and has no row locks to order
        sql = (
            "UPDATE todos_todo SET last_ringed_at = %(now)s WHERE id IN ("
            f" SELECT t.id FROM todos_todo t WHERE {claimable_sql('t', endpoint, params)})"
            f" AND state = 'pending'{fresh} RETURNING queue, created_at, trust"
        )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    converter = connection.ops.convert_datetimefield_value if connection.vendor == "sqlite" else None
    if converter:
        from todos.models import Todo

        field = Todo._meta.get_field("created_at")
        rows = [(queue, converter(created, field, connection), trust)
                for queue, created, trust in rows]
    return rows
