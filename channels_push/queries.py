"""Reads on MCP sessions shared by doorbells, digests and sweeps: who counts as attached.

**Attached** (CONTRACT §7): a live session with an open notification stream now, or one that
made a request within ``SWITCHBOARD_ATTACH_WINDOW``. A session that is neither (a client that
vanished without DELETE, as Claude Code always does) is no receiver for rings, sweeps or
digests, so its endpoint's todos keep their ring budget.

"An open stream now" cannot be read from ``last_seen_at``: keep-alives do not write the
session row on every tick. Instead the open-stream count is believed only while the streams'
lease (``stream_lease_until``, renewed rarely by each open stream) has not run out, so the
count a crashed process left behind stops counting within ``STREAM_LEASE`` on its own.

The rule lives in this one SQL fragment; every statement that picks receivers embeds it.
"""

from datetime import timedelta

from django.conf import settings
from django.db import connection

# An open stream renews its session's stream lease this often, and the lease runs this long:
# a few missed renewals (a stalled loop) do not make a live stream look dead, and a process
# that died stops counting as "stream open" within STREAM_LEASE.
STREAM_LEASE_RENEW = timedelta(minutes=2)
STREAM_LEASE = timedelta(minutes=5)


def _time(value):
    return connection.ops.adapt_datetimefield_value(value)


def stream_open_sql(alias: str, params: dict, now) -> str:
    """SQL over the session row ``alias``: it has an open notification stream now."""
    params["stream_alive_at"] = _time(now)
    return (f"({alias}.open_streams > 0 AND {alias}.stream_lease_until IS NOT NULL"
            f" AND {alias}.stream_lease_until > %(stream_alive_at)s)")


def attached_sql(alias: str, params: dict, now) -> str:
    """SQL over the session row ``alias``: live and attached at ``now`` (an open stream, or a
    request within the attach window). Adds its parameters to ``params`` (named style)."""
    params["attach_since"] = _time(now - settings.SWITCHBOARD_ATTACH_WINDOW)
    return (f"({alias}.terminated_at IS NULL AND ({stream_open_sql(alias, params, now)}"
            f" OR {alias}.last_seen_at >= %(attach_since)s))")


def attached_endpoint_ids(now) -> list[int]:
    """Active endpoints with at least one attached session at ``now``."""
    params = {}
    sql = ("SELECT DISTINCT s.endpoint_id FROM channels_push_mcpsession s"
           " JOIN endpoints_endpoint e ON e.id = s.endpoint_id"
           f" WHERE e.active AND {attached_sql('s', params, now)}")
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return [row[0] for row in cursor.fetchall()]


def has_attached_session(endpoint_id: int, now) -> bool:
    params = {"endpoint_id": endpoint_id}
    sql = ("SELECT 1 FROM channels_push_mcpsession s WHERE s.endpoint_id = %(endpoint_id)s"
           f" AND {attached_sql('s', params, now)} LIMIT 1")
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchone() is not None
