"""The doorbell's bookkeeping on the todo: how many times each todo was rung and when.

A todo's ring_attempts and last_ringed_at are not lifecycle states, but they are this table's
columns: the doorbell (channels_push.doorbells) decides who is rung and calls these to spend
or mark its rings. Each is one guarded statement, so overlapping publishers and sweeps agree
without locks held across round trips; none writes a todo event."""

import json

from django.db import connection
from django.utils import timezone

from switchboard.db import sql as dialect
from switchboard.db.sql import is_postgres as _is_postgres

from . import queries, statements, transitions
from .models import Todo


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
    return dialect.id_text_pair_in(f"{alias}.endpoint_id", f"{alias}.queue", name, params, pairs)


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
    return sorted(statements.fetch_todos(*statement), key=lambda todo: (todo.created_at, todo.pk))


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
    # schedule[n] is the wait before ring n + 1 (ring 1 is the publisher's); a todo whose first
    # ring reached nobody waits the first re-ring step too, never zero.
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

    receiver_rows = dialect.json_rows(
        "receivers", (("endpoint_id", "bigint"), ("rung_at", "timestamptz")))
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
        f" AND ring_attempts < %(max_rings)s AND {due('todos_todo')} RETURNING {statements.returning()}"
    )
    return sql, params


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
    if transitions.refuses_unverified(endpoint):
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
        # Locked by id before the update: two digests of one endpoint visiting the rows in table
        # order deadlocked once rows had moved, and the aborted one sent no digest.
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
