"""Bounded periodic work on todos. Celery beat (production) and the embedded scheduler
(``manage.py serve``) call these same functions; each does one batch and is safe when two runs
overlap (the statements skip rows another run holds)."""

from django.utils import timezone

from . import transitions

# One reaper pass returns at most this many leases. Large enough that a crashed pool of
# agents (hundreds of leases) is cleared in a few 5 s passes, small enough that one pass holds
# row locks for milliseconds, not seconds.
REAPER_BATCH = 500
# Same reasoning for failed todos whose backoff has passed.
PROMOTER_BATCH = 500


def expire_lapsed_leases(*, now=None) -> int:
    """Return claimed todos whose lease lapsed to pending (dead-letter when attempts are spent).
    Returns how many moved."""
    return len(transitions.return_lapsed_leases(now=now or timezone.now(), limit=REAPER_BATCH))


def promote_due_retries(*, now=None) -> int:
    """Return failed todos whose retry time has come to pending. Returns how many moved."""
    return len(transitions.promote_due_retries(now=now or timezone.now(), limit=PROMOTER_BATCH))


# The sweeps the embedded scheduler runs, with their cadence in seconds (the beat schedule in
# switchboard/celery.py names the same cadence).
EMBEDDED_SWEEPS = [
    (expire_lapsed_leases, 5.0),
    (promote_due_retries, 5.0),
]
