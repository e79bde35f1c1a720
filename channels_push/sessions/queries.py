"""Reads on MCP sessions shared by doorbells, digests and sweeps: who counts as attached.

**Attached** (docs/reference.md#sessions-and-streams): a live session with an open
notification stream now, or one that made a request within ``SWITCHBOARD_ATTACH_WINDOW``. A
session that is neither (a client that vanished without DELETE, as Claude Code always does) is
no receiver for rings, sweeps or digests, so its endpoint's todos keep their ring budget.

"An open stream now" cannot be read from ``last_seen_at``: an idle stream writes nothing. The
open-stream count is believed only while a lease says its streams still live: the lease its
attach granted (``stream_lease_until``, one ``stream_lease()`` from the attach), or the lease
of a process that holds one of its streams (a ``StreamAttachment`` on a ``StreamHost``, which
the process renews with one row write for all its streams). So the count a crashed process
left behind stops counting within ``stream_lease()`` on its own.

The rule lives in this one SQL fragment; every statement that picks receivers embeds it.
"""

from datetime import timedelta

from django.conf import settings
from django.db import connection



def stream_lease() -> timedelta:
    """How long a stream lease runs (settings.SWITCHBOARD_STREAM_LEASE_SECONDS, 5 min): a
    process that died stops counting as "stream open" within it."""
    return timedelta(seconds=settings.SWITCHBOARD_STREAM_LEASE_SECONDS)


def stream_lease_renew() -> timedelta:
    """How often a process renews its host lease: 2/5 of the lease, so a missed renewal or two
    (a stalled loop, a database blip) do not make its live streams look dead."""
    return stream_lease() * 0.4


def sql_time(value):
    """A time as a statement's parameter, as the backend compares it (SQLite: its stored text)."""
    return connection.ops.adapt_datetimefield_value(value)


def stream_open_sql(alias: str, params: dict, now) -> str:
    """SQL over the session row ``alias``: it has an open notification stream now."""
    params["stream_alive_at"] = sql_time(now)
    # COALESCE: never NULL (a NULL would sort first in the doorbell's ``ORDER BY … DESC``).
    return (f"({alias}.open_streams > 0 AND (COALESCE({alias}.stream_lease_until"
            " > %(stream_alive_at)s, FALSE)"
            " OR EXISTS (SELECT 1 FROM channels_push_streamattachment sa"
            " JOIN channels_push_streamhost sh ON sh.id = sa.host_id"
            f" WHERE sa.session_id = {alias}.id AND sh.lease_until > %(stream_alive_at)s)))")


def session_rights_sql(alias: str, params: dict, now) -> str:
    """SQL over the session row ``alias``: the credential that opened it still gives its rights
    (unexpired or in grace, endpoint active, owner active; the rule itself is
    ``endpoints.queries.credential_gives_rights_sql``)."""
    from endpoints import queries as endpoint_queries

    params["rights_now"] = sql_time(now)
    return endpoint_queries.credential_gives_rights_sql(f"{alias}.credential_id",
                                                        now_param="rights_now")


def attached_sql(alias: str, params: dict, now) -> str:
    """SQL over the session row ``alias``: live and attached at ``now`` (an open stream, or a
    request within the attach window), and still allowed to hear anything: a session whose
    credential lost its rights is no receiver even while its stream waits for the keep-alive
    that closes it. Adds its parameters to ``params`` (named style)."""
    params["attach_since"] = sql_time(now - settings.SWITCHBOARD_ATTACH_WINDOW)
    # A todo token's session is never a receiver (docs/security.md#the-todo-token).
    return (f"({alias}.terminated_at IS NULL AND {alias}.todo_token_id IS NULL"
            f" AND ({stream_open_sql(alias, params, now)}"
            f" OR {alias}.last_seen_at >= %(attach_since)s)"
            f" AND {session_rights_sql(alias, params, now)})")


def attached_endpoints(now) -> dict:
    """Active endpoints with at least one attached session at ``now``, as ``{endpoint_id:
    when one of those sessions was last rung}`` (None: never; the time as the backend returns
    it, to be passed back to the database as it is)."""
    from endpoints import queries as endpoint_queries

    params = {}
    sql = ("SELECT s.endpoint_id, MAX(s.last_doorbell_at) FROM channels_push_mcpsession s"
           f" WHERE {endpoint_queries.endpoint_active_sql('s.endpoint_id')}"
           f" AND {attached_sql('s', params, now)} GROUP BY s.endpoint_id")
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return dict(cursor.fetchall())


def has_attached_session(endpoint_id: int, now) -> bool:
    params = {"endpoint_id": endpoint_id}
    sql = ("SELECT 1 FROM channels_push_mcpsession s WHERE s.endpoint_id = %(endpoint_id)s"
           f" AND {attached_sql('s', params, now)} LIMIT 1")
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchone() is not None


def live_sessions(endpoint_id: int, now, *, limit: int = 50) -> list[dict]:
    """The endpoint's live sessions, most recently seen first, for its page: the client's
    name and version, whether a notification stream is open now (``streaming``) or it counts
    as attached by a recent request, and when it was last seen. One statement."""
    params = {"endpoint_id": endpoint_id, "limit": limit}
    streaming = stream_open_sql("s", params, now)
    attached = attached_sql("s", params, now)
    sql = ("SELECT s.id, s.client_name, s.client_version, s.last_seen_at, s.created_at,"
           f" {streaming}, {attached}"
           " FROM channels_push_mcpsession s"
           " WHERE s.endpoint_id = %(endpoint_id)s AND s.terminated_at IS NULL"
           " ORDER BY s.last_seen_at DESC LIMIT %(limit)s")
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    return [{"id": row[0], "client_name": row[1], "client_version": row[2],
             "last_seen_at": row[3], "created_at": row[4], "streaming": bool(row[5]),
             "attached": bool(row[6])} for row in rows]


def count_deletable_sessions(ended_before) -> int:
    """How many sessions ``transitions.delete_ended_sessions`` would delete now, all batches
    together (the retention prune's dry run)."""
    from channels_push.models import McpSession

    return McpSession.objects.filter(terminated_at__lt=ended_before,
                                     stream_attachments__isnull=True).count()
