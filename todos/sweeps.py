"""Bounded periodic work on todos. Celery beat (production) and the embedded scheduler
(``manage.py serve``) call these same functions; each does one batch and is safe when two runs
overlap (the statements skip rows another run holds)."""

import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.db.models import Count, F, Q
from django.utils import timezone

from switchboard import tracing
from switchboard.db import sql as dialect

from . import queries, transitions
from .models import PrunedEventTally, State, Todo, TodoEvent, TodoToken

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


def _linked(sweep: str, moved: list, started_ns) -> int:
    """How many ``moved``; with traces on, a sweep that moved todos is a span linked to each
    one's trace (docs/operating.md#traces). One that moved nothing leaves no span: these run
    every few seconds."""
    if started_ns is not None and moved:
        tracing.record(f"sweep {sweep}", start_ns=started_ns,
                       links=[todo.traceparent for todo in moved],
                       **{"switchboard.todos_moved": len(moved)})
    return len(moved)


def expire_lapsed_leases(*, now=None) -> int:
    """Return claimed todos whose lease lapsed to pending (dead-letter when attempts are spent).
    Returns how many moved."""
    started_ns = tracing.now_ns()
    return _linked("expire_lapsed_leases", transitions.return_lapsed_leases(
        now=now or timezone.now(), limit=REAPER_BATCH), started_ns)


def promote_due_retries(*, now=None) -> int:
    """Return failed todos whose retry time has come to pending. Returns how many moved."""
    started_ns = tracing.now_ns()
    return _linked("promote_due_retries", transitions.promote_due_retries(
        now=now or timezone.now(), limit=PROMOTER_BATCH), started_ns)


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
    started_ns = tracing.now_ns()
    return _linked("release_due_scheduled_todos", transitions.release_due_scheduled(
        now=now or timezone.now(), limit=SCHEDULED_BATCH), started_ns)


def cancel_stale_approvals(*, now=None) -> int:
    """Cancel todos awaiting approval longer than their endpoint's ``approval_timeout_seconds``
    (reason ``approval_timeout``). Returns how many were cancelled."""
    return len(transitions.cancel_stale_approvals(now=now or timezone.now(),
                                                  limit=STALE_APPROVAL_BATCH))


# -- retention: settled todos and their history (docs/operating.md#retention) -------------------
# Run hourly by ingest.sweeps.prune_history in reference order: secrets, these todos, then the
# delivery events no todo points at.


@dataclass(frozen=True)
class DoomedTodos:
    """Which todos a prune batch takes: a SQL condition (with its parameters and the partial
    index that serves it, see todos.models) and the same condition as ORM lookups."""

    where: str
    params: tuple
    order_by: str
    lookups: dict

    def select_sql(self) -> str:
        """The batch's choice of rows; its one remaining parameter is the batch size."""
        return (f"SELECT id FROM todos_todo WHERE {self.where} "
                f"ORDER BY {self.order_by} LIMIT %s")


def done_past_retention(done_before: datetime) -> DoomedTodos:
    # Served by the partial index todo_prune_done (updated_at WHERE state = 'done').
    return DoomedTodos("state = 'done' AND updated_at < %s", (done_before,), "updated_at",
                       {"state": State.DONE, "updated_at__lt": done_before})


def cancelled_past_retention(done_before: datetime) -> DoomedTodos:
    # Cancelled todos are kept exactly as long as done ones. Served by the partial index
    # todo_prune_cancelled (cancelled_at WHERE state = 'cancelled').
    return DoomedTodos("state = 'cancelled' AND cancelled_at < %s", (done_before,),
                       "cancelled_at", {"state": State.CANCELLED, "cancelled_at__lt": done_before})


def dead_past_retention(dead_before: datetime) -> DoomedTodos:
    # Served by the partial index todo_prune_dead (dead_lettered_at WHERE dead letter).
    return DoomedTodos(
        "state = 'failed' AND dead_lettered_at IS NOT NULL AND dead_lettered_at < %s",
        (dead_before,), "dead_lettered_at",
        {"state": State.FAILED, "dead_lettered_at__isnull": False,
         "dead_lettered_at__lt": dead_before},
    )


def _settled_past_retention(done_before, dead_before) -> list[tuple[str, DoomedTodos]]:
    kinds = [("done_todos", done_past_retention(done_before)),
             ("cancelled_todos", cancelled_past_retention(done_before))]
    if dead_before is not None:
        kinds.append(("dead_letters", dead_past_retention(dead_before)))
    return kinds


