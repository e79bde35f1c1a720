"""The periodic sweeps, declared once. Celery beat (``switchboard/celery.py``, production) and
the embedded scheduler (``switchboard/scheduler.py``, under ``manage.py serve``) both read this
table, so the two cannot run a sweep at different cadences or leave one out.

Each entry runs one bounded sweep; overlapping runs are safe (every sweep claims its rows with a
guarded statement), so a slow run never needs a lock. ``sweep`` is the plain function the
embedded scheduler calls; ``task`` is the Celery task beat enqueues, a thin wrapper in the
app's ``tasks.py`` that calls that same function (switchboard/tests/test_celery_tasks.py
checks each pair). Both are dotted paths, so this module imports no app: celery.py reads it before Django is set
up. The operator's view of the table is docs/operating.md#the-sweeps.
"""

import threading
from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True)
class PeriodicSweep:
    name: str  # the beat entry: what the sweep is for
    sweep: str  # dotted path of the sweep function
    task: str  # the registered name of the Celery task that calls it
    every: timedelta
    # The embedded scheduler runs it at once when ``wake(name)`` is called (work just
    # committed), besides every ``every``; with Celery, the caller enqueues ``task`` instead.
    wakes: bool = False
    # It waits on other servers (write-back's requests): the embedded scheduler runs it on a
    # thread of its own, never on Django's one sync thread that requests share.
    waits_on_network: bool = False


