"""Every write on an MCP session's lifecycle (docs/reference.md#sessions-and-streams).

Each function is one guarded UPDATE (``… WHERE id = … AND endpoint = … AND terminated_at IS
NULL``): the guard is what pins a session to its endpoint and makes a terminated session dead
for every process at once. A function returns whether its guard matched; callers turn a miss
into HTTP 404 without reading the row again (missing, another endpoint's, and terminated must
look the same).
"""

from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Case, Count, F, OuterRef, Q, Subquery, When
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from endpoints import queries as endpoint_queries
from switchboard.db import sql as dialect

from channels_push.models import McpSession, StreamAttachment, StreamHost

from . import holders, queries


def open_session(*, endpoint, protocol_version: str, client_name: str = "",
                 client_version: str = "", now=None, credential_id: int | None = None,
                 max_sessions: int | None = None) -> McpSession:
    """Mint a session of ``endpoint`` (the answer to ``initialize``), bound to the credential
    the request presented (``credential_id``, else ``endpoint.credential_id`` as the bearer
    check sets it, or the todo token of ``endpoint.todo_grant``), and end that credential's
    sessions beyond ``max_sessions`` (default: the setting). The ids of the sessions it ended
    are ``session.evicted_ids``: the caller closes their streams."""
    now = now or timezone.now()
    credential_id = credential_id or endpoint.credential_id
    token_id = _todo_token_id(endpoint)
    session = McpSession.objects.create(
        endpoint=endpoint, credential_id=credential_id, todo_token_id=token_id,
        protocol_version=protocol_version,
        client_name=holders.clean_client_field(client_name),
        client_version=holders.clean_client_field(client_version),
        created_at=now, last_seen_at=now,
    )
    session.evicted_ids = evict_sessions_over_cap(
        credential_id=credential_id, todo_token_id=token_id, keep=session.pk, now=now,
        cap=max_sessions or settings.SWITCHBOARD_MAX_SESSIONS_PER_CREDENTIAL)
    return session


def _todo_token_id(endpoint) -> int | None:
    grant = getattr(endpoint, "todo_grant", None)
    return grant.token_id if grant is not None else None


def evict_sessions_over_cap(*, credential_id: int | None, keep: str, cap: int, now=None,
                            todo_token_id: int | None = None) -> list[str]:
    """End the live sessions of ``credential_id`` (or of the todo token ``todo_token_id``)
    beyond the ``cap`` it may hold:
    ``keep`` (the one just minted) stays, then sessions with an open stream, then the
    most recently seen; the oldest idle go first. One guarded UPDATE; concurrent initializes
    may each leave up to ``cap`` as they saw it, and the next initialize trims again."""
    now = now or timezone.now()
    ranked = (McpSession.objects.filter(credential_id=credential_id, todo_token_id=todo_token_id,
                                        terminated_at__isnull=True)
              .order_by(Case(When(pk=keep, then=0), default=1), F("open_streams").desc(),
                        F("last_seen_at").desc(), F("created_at").desc())
              .values_list("pk", flat=True))
    over = list(ranked[cap:])
    if over:
        McpSession.objects.filter(pk__in=over, terminated_at__isnull=True).update(
            terminated_at=now)
    return over


def _live(endpoint, session_id: str):
    """A live session of ``endpoint`` opened with the credential the request presented."""
    return McpSession.objects.filter(pk=session_id, endpoint=endpoint, terminated_at__isnull=True,
                                     credential_id=endpoint.credential_id,
                                     todo_token_id=_todo_token_id(endpoint))


def find_endpoint_with_session(*, slug: str, credential: str, session_id: str | None,
                               fresh_within: timedelta, now=None):
    """The endpoint ``credential`` opens (``endpoints.queries.find_endpoint_for_credential``,
    None when it opens none) and, in the same statement, the state of its session
    ``session_id``: ``endpoint.session_live`` is true only for a live session of THIS endpoint
    opened with THIS credential (an old session id never works with a rotated credential),
    ``endpoint.session_fresh`` when that session was also seen within ``fresh_within`` (so
    ``touch_session`` may skip its write). One round trip for the bearer and session checks
    that every MCP request makes; a read only, so a refused request writes nothing."""
    now = now or timezone.now()
    return endpoint_queries.find_endpoint_for_credential(
        slug, credential, now=now,
        **session_join(session_id=session_id, bound_to="s.credential_id = c.id",
                       fresh_within=fresh_within, now=now))


