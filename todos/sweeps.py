"""Bounded periodic work on todos. Celery beat (production) and the embedded scheduler
(``manage.py serve``) call these same functions; each does one batch and is safe when two runs
overlap (the statements skip rows another run holds)."""

from datetime import timedelta

from django.db import connection, transaction
from django.utils import timezone

from . import queries, transitions

# One reaper pass returns at most this many leases. Large enough that a crashed pool of
# agents (hundreds of leases) is cleared in a few 5 s passes, small enough that one pass holds
# row locks for milliseconds, not seconds.
REAPER_BATCH = 500
# Same reasoning for failed todos whose backoff has passed.
PROMOTER_BATCH = 500
# And for scheduled todos that came due: a burst scheduled for one moment (a nightly batch)
# becomes ready over a few passes, each holding its row locks for milliseconds.
SCHEDULED_BATCH = 500
# And for todos whose approval timed out: an operator who left hundreds waiting over a weekend
# sees them cancelled within a few passes.
STALE_APPROVAL_BATCH = 500


def expire_lapsed_leases(*, now=None) -> int:
    """Return claimed todos whose lease lapsed to pending (dead-letter when attempts are spent).
    Returns how many moved."""
    return len(transitions.return_lapsed_leases(now=now or timezone.now(), limit=REAPER_BATCH))


def promote_due_retries(*, now=None) -> int:
    """Return failed todos whose retry time has come to pending. Returns how many moved."""
    return len(transitions.promote_due_retries(now=now or timezone.now(), limit=PROMOTER_BATCH))


# One fold reads at most this many audit events (a PK range): at a few hundred todos a minute
# that is well over a minute of work per run, and one run's upserts stay a few hundred rows.
FOLD_BATCH = 20_000
# How long after its ``at`` an event's transaction may still be open (ids are taken before
# commit): only events older than twice this are folded, as /metrics does
# (switchboard/metrics.py). The board counts the rest itself from the events.
FOLD_SETTLE_TIME = timedelta(seconds=60)
# Minute buckets serve the last hour, hour buckets the last day; kept a margin longer.
KEEP_MINUTE_BUCKETS = timedelta(hours=2)
KEEP_HOUR_BUCKETS = timedelta(hours=26)

_UPSERT_TALLY_SQL = (
    "INSERT INTO todos_throughputtally"
    " (endpoint_id, queue, span_seconds, bucket_start, measure, count)"
    " VALUES (%s, %s, %s, %s, %s, %s)"
    " ON CONFLICT (endpoint_id, span_seconds, bucket_start, queue, measure)"
    " DO UPDATE SET count = todos_throughputtally.count + excluded.count"
)


def fold_throughput(*, now=None) -> int:
    """Fold settled audit events into the board's throughput tallies (``ThroughputTally``)
    and drop buckets past their keep. One bounded batch (FOLD_BATCH events); returns how
    many events it folded. Overlapping runs take turns on the fold row's lock, and the
    second finds nothing left to fold. Works on both backends (SQLite has had this upsert
    since 3.24)."""
    from .models import ThroughputFold, ThroughputTally

    now = now or timezone.now()
    ThroughputFold.objects.get_or_create(pk=1)
    with transaction.atomic():
        fold = ThroughputFold.objects.select_for_update().get(pk=1)
        settled = queries.find_settled_event_id(after_id=fold.through_event_id,
                                                written_before=now - 2 * FOLD_SETTLE_TIME)
        folded = 0
        if settled is not None:
            up_to = min(settled, fold.through_event_id + FOLD_BATCH)
            rows = []
            adapt = connection.ops.adapt_datetimefield_value
            for endpoint_id, queue, minute, measure, n in queries.count_throughput_events(
                    after_id=fold.through_event_id, up_to_id=up_to):
                hour = minute.replace(minute=0)
                rows += [(endpoint_id, queue, 60, adapt(minute), measure, n),
                         (endpoint_id, queue, 3600, adapt(hour), measure, n)]
                folded += n
            with connection.cursor() as cursor:
                cursor.executemany(_UPSERT_TALLY_SQL, rows)
            ThroughputFold.objects.filter(pk=1).update(through_event_id=up_to)
        ThroughputTally.objects.filter(bucket_start__lt=now - KEEP_MINUTE_BUCKETS,
                                       span_seconds=60).delete()
        ThroughputTally.objects.filter(bucket_start__lt=now - KEEP_HOUR_BUCKETS).delete()
    return folded
def release_due_scheduled_todos(*, now=None) -> int:
    """Make scheduled todos whose ``not_before`` has come ready (rung, long polls woken), one
    batch. One periodic sweep for every scheduled todo, never a timer per todo: a todo is
    ready at most one cadence (5 s) after its time. Returns how many became ready."""
    return len(transitions.release_due_scheduled(now=now or timezone.now(),
                                                 limit=SCHEDULED_BATCH))


def cancel_stale_approvals(*, now=None) -> int:
    """Cancel todos awaiting approval longer than their endpoint's ``approval_timeout_seconds``
    (reason ``approval_timeout``). Returns how many were cancelled."""
    return len(transitions.cancel_stale_approvals(now=now or timezone.now(),
                                                  limit=STALE_APPROVAL_BATCH))