def prune_settled_todos(*, done_before: datetime, dead_before: datetime | None, batch: int,
                        pause_seconds: float) -> dict:
    """Delete done and cancelled todos settled before ``done_before`` and dead letters
    dead-lettered before ``dead_before`` (None: keep every dead letter), with their audit
    events, ``batch`` todos per statement with ``pause_seconds`` between batches, until none is
    left. Returns ``{"done_todos", "cancelled_todos", "dead_letters", "todo_events": rows}``.

    The pruned events are folded into ``PrunedEventTally`` first, so /metrics counters never go
    down. Rows another transaction holds are skipped (``SKIP LOCKED``) and taken by the next
    run; two overlapping runs take different rows. The caller deletes first whatever of
    another app still refers to these todos (ingest's operator secrets: ``prune_history``):
    the foreign keys would refuse the commit."""
    pruned = dict.fromkeys(("done_todos", "cancelled_todos", "dead_letters", "todo_events"), 0)
    for kind, doomed in _settled_past_retention(done_before, dead_before):
        while True:
            todos, events = _delete_todo_batch(doomed, batch)
            pruned[kind] += todos
            pruned["todo_events"] += events
            if todos < batch:
                break
            time.sleep(pause_seconds)
    return pruned


def count_settled_todos(*, done_before: datetime, dead_before: datetime | None) -> dict:
    """What ``prune_settled_todos`` would delete now, by kind (its dry run)."""
    counts = dict.fromkeys(("done_todos", "cancelled_todos", "dead_letters"), 0)
    for kind, doomed in _settled_past_retention(done_before, dead_before):
        counts[kind] = Todo.objects.filter(**doomed.lookups).count()
    counts["todo_events"] = TodoEvent.objects.filter(
        todo_id__in=_doomed(done_before, dead_before).values("id")).count()
    return counts


def _doomed(done_before, dead_before):
    doomed = Q()
    for _, kind in _settled_past_retention(done_before, dead_before):
        doomed |= Q(**kind.lookups)
    return Todo.objects.filter(doomed)


def delivery_events_kept_by_todos(*, done_before: datetime, dead_before: datetime | None):
    """The delivery event ids that todos the prune keeps still point at (a values queryset),
    for the dry run of the delivery events' prune."""
    return (Todo.objects.filter(delivery_event__isnull=False)
            .exclude(id__in=_doomed(done_before, dead_before).values("id"))
            .values("delivery_event_id"))


def todos_kept_by_retention(*, done_before: datetime, dead_before: datetime | None):
    """The ids of todos the prune keeps (a values queryset), for the dry run of what refers
    to todos from other apps (ingest's write-backs)."""
    return Todo.objects.exclude(id__in=_doomed(done_before, dead_before).values("id")).values("id")


def _delete_todo_batch(doomed: DoomedTodos, batch: int) -> tuple[int, int]:
    """Delete up to ``batch`` todos matching ``doomed`` with their audit events, folding the
    events into the pruned tally. Returns ``(todos deleted, events deleted)``."""
    if dialect.is_postgres():
        return _delete_todo_batch_postgres(doomed, batch)
    return _delete_todo_batch_sqlite(doomed, batch)


def _delete_todo_batch_postgres(doomed: DoomedTodos, batch: int) -> tuple[int, int]:
    # One statement (no BEGIN/COMMIT round trips); it is what deletes the events with their
    # todos (docs/decisions/todo-events-without-a-foreign-key.md).
    sql = f"""
        WITH doomed AS (
            {doomed.select_sql()}{dialect.skip_locked()}
        ), gone_events AS (
            DELETE FROM todos_todoevent e USING doomed d WHERE e.todo_id = d.id
            RETURNING e.action, e.to_state
        ), folded AS (
            INSERT INTO todos_prunedeventtally (action, to_state, count)
            SELECT action, to_state, count(*) FROM gone_events GROUP BY action, to_state
            ON CONFLICT (action, to_state)
            DO UPDATE SET count = todos_prunedeventtally.count + EXCLUDED.count
        ), gone_tokens AS (
            DELETE FROM todos_todotoken k USING doomed d WHERE k.todo_id = d.id
        ), gone_todos AS (
            DELETE FROM todos_todo t USING doomed d WHERE t.id = d.id RETURNING t.id
        )
        SELECT (SELECT count(*) FROM gone_todos), (SELECT count(*) FROM gone_events)
    """
    with connection.cursor() as cursor:
        cursor.execute(sql, (*doomed.params, batch))
        todos, events = cursor.fetchone()
    return int(todos), int(events)


def _delete_todo_batch_sqlite(doomed: DoomedTodos, batch: int) -> tuple[int, int]:
    # SQLite has one writer at a time, so the batch's IMMEDIATE transaction is its lock; the
    # same steps as the PostgreSQL statement, one statement each.
    with transaction.atomic():
        ids = list(Todo.objects.filter(**doomed.lookups).order_by(doomed.order_by)
                   .values_list("id", flat=True)[:batch])
        if not ids:
            return 0, 0
        events = TodoEvent.objects.filter(todo_id__in=ids)
        folded = 0
        for action, to_state, n in events.values_list("action", "to_state").annotate(
                n=Count("id")).order_by():
            tally, created = PrunedEventTally.objects.get_or_create(
                action=action, to_state=to_state, defaults={"count": n})
            if not created:
                PrunedEventTally.objects.filter(pk=tally.pk).update(count=F("count") + n)
            folded += n
        events._raw_delete(events.db)
        TodoToken.objects.filter(todo_id__in=ids)._raw_delete(events.db)
        deleted = Todo.objects.filter(id__in=ids)._raw_delete(events.db)
    return deleted, folded
