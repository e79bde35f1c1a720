"""Every write on an MCP session's lifecycle (CONTRACT §3, §6).

Each function is one guarded UPDATE (``… WHERE id = … AND endpoint = … AND terminated_at IS
NULL``): the guard is what pins a session to its endpoint and makes a terminated session dead
for every process at once. A function returns whether its guard matched; callers turn a miss
into HTTP 404 without reading the row again (missing, another endpoint's, and terminated must
look the same).
"""

from django.db.models import F
from django.db.models.functions import Greatest
from django.utils import timezone

from .models import McpSession


def open_session(*, endpoint, protocol_version: str, client_name: str = "", now=None) -> McpSession:
    """Mint a session of ``endpoint`` (the answer to ``initialize``)."""
    now = now or timezone.now()
    return McpSession.objects.create(
        endpoint=endpoint, protocol_version=protocol_version, client_name=client_name[:200],
        created_at=now, last_seen_at=now,
    )


def _live(endpoint, session_id: str):
    return McpSession.objects.filter(pk=session_id, endpoint=endpoint, terminated_at__isnull=True)


def touch_session(*, endpoint, session_id: str, now=None, min_interval=None) -> bool:
    """Record activity on a live session of ``endpoint``. False: no such live session.

    With ``min_interval``, a session already seen within it is only read, not written: every
    tool call checks its session, and a write per call would double the commits of the hot
    path for a timestamp the idle sweep reads at minute granularity. A DELETE racing the read
    lets one in-flight call through, exactly as if it had arrived a moment earlier.
    """
    now = now or timezone.now()
    if min_interval is not None and _live(endpoint, session_id).filter(
            last_seen_at__gte=now - min_interval).exists():
        return True
    return _live(endpoint, session_id).update(last_seen_at=now) == 1


def terminate_session(*, endpoint, session_id: str, now=None) -> bool:
    """End a live session (DELETE). False: no such live session."""
    now = now or timezone.now()
    return _live(endpoint, session_id).update(terminated_at=now, last_seen_at=now) == 1


def attach_stream(*, endpoint, session_id: str, now=None) -> bool:
    """Count one more open notification stream on a live session. False: no such session."""
    now = now or timezone.now()
    return _live(endpoint, session_id).update(
        open_streams=F("open_streams") + 1, last_seen_at=now
    ) == 1


def detach_stream(*, session_id: str, now=None) -> None:
    """Count one stream fewer (never below zero; the sweep may already have reset it).
    Applies to terminated sessions too, so the count ends at zero."""
    now = now or timezone.now()
    McpSession.objects.filter(pk=session_id, open_streams__gt=0).update(
        open_streams=Greatest(F("open_streams") - 1, 0), last_seen_at=now
    )


def expire_idle_sessions(*, idle_before, limit: int, now=None) -> int:
    """End live sessions last seen before ``idle_before``, at most ``limit`` of them. Safe when
    two runs overlap: each row's guard (still live) is re-checked by the UPDATE itself."""
    now = now or timezone.now()
    ids = list(
        McpSession.objects.filter(terminated_at__isnull=True, last_seen_at__lt=idle_before)
        .order_by("last_seen_at").values_list("pk", flat=True)[:limit]
    )
    if not ids:
        return 0
    return McpSession.objects.filter(pk__in=ids, terminated_at__isnull=True).update(
        terminated_at=now
    )


def reset_stale_stream_counts(*, silent_before) -> int:
    """A stream touches its session every keep-alive; a session with a nonzero count that has
    been silent since ``silent_before`` lost its streams with a crashed process. Zero them so
    the doorbell does not prefer a session nobody listens on."""
    return McpSession.objects.filter(open_streams__gt=0, last_seen_at__lt=silent_before).update(
        open_streams=0
    )