def session_join(*, session_id: str | None, bound_to: str, fresh_within: timedelta, now) -> dict:
    """The LEFT JOIN a bearer lookup carries to read the request's session in the same
    statement (``join_sql``, ``join_columns``, ``join_params``): the live session
    ``session_id`` of ``e`` (the endpoint row) whose binding is ``bound_to`` (SQL over ``s``
    and the bearer's row: its credential, or its todo token)."""
    return {
        "join_sql": " LEFT JOIN channels_push_mcpsession s ON s.id = %(session_id)s"
                    f" AND s.endpoint_id = e.id AND {bound_to} AND s.terminated_at IS NULL",
        "join_columns": {"session_live": "s.id IS NOT NULL",
                         "session_fresh": "COALESCE(s.last_seen_at >= %(fresh_since)s, FALSE)"},
        "join_params": {"session_id": session_id,
                        "fresh_since": queries.sql_time(now - fresh_within)},
    }


def touch_session(*, endpoint, session_id: str, now=None, fresh: bool = False) -> bool:
    """Record activity on a live session of ``endpoint``. False: no such live session.

    ``fresh``: the caller has just read (``find_endpoint_with_session``) that the session is
    live and was seen recently, so nothing is written: every tool call checks its session, and
    a write per call would double the commits of the hot path for a timestamp the idle sweep
    reads at minute granularity. A DELETE racing that read lets one in-flight call through,
    exactly as if it had arrived a moment earlier.
    """
    if fresh:
        return True
    now = now or timezone.now()
    return _live(endpoint, session_id).update(last_seen_at=now) == 1


def terminate_session(*, endpoint, session_id: str, now=None) -> bool:
    """End a live session (DELETE, with the session's own credential). False: no such live
    session."""
    now = now or timezone.now()
    return _live(endpoint, session_id).update(terminated_at=now, last_seen_at=now) == 1


def attach_stream(*, endpoint, session_id: str, host_id: str | None = None,
                  max_streams: int | None = None, now=None) -> str | None:
    """Count one more open notification stream on a live session, unless it already has
    ``max_streams`` (default: the setting), and record which process holds it (``host_id``, a
    ``StreamHost``: its lease then keeps the stream counting as open). The host row is created
    when missing (a no-op insert otherwise: a process's first stream, or its first after the
    sweep took it), the count's guarded UPDATE and the attachment's INSERT follow in the same
    transaction. ``"attached"``, ``"full"`` (the cap refused it), or None (no such live
    session)."""
    now = now or timezone.now()
    cap = max_streams or settings.SWITCHBOARD_MAX_OPEN_STREAMS
    with transaction.atomic():
        if host_id is not None:
            register_stream_host(host_id=host_id, now=now, renew=False)
        attached = _live(endpoint, session_id).filter(open_streams__lt=cap).update(
            open_streams=F("open_streams") + 1, last_seen_at=now,
            stream_lease_until=now + queries.stream_lease())
        if attached and host_id is not None:
            StreamAttachment.objects.create(session_id=session_id, host_id=host_id,
                                            opened_at=now)
    if attached:
        return "attached"
    return "full" if _live(endpoint, session_id).exists() else None


def detach_stream(*, session_id: str, host_id: str | None = None, now=None) -> None:
    """Count one stream fewer (never below zero; the sweep may already have reset it) and drop
    one of its attachments on ``host_id``, in one transaction. Applies to terminated sessions
    too, so the count ends at zero."""
    now = now or timezone.now()
    with transaction.atomic():
        if host_id is not None:
            one = (StreamAttachment.objects.filter(session_id=session_id, host_id=host_id)
                   .values("pk")[:1])
            StreamAttachment.objects.filter(pk__in=one).delete()
        McpSession.objects.filter(pk=session_id, open_streams__gt=0).update(
            open_streams=Greatest(F("open_streams") - 1, 0), last_seen_at=now
        )


