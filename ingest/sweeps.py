"""Bounded periodic work of ingest. Celery beat (production) and the embedded scheduler
(``manage.py serve``) call these same functions; each does one batch and is safe when two runs
overlap (a delete of rows already gone deletes nothing; a fold writes the same counts)."""

from datetime import datetime, timezone as dt_timezone

from django.conf import settings
from django.utils import timezone

from switchboard import ratelimit

from . import transitions
from .models import DeliveryDrops, ReplayLedgerEntry, Webhook

# One pass deletes at most this many ledger entries: a short statement that never holds many
# row locks; a busy install accepts far fewer deliveries per pass interval (60 s).
REPLAY_LEDGER_PRUNE_BATCH = 1000


def prune_replay_ledger(*, now=None) -> int:
    """Delete replay-ledger entries older than SWITCHBOARD_REPLAY_WINDOW (they can no longer
    refuse anything), oldest first, at most REPLAY_LEDGER_PRUNE_BATCH. Returns how many."""
    now = now or timezone.now()
    expired = list(ReplayLedgerEntry.objects.filter(
        accepted_at__lt=now - settings.SWITCHBOARD_REPLAY_WINDOW,
    ).order_by("accepted_at").values_list("pk", flat=True)[:REPLAY_LEDGER_PRUNE_BATCH])
    if not expired:
        return 0
    deleted, _ = ReplayLedgerEntry.objects.filter(pk__in=expired).delete()
    return deleted


def fold_dropped_delivery_counts() -> int:
    """Write the per-minute counts of refused deliveries that the delivery log did not record
    (past SWITCHBOARD_DELIVERY_LOG_REFUSED_PER_MINUTE) into ``DeliveryDrops``. The counters
    live in Redis (or this process) for ten minutes and only grow, so each pass rewrites the
    same or larger numbers. Returns how many minutes it wrote."""
    cap = settings.SWITCHBOARD_DELIVERY_LOG_REFUSED_PER_MINUTE
    rows = {}
    for key, count in ratelimit.read_counts(transitions.DROP_COUNTER_SCOPE).items():
        webhook_id, _, minute = key.partition(":")
        if count > cap and webhook_id.isdigit() and minute.isdigit():
            rows[(int(webhook_id), int(minute))] = count - cap
    if not rows:
        return 0
    existing = set(Webhook.objects.filter(pk__in={w for w, _ in rows}).values_list("pk", flat=True))
    drops = [
        DeliveryDrops(webhook_id=webhook_id, dropped=dropped,
                      minute=datetime.fromtimestamp(minute * 60, tz=dt_timezone.utc))
        for (webhook_id, minute), dropped in rows.items() if webhook_id in existing
    ]
    DeliveryDrops.objects.bulk_create(drops, update_conflicts=True,
                                      unique_fields=["webhook", "minute"],
                                      update_fields=["dropped"])
    return len(drops)


# The sweeps the embedded scheduler runs, with their cadence in seconds (the beat schedule in
# switchboard/celery.py names the same cadence).
EMBEDDED_SWEEPS = [
    (prune_replay_ledger, 60.0),
    (fold_dropped_delivery_counts, 15.0),
]