SWEEPS = (
    # A lapsed lease returns its todo to pending within about 5 s of its expiry
    # (docs/reference.md#leases).
    PeriodicSweep("return-lapsed-leases", "todos.sweeps.expire_lapsed_leases",
                  "todos.tasks.expire_lapsed_leases", timedelta(seconds=5)),
    # Failed todos whose backoff has passed go back to pending; 5 s keeps the 30 s first retry
    # within a sixth of its interval (docs/reference.md#attempts-and-retries).
    PeriodicSweep("promote-due-retries", "todos.sweeps.promote_due_retries",
                  "todos.tasks.promote_due_retries", timedelta(seconds=5)),
    # The board's throughput chart: settled audit events into per-minute and per-hour tallies.
    # The board counts the unfolded events itself, so the cadence only bounds that read: 15 s
    # keeps it to a couple of minutes of events.
    PeriodicSweep("fold-throughput", "todos.sweeps.fold_throughput",
                  "todos.tasks.fold_throughput", timedelta(seconds=15)),
    # Scheduled todos become ready within about 5 s of their not_before
    # (docs/work-control.md#scheduled-todos).
    PeriodicSweep("release-due-scheduled-todos", "todos.sweeps.release_due_scheduled_todos",
                  "todos.tasks.release_due_scheduled_todos", timedelta(seconds=5)),
    # Todos awaiting approval past their endpoint's approval timeout are cancelled; at the
    # other lifecycle sweeps' cadence, so a timeout is honoured within about 5 s
    # (docs/work-control.md#approval).
    PeriodicSweep("cancel-stale-approvals", "todos.sweeps.cancel_stale_approvals",
                  "todos.tasks.cancel_stale_approvals", timedelta(seconds=5)),
    # Idle MCP sessions end. The idle limit is an hour, so once a minute is plenty; the same
    # pass zeroes the stream counts a crashed web process left behind
    # (docs/reference.md#sessions-and-streams).
    PeriodicSweep("expire-idle-mcp-sessions", "channels_push.sessions.sweeps.expire_idle_sessions",
                  "channels_push.tasks.expire_idle_sessions", timedelta(seconds=60)),
    # The doorbell heartbeat. The shortest re-ring interval is 5 min and a pass rings at most
    # 3 todos, so every 30 s keeps a first re-ring within a tenth of its interval
    # (docs/reference.md#doorbells).
    PeriodicSweep("ring-due-doorbells", "channels_push.doorbells.sweeps.ring_due_todos",
                  "channels_push.tasks.ring_due_todos", timedelta(seconds=30)),
    # Shift starts and override ends send a digest; 30 s keeps it within half a minute of the
    # boundary, and overlapping runs announce each boundary once (docs/reference.md#digests).
    PeriodicSweep("announce-presence-boundaries",
                  "channels_push.doorbells.sweeps.announce_presence_boundaries",
                  "channels_push.tasks.announce_presence_boundaries", timedelta(seconds=30)),
    # A new UTC day lifts the daily budgets: one digest to each endpoint that was held over
    # budget. 30 s keeps the digest within half a minute of midnight UTC; a day is claimed by
    # one guarded UPDATE, so overlapping runs send it once (docs/reference.md#usage-and-budgets).
    PeriodicSweep("announce-budget-day-turns",
                  "channels_push.doorbells.sweeps.announce_budget_day_turns",
                  "channels_push.tasks.announce_budget_day_turns", timedelta(seconds=30)),
    # Retention: rows are kept for days, so hourly keeps any row within an hour of its due;
    # each run deletes in bounded batches until it has caught up (docs/operating.md#retention).
    PeriodicSweep("prune-history", "ingest.sweeps.prune_history_sweep",
                  "ingest.tasks.prune_history", timedelta(hours=1)),
    # Replay-ledger entries past the replay window (7 days by default) can refuse nothing; a
    # minute's lag is nothing against a week, and one pass deletes a bounded batch.
    PeriodicSweep("prune-replay-ledger", "ingest.sweeps.prune_replay_ledger",
                  "ingest.tasks.prune_replay_ledger", timedelta(seconds=60)),
    # Refused deliveries past the delivery log's per-minute cap are only counted (in Redis);
    # every 15 s writes those counts, so the webhook page shows them within a quarter minute.
    PeriodicSweep("fold-dropped-delivery-counts", "ingest.sweeps.fold_dropped_delivery_counts",
                  "ingest.tasks.fold_dropped_delivery_counts", timedelta(seconds=15)),
    # Operator secrets of ended todos already read as missing; this takes them off the disk. A
    # minute's lag keeps a handed-over value at rest no longer than that after its todo ends.
    PeriodicSweep("delete-secrets-of-ended-todos", "ingest.sweeps.delete_secrets_of_ended_todos",
                  "ingest.tasks.delete_secrets_of_ended_todos", timedelta(seconds=60)),
    # Agent credentials die with their lease (docs/security.md#agent-credentials): todo
    # tokens already fail at their next use, this ends their sessions; repository tokens are
    # revoked at GitHub. 10 s keeps a token alive at most that long after its lease, at one
    # indexed read per pass when nothing ended.
    PeriodicSweep("revoke-ended-agent-tokens", "ingest.sweeps.revoke_ended_agent_tokens",
                  "ingest.tasks.revoke_ended_agent_tokens", timedelta(seconds=10),
                  waits_on_network=True),
    # Write-backs to the sources (docs/write-back.md#the-outbox): each commit that has one
    # wakes this at once (the embedded scheduler) or enqueues its task (Celery); every 5 s
    # sends what a lost wake-up, a crash or a retry's wait left due.
    PeriodicSweep("send-write-backs", "ingest.write_back.send_due_write_backs",
                  "ingest.tasks.send_write_backs", timedelta(seconds=5), wakes=True,
                  waits_on_network=True),
)


# Wake-ups of the embedded scheduler's ``wakes`` sweeps, by entry name: set by any thread (an
# after-commit callback), waited on by the scheduler's loop for that sweep.
_wake_events: dict[str, threading.Event] = {}
_wake_events_lock = threading.Lock()


def _wake_event(name: str) -> threading.Event:
    with _wake_events_lock:
        return _wake_events.setdefault(name, threading.Event())


def wake(name: str) -> None:
    """Have the embedded scheduler run sweep ``name`` now rather than at its next tick (a
    no-op when nothing runs it)."""
    _wake_event(name).set()


def wait_for_wake(name: str, timeout_seconds: float) -> bool:
    """Block until ``wake(name)`` or ``timeout_seconds``; True when woken. For the scheduler."""
    event = _wake_event(name)
    woken = event.wait(timeout_seconds)
    event.clear()
    return woken


def beat_schedule() -> dict:
    """The table as Celery's ``beat_schedule``: entry name -> task and interval in seconds."""
    return {entry.name: {"task": entry.task, "schedule": entry.every.total_seconds()}
            for entry in SWEEPS}