# -- stream hosts: one lease row per web process for all the streams it holds ----------------


def register_stream_host(*, host_id: str, now=None, renew: bool = True) -> None:
    """Create the lease row of the process ``host_id`` when it is missing; with ``renew``, an
    existing row's lease is renewed too, else left as it is (``attach_stream``: no write when
    the row is there). One statement, so concurrent first streams of a process agree."""
    now = now or timezone.now()
    lease_until = now + queries.stream_lease()
    on_conflict = ("DO UPDATE SET lease_until = EXCLUDED.lease_until" if renew
                   else "DO NOTHING")
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO channels_push_streamhost (id, started_at, lease_until)"
            f" VALUES (%s, %s, %s) ON CONFLICT (id) {on_conflict}",
            [host_id, queries.sql_time(now), queries.sql_time(lease_until)])


def renew_stream_host(*, host_id: str, now=None) -> bool:
    """The process's heartbeat write: ONE row renews the lease of every stream it holds. False
    when the row is gone (the sweep took the process for dead after a stall longer than the
    lease): its attachments went with it, so the caller closes its streams."""
    now = now or timezone.now()
    return StreamHost.objects.filter(pk=host_id).update(
        lease_until=now + queries.stream_lease()) == 1


def check_stream_sessions(*, session_ids, now=None) -> set[str]:
    """The process heartbeat's re-check of every session it holds a stream of, in one read:
    which are still live with a credential that still gives its rights (unexpired or in grace,
    endpoint active, owner active). The others end here (one guarded UPDATE for
    all of them) and the caller closes their streams. Returns the ids still allowed. A process
    whose streams' state did not change writes nothing."""
    now = now or timezone.now()
    session_ids = list(dict.fromkeys(session_ids))
    if not session_ids:
        return set()
    params = {}
    held = dialect.id_in("s.id", "held", params, session_ids)
    rights = _session_rights_sql(params, now)
    with connection.cursor() as cursor:
        cursor.execute("SELECT s.id FROM channels_push_mcpsession s"
                       f" WHERE {held} AND s.terminated_at IS NULL AND {rights}", params)
        allowed = {row[0] for row in cursor.fetchall()}
    lost = [session_id for session_id in session_ids if session_id not in allowed]
    if lost:
        McpSession.objects.filter(pk__in=lost, terminated_at__isnull=True).update(
            terminated_at=now)
    return allowed


def _session_rights_sql(params: dict, now) -> str:
    """SQL over a session row ``s``: its credential still gives its rights."""
    return queries.session_rights_sql("s", params, now)


def end_sessions_without_rights(*, limit: int, now=None) -> int:
    """End at most ``limit`` live sessions whose credential no longer gives its rights (expired
    or out of grace, endpoint or owner inactive; unbound legacy sessions). Their streams close
    on their own next keep-alive; this makes the rows say so for doorbells and the board even
    when no stream is open. Safe when two runs overlap (re-guarded by the UPDATE)."""
    now = now or timezone.now()
    params = {"limit": limit}
    rights = _session_rights_sql(params, now)
    with connection.cursor() as cursor:
        # A todo token's sessions end with its lease (end_todo_token_sessions), not here.
        cursor.execute("SELECT s.id FROM channels_push_mcpsession s WHERE s.terminated_at IS NULL"
                       f" AND s.todo_token_id IS NULL AND NOT {rights} LIMIT %(limit)s", params)
        ids = [row[0] for row in cursor.fetchall()]
    if not ids:
        return 0
    return McpSession.objects.filter(pk__in=ids, terminated_at__isnull=True).update(
        terminated_at=now)


