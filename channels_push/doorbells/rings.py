"""Ring bookkeeping: which attached sessions a doorbell goes to (docs/reference.md#doorbells).

A session's last doorbell time is written here, one guarded statement per pick, so
overlapping publishers and sweeps agree without locks held across round trips. What a ring
spends on the todo side (its ring budget, the digest's mark) is the todo's own column and is
written by ``todos.transitions`` (``charge_ring``, ``record_sweep_rings``, ``record_digest``).
"""

from datetime import timedelta

from django.db import connection
from django.utils import timezone

from channels_push.sessions import queries
from switchboard.db import sql as dialect
from todos import queries as todo_queries
from todos import ring_budget

# A re-attach does not ring the same todo again within this long: an agent whose stream flaps
# must not be woken again and again.
RECONNECT_COOLDOWN = timedelta(seconds=60)


def choose_sessions(*, endpoint_id: int, limit: int, now=None) -> list[tuple[str, bool]]:
    """Pick up to ``limit`` attached sessions of ``endpoint_id`` (``queries.attached_sql``) and
    stamp them as just rung, in one UPDATE … RETURNING: sessions with an open stream first,
    then the least recently rung, so the pool takes turns (a todo doorbell picks one, a digest
    one per waiting todo). A session without an open stream is chosen only when fewer than
    ``limit`` sessions stream (for a todo doorbell: none does); its push is then dropped at the
    transport (the lossy contract). Returns ``[(session_id, has_open_stream)]``; empty when
    none is attached.

    PostgreSQL: SKIP LOCKED lets concurrent publishers each take a different session of the
    pool. The streamless ones are left out by counting the streaming sessions from the
    snapshot, not from the rows the statement could lock: a streaming session that a
    concurrent publisher holds for a moment is skipped, never traded for a streamless one
    (whose doorbell would be dropped). When every candidate is held, the statement is
    repeated without SKIP LOCKED (waiting milliseconds for the holder's commit) rather than
    dropping the doorbell.
    """
    now = now or timezone.now()
    params = {"endpoint_id": endpoint_id, "now": queries.sql_time(now), "limit": limit}
    attached = queries.attached_sql("s", params, now)
    stream_open = queries.stream_open_sql("s", params, now)
    # How many sessions stream, up to ``limit`` (reading no further than that): the cheap
    # open-stream test first, so a pool of streamless long-pollers costs a column check each.
    streaming_peers = (
        "(SELECT count(*) FROM (SELECT 1 FROM channels_push_mcpsession o"
        f" WHERE o.endpoint_id = %(endpoint_id)s AND {queries.stream_open_sql('o', params, now)}"
        f" AND {queries.attached_sql('o', params, now)} LIMIT %(limit)s) streaming)")
    for lock in ((dialect.skip_locked(), "") if dialect.is_postgres() else ("",)):
        # MATERIALIZED: an ``IN (… LIMIT n FOR UPDATE SKIP LOCKED)`` sub-select may be re-run
        # during the semi-join and stamp more than n rows; the CTE is evaluated once.
        sql = (
            "WITH picked AS MATERIALIZED (SELECT s.id FROM channels_push_mcpsession s"
            f" WHERE s.endpoint_id = %(endpoint_id)s AND {attached}"
            f" AND ({stream_open} OR {streaming_peers} < %(limit)s)"
            f" ORDER BY {stream_open} DESC, s.last_doorbell_at ASC NULLS FIRST, s.id"
            f" LIMIT %(limit)s{lock})"
            " UPDATE channels_push_mcpsession SET last_doorbell_at = %(now)s"
            " WHERE id IN (SELECT id FROM picked) RETURNING id,"
            f" {queries.stream_open_sql('channels_push_mcpsession', params, now)}"
        )
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            rows = cursor.fetchall()
        if rows:
            # Streaming sessions first, as they were picked.
            return sorted(((row[0], bool(row[1])) for row in rows), key=lambda r: not r[1])
        if not queries.has_attached_session(endpoint_id, now):
            return []
    return []


# What choose_doorbell_session answers when sessions are attached but the todo may no longer
# ring (claimed, or otherwise no longer pending, since its commit).
NOT_RINGABLE = object()


def choose_doorbell_session(*, endpoint_id: int, todo_id: int, charge: bool = False,
                            now=None):
    """ONE attached session to ring for ``todo_id`` (``choose_sessions``), as ``(session_id,
    has_open_stream)``; None when nobody is attached; ``NOT_RINGABLE`` when somebody is but the
    todo may no longer ring.

    The session is picked first and the todo checked after, by the todo's own statement
    (``charge``: ``todos.ring_budget.charge_ring`` counts the ring toward its budget in the
    same guarded UPDATE; else ``todos.queries.may_ring`` only reads): a ring nobody could
    receive spends nothing, and a todo claimed meanwhile rings nobody. Such a todo costs the
    picked session its turn in the pool's rotation, nothing more."""
    chosen = choose_sessions(endpoint_id=endpoint_id, limit=1, now=now)
    if not chosen:
        return None
    if charge:
        may_ring = ring_budget.charge_ring(todo_id=todo_id)
    else:
        may_ring = todo_queries.may_ring(todo_id)
    return chosen[0] if may_ring else NOT_RINGABLE
