"""Bounded periodic work on MCP sessions. Celery beat (production) and the embedded scheduler
(``manage.py serve``) call these same functions; each does one batch and is safe when two runs
overlap (every row is re-guarded by its UPDATE)."""

from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from . import mcp_transport
from . import transitions as session_transitions

# One pass ends at most this many idle sessions: agents open a handful of sessions each, so
# even a fleet's worth of abandoned sessions clears in a few passes of short statements.
IDLE_SESSION_BATCH = 1000
# A stream touches its session every keep-alive; silence for this long means the process that
# held it is gone (three missed keep-alives, so one slow tick is not mistaken for a crash).
STREAM_SILENCE = timedelta(seconds=3 * mcp_transport.KEEPALIVE_SECONDS)


def expire_idle_sessions(*, now=None) -> int:
    """End sessions idle longer than SWITCHBOARD_MCP_SESSION_IDLE (no request, no open stream
    keeping them seen), and zero the stream counts of sessions whose streams died with their
    process. Returns how many sessions ended."""
    now = now or timezone.now()
    session_transitions.reset_stale_stream_counts(silent_before=now - STREAM_SILENCE)
    return session_transitions.expire_idle_sessions(
        idle_before=now - settings.SWITCHBOARD_MCP_SESSION_IDLE, limit=IDLE_SESSION_BATCH, now=now,
    )


# The sweeps the embedded scheduler runs, with their cadence in seconds (the beat schedule in
# switchboard/celery.py names the same cadence).
EMBEDDED_SWEEPS = [
    (expire_idle_sessions, 60.0),
]