def end_todo_token_sessions(*, token_ids, now=None) -> list[str]:
    """End the live sessions opened with the todo tokens ``token_ids`` (their lease ended).
    Returns their ids, so the caller can close their streams."""
    now = now or timezone.now()
    live = McpSession.objects.filter(todo_token_id__in=list(token_ids), terminated_at__isnull=True)
    ended = list(live.values_list("pk", flat=True))
    if ended:
        McpSession.objects.filter(pk__in=ended, terminated_at__isnull=True).update(
            terminated_at=now)
    return ended


def expire_idle_sessions(*, idle_before, limit: int, now=None) -> int:
    """End live sessions last seen before ``idle_before`` and without an open stream (an idle
    stream writes nothing on its session, so ``last_seen_at`` stops at its attach), at most
    ``limit`` of them. Safe when two runs overlap: each row's guard (still live) is re-checked
    by the UPDATE itself."""
    now = now or timezone.now()
    params = {"idle_before": queries.sql_time(idle_before), "limit": limit}
    streaming = queries.stream_open_sql("s", params, now)
    with connection.cursor() as cursor:
        cursor.execute("SELECT s.id FROM channels_push_mcpsession s"
                       " WHERE s.terminated_at IS NULL AND s.last_seen_at < %(idle_before)s"
                       f" AND NOT {streaming} ORDER BY s.last_seen_at LIMIT %(limit)s", params)
        ids = [row[0] for row in cursor.fetchall()]
    if not ids:
        return 0
    return McpSession.objects.filter(pk__in=ids, terminated_at__isnull=True).update(
        terminated_at=now
    )


def reset_stale_stream_counts(*, now=None) -> int:
    """Forget the streams of processes that died: delete the hosts whose lease ran out with
    their attachments, then set every session whose own attach lease ran out to the number of
    attachments it still has (zero, for a session whose streams all died with their process).
    ``queries.attached_sql`` already ignores such counts; this keeps the column honest for the
    cap, the board and the admin. Returns how many sessions were corrected."""
    now = now or timezone.now()
    # The dead hosts locked first, in one transaction: a stalled process's renewal lands before
    # (not dead) or finds its row gone (it closes its streams), never in between.
    with transaction.atomic():
        dead_hosts = list(StreamHost.objects.select_for_update()
                          .filter(lease_until__lt=now).values_list("pk", flat=True))
        if dead_hosts:
            StreamAttachment.objects.filter(host_id__in=dead_hosts).delete()
            StreamHost.objects.filter(pk__in=dead_hosts).delete()
    remaining = Subquery(StreamAttachment.objects.filter(session_id=OuterRef("pk"))
                         .values("session_id").annotate(n=Count("pk")).values("n"))
    return McpSession.objects.filter(open_streams__gt=0).filter(
        Q(stream_lease_until__isnull=True) | Q(stream_lease_until__lt=now)
    ).exclude(open_streams=Coalesce(remaining, 0)).update(open_streams=Coalesce(remaining, 0))


def delete_ended_sessions(*, ended_before, limit: int) -> int:
    """Delete at most ``limit`` ended sessions (terminated, or expired by the idle sweep) that
    ended before ``ended_before``, for the retention prune (ingest.sweeps.prune_history). Served
    by mcp_session_prune (terminated_at WHERE terminated_at IS NOT NULL). A session a stream
    attachment still names is left for a later pass (the attachment's foreign key would refuse
    the delete): its stream closes, or its dead process's rows are swept, first. No new
    attachment can appear on an ended session (``attach_stream`` guards on a live one). Rows
    another transaction holds are skipped, so overlapping runs take different rows. One
    statement, its own transaction. Returns how many."""
    lock = dialect.skip_locked()
    sql = ("DELETE FROM channels_push_mcpsession WHERE id IN ("
           " SELECT id FROM channels_push_mcpsession s"
           " WHERE terminated_at IS NOT NULL AND terminated_at < %(ended_before)s"
           " AND NOT EXISTS (SELECT 1 FROM channels_push_streamattachment a"
           " WHERE a.session_id = s.id)"
           f" ORDER BY terminated_at LIMIT %(limit)s{lock})")
    with connection.cursor() as cursor:
        cursor.execute(sql, {"ended_before": queries.sql_time(ended_before), "limit": limit})
        return cursor.rowcount
