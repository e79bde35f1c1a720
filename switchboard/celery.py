"""Celery app: the worker runs the periodic sweeps that beat schedules (production mode).

The tasks are thin wrappers (``*/tasks.py``) around the same plain sweep functions the embedded
scheduler calls under ``manage.py serve``.
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "switchboard.settings")

app = Celery("switchboard")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

# One beat schedule. Each entry runs one bounded sweep; overlapping runs are safe (every sweep
# claims its rows with a guarded statement), so a slow run never needs a lock.
app.conf.beat_schedule = {
    # §4: a lapsed lease must return to pending within ~5 s.
    "return-lapsed-leases": {"task": "todos.tasks.expire_lapsed_leases", "schedule": 5.0},
    # §4: failed todos whose backoff has passed go back to pending; 5 s keeps the 30 s
    # first retry within a sixth of its interval.
    "promote-due-retries": {"task": "todos.tasks.promote_due_retries", "schedule": 5.0},
    # The board's throughput chart: settled audit events into per-minute and per-hour tallies.
    # The board counts the unfolded events itself, so the cadence only bounds that read: 15 s
    # keeps it to a couple of minutes of events.
    "fold-throughput": {"task": "todos.tasks.fold_throughput", "schedule": 15.0},
    # Scheduled todos become ready within ~5 s of their not_before (docs/work-control.md).
    "release-due-scheduled-todos": {"task": "todos.tasks.release_due_scheduled_todos",
                                    "schedule": 5.0},
    # Todos awaiting approval past their endpoint's approval_timeout_seconds are cancelled;
    # with the other lifecycle sweeps, so a timeout is honoured within ~5 s.
    "cancel-stale-approvals": {"task": "todos.tasks.cancel_stale_approvals", "schedule": 5.0},
    # §6: idle MCP sessions end; the idle limit is an hour, so once a minute is plenty, and
    # the same pass zeroes stream counts left by a crashed web process (45 s of silence).
    "expire-idle-mcp-sessions": {"task": "channels_push.tasks.expire_idle_sessions",
                                 "schedule": 60.0},
    # §7: doorbell heartbeat; the shortest re-ring interval is 5 min and a sweep rings at
    # most 3 todos, so every 30 s keeps a first re-ring within a tenth of its interval.
    "ring-due-doorbells": {"task": "channels_push.tasks.ring_due_todos", "schedule": 30.0},
    # §14: retention. Kept for days, so hourly is plenty; each run deletes in bounded batches
    # until it has caught up.
    "prune-history": {"task": "ingest.tasks.prune_history", "schedule": 3600.0},
    # §8: shift starts and override ends send a digest; 30 s keeps it within half a minute
    # of the boundary (overlapping runs announce each boundary once).
    "announce-presence-boundaries": {"task": "channels_push.tasks.announce_presence_boundaries",
                                     "schedule": 30.0},
    # §12: replay-ledger entries past the replay window (7 days) can refuse nothing; a
    # minute's lag is nothing against a week, and one pass deletes at most 1,000.
    "prune-replay-ledger": {"task": "ingest.tasks.prune_replay_ledger", "schedule": 60.0},
    # §14: refused deliveries past the log's per-minute cap are only counted (in Redis); every
    # 15 s writes those counts so the webhook page shows them within a quarter minute.
    "fold-dropped-delivery-counts": {"task": "ingest.tasks.fold_dropped_delivery_counts",
                                     "schedule": 15.0},
    # Operator secrets of ended todos already read as missing; this takes them off the disk.
    # A minute's lag keeps a handed-over value at rest no longer than that after its todo ends.
    "delete-secrets-of-ended-todos": {"task": "ingest.tasks.delete_secrets_of_ended_todos",
                                      "schedule": 60.0},
}
