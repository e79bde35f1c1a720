"""Bounded periodic work on MCP sessions. Celery beat (production) and the embedded scheduler
(``manage.py serve``) call these same functions; each does one batch and is safe when two runs
overlap (every row is re-guarded by its UPDATE)."""

from django.conf import settings
from django.utils import timezone

from . import transitions as session_transitions

# One pass ends at most this many idle sessions: agents open a handful of sessions each, so
# even a fleet's worth of abandoned sessions clears in a few passes of short statements.
IDLE_SESSION_BATCH = 1000
# One pass ends at most this many sessions whose credential lost its rights: the same
# reasoning (a rotation with no grace ends a whole pool's sessions at once).
REVOKED_SESSION_BATCH = 1000


def expire_idle_sessions(*, now=None) -> int:
    """End sessions idle longer than SWITCHBOARD_MCP_SESSION_IDLE (no request, no open stream
    keeping them seen) and sessions whose credential lost its rights, and zero the
    stream counts of sessions whose streams died with their process (their stream lease ran
    out). Each step is one bounded batch; ended sessions are deleted a day later by the
    retention sweep (ingest.sweeps.prune_history). Returns how many sessions ended."""
    now = now or timezone.now()
    session_transitions.reset_stale_stream_counts(now=now)
    ended = session_transitions.end_sessions_without_rights(limit=REVOKED_SESSION_BATCH, now=now)
    ended += session_transitions.expire_idle_sessions(
        idle_before=now - settings.SWITCHBOARD_MCP_SESSION_IDLE, limit=IDLE_SESSION_BATCH, now=now,
    )
    return ended
