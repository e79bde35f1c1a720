"""Retention (docs/operating.md#retention): the hourly prune of history that has served its purpose.

Everything switchboard writes would otherwise stay forever: done todos with their audit events,
the delivery events behind them, operator secrets, ended MCP sessions. The prune lives here
because ingest is the one app that sees all of them (todos and their secrets, delivery events,
and — importing downwards — the push layer's sessions).

Each kind is deleted in batches of ``PRUNE_BATCH`` rows, one short transaction per batch, with
a pause between batches, so a prune never holds long locks, never bloats one transaction and
never makes a claim wait behind more than one batch. Rows another transaction holds are
skipped (``SKIP LOCKED``) and taken by the next run; two overlapping runs each take different
rows. Celery beat runs ``prune_history`` hourly; the embedded scheduler calls the same function;
``manage.py prune`` runs it once.
"""

import time
from dataclasses import dataclass
from datetime import datetime, timezone as dt_timezone

from django.conf import settings
from django.db import connection, transaction
from django.db.models import OuterRef
from django.utils import timezone

from channels_push.models import McpSession
from todos import queries as todo_queries
from todos.models import PrunedEventTally, State, Todo, TodoEvent

from switchboard import ratelimit

from . import transitions
from .models import (DeliveryDrops, DeliveryEvent, DeliveryRecord, OperatorSecret,
                     ReplayLedgerEntry, Webhook)

# Rows per statement: large enough that a backlog of a million rows clears in a few minutes,
# small enough that one batch holds its row locks for tens of milliseconds.
PRUNE_BATCH = 1000
# Pause between batches, so claims and deliveries interleave with a long prune.
PAUSE_BETWEEN_BATCHES_SECONDS = 0.05

# The kinds ``prune_history`` reports, in the order it deletes them: todos before the delivery
# events they point at.
KINDS = ("done_todos", "cancelled_todos", "dead_letters", "todo_events", "delivery_events",
         "delivery_log", "mcp_sessions")


@dataclass(frozen=True)
class Cutoffs:
    """What is past retention at one instant (the clock is read once per run)."""

    done_before: datetime
    dead_before: datetime | None
    deliveries_before: datetime
    sessions_before: datetime
    delivery_log_before: datetime

    @classmethod
    def at(cls, now: datetime) -> "Cutoffs":
        retain_dead = settings.SWITCHBOARD_RETAIN_DEAD
        return cls(
            done_before=now - settings.SWITCHBOARD_RETAIN_DONE,
            dead_before=now - retain_dead if retain_dead else None,
            # A delivery event goes once its todos are gone and it is as old as a done todo
            # may be: deliveries that created no todo (no route) age out the same way.
            deliveries_before=now - settings.SWITCHBOARD_RETAIN_DONE,
            sessions_before=now - settings.SWITCHBOARD_RETAIN_ENDED_SESSIONS,
            delivery_log_before=now - settings.SWITCHBOARD_RETAIN_DELIVERY_LOG,
        )


def prune_history(*, now=None, dry_run=False, pause_seconds=PAUSE_BETWEEN_BATCHES_SECONDS,
                  batch=PRUNE_BATCH) -> dict:
    """Delete everything past retention, batch by batch, until nothing is left. Returns
    ``{kind: rows}`` (with ``dry_run``, what would be deleted, and nothing is)."""
    cutoffs = Cutoffs.at(now or timezone.now())
    if dry_run:
        return count_prunable(cutoffs)
    pruned = dict.fromkeys(KINDS, 0)
    todo_kinds = [("done_todos", done_past_retention(cutoffs)),
                  ("cancelled_todos", cancelled_past_retention(cutoffs))]
    if cutoffs.dead_before is not None:
        todo_kinds.append(("dead_letters", dead_past_retention(cutoffs)))
    for kind, doomed in todo_kinds:
        while True:
            todos, events = _delete_todo_batch(doomed, batch)
            pruned[kind] += todos
            pruned["todo_events"] += events
            if todos < batch:
                break
            time.sleep(pause_seconds)
    for kind, delete_batch in (("delivery_events", _delete_delivery_event_batch),
                               ("delivery_log", _delete_delivery_log_batch),
                               ("mcp_sessions", _delete_session_batch)):
        while True:
            deleted = delete_batch(cutoffs, batch)
            pruned[kind] += deleted
            if deleted < batch:
                break
            time.sleep(pause_seconds)
    return pruned


def count_prunable(cutoffs: Cutoffs) -> dict:
    """What ``prune_history`` would delete now, by kind."""
    doomed_todos = Todo.objects.filter(**done_past_retention(cutoffs).lookups)
    cancelled = Todo.objects.filter(**cancelled_past_retention(cutoffs).lookups)
    dead = (Todo.objects.filter(**dead_past_retention(cutoffs).lookups)
            if cutoffs.dead_before is not None else Todo.objects.none())
    done_count = doomed_todos.count()
    doomed_todos = doomed_todos | cancelled
    doomed_ids = doomed_todos.values("id").union(dead.values("id"))
    kept_todos = Todo.objects.exclude(id__in=doomed_todos.values("id")).exclude(
        id__in=dead.values("id"))
    return {
        "done_todos": done_count,
        "cancelled_todos": cancelled.count(),
        "dead_letters": dead.count(),
        "todo_events": TodoEvent.objects.filter(todo_id__in=doomed_ids).count(),
        "delivery_events": DeliveryEvent.objects.filter(received_at__lt=cutoffs.deliveries_before)
        .exclude(id__in=kept_todos.filter(delivery_event__isnull=False)
                 .values("delivery_event_id")).count(),
        "delivery_log": DeliveryRecord.objects.filter(at__lt=cutoffs.delivery_log_before).count()
        + DeliveryDrops.objects.filter(minute__lt=cutoffs.delivery_log_before).count(),
        "mcp_sessions": McpSession.objects.filter(
            terminated_at__lt=cutoffs.sessions_before, stream_attachments__isnull=True).count(),
    }


# -- todos, with their events and secrets --------------------------------------------------------

@dataclass(frozen=True)
class DoomedTodos:
    """Which todos a batch takes: a SQL condition (with its parameters and the partial index
    that serves it, see todos.models) and the same condition as ORM lookups."""

    where: str
    params: tuple
    order_by: str
    lookups: dict

    def select_sql(self) -> str:
        """The batch's choice of rows; its one remaining parameter is the batch size."""
        return (f"SELECT id FROM todos_todo WHERE {self.where} "
                f"ORDER BY {self.order_by} LIMIT %s")


def done_past_retention(cutoffs: Cutoffs) -> DoomedTodos:
    # Served by the partial index todo_prune_done (updated_at WHERE state = 'done').
    return DoomedTodos("state = 'done' AND updated_at < %s", (cutoffs.done_before,), "updated_at",
                   {"state": State.DONE, "updated_at__lt": cutoffs.done_before})


def cancelled_past_retention(cutoffs: Cutoffs) -> DoomedTodos:
    # Cancelled todos are kept exactly as long as done ones. Served by the partial index
    # todo_prune_cancelled (cancelled_at WHERE state = 'cancelled').
    return DoomedTodos("state = 'cancelled' AND cancelled_at < %s", (cutoffs.done_before,),
                       "cancelled_at",
                       {"state": State.CANCELLED, "cancelled_at__lt": cutoffs.done_before})


def dead_past_retention(cutoffs: Cutoffs) -> DoomedTodos:
    # Served by the partial index todo_prune_dead (dead_lettered_at WHERE dead letter).
    return DoomedTodos(
        "state = 'failed' AND dead_lettered_at IS NOT NULL AND dead_lettered_at < %s",
        (cutoffs.dead_before,), "dead_lettered_at",
        {"state": State.FAILED, "dead_lettered_at__isnull": False,
         "dead_lettered_at__lt": cutoffs.dead_before},
    )


def _delete_todo_batch(doomed: DoomedTodos, batch: int) -> tuple[int, int]:
    """Delete up to ``batch`` todos matching ``doomed`` with their audit events and secrets,
    folding the events into the pruned tally so /metrics counters never go down. Returns
    ``(todos deleted, events deleted)``."""
    if connection.vendor == "postgresql":
        return _delete_todo_batch_postgres(doomed, batch)
    return _delete_todo_batch_sqlite(doomed, batch)


def _delete_todo_batch_postgres(doomed: DoomedTodos, batch: int) -> tuple[int, int]:
    # One statement: the doomed rows are locked (skipping any a requeue or another prune
    # holds), their secrets and events deleted, the events folded into the tally, the todos
    # deleted. Django's foreign keys are DEFERRABLE INITIALLY DEFERRED, so the order of the
    # sibling deletes inside the statement does not matter.
    sql = f"""
        WITH doomed AS (
            {doomed.select_sql()} FOR UPDATE SKIP LOCKED
        ), gone_secrets AS (
            DELETE FROM ingest_operatorsecret s USING doomed d WHERE s.todo_id = d.id
        ), gone_events AS (
            DELETE FROM todos_todoevent e USING doomed d WHERE e.todo_id = d.id
            RETURNING e.action, e.to_state
        ), folded AS (
            INSERT INTO todos_prunedeventtally (action, to_state, count)
            SELECT action, to_state, count(*) FROM gone_events GROUP BY action, to_state
            ON CONFLICT (action, to_state)
            DO UPDATE SET count = todos_prunedeventtally.count + EXCLUDED.count
        ), gone_todos AS (
            DELETE FROM todos_todo t USING doomed d WHERE t.id = d.id RETURNING t.id
        )
        SELECT (SELECT count(*) FROM gone_todos), (SELECT count(*) FROM gone_events)
    """
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, (*doomed.params, batch))
        todos, events = cursor.fetchone()
    return int(todos), int(events)


def _delete_todo_batch_sqlite(doomed: DoomedTodos, batch: int) -> tuple[int, int]:
    # SQLite has one writer at a time, so the batch's IMMEDIATE transaction is its lock; the
    # same steps as the PostgreSQL statement, one statement each.
    from django.db.models import Count, F

    with transaction.atomic():
        ids = list(Todo.objects.filter(**doomed.lookups).order_by(doomed.order_by)
                   .values_list("id", flat=True)[:batch])
        if not ids:
            return 0, 0
        OperatorSecret.objects.filter(todo_id__in=ids).delete()
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
        deleted = Todo.objects.filter(id__in=ids)._raw_delete(events.db)
    return deleted, folded


# -- delivery events and sessions --------------------------------------------------------------

def _delete_delivery_event_batch(cutoffs: Cutoffs, batch: int) -> int:
    """Delivery events past retention that no todo points at any more (their todos were pruned,
    or they created none). Served by delivery_event_prune (received_at, id) and, for the
    NOT EXISTS, the todo's own delivery_event_id index."""
    lock = "FOR UPDATE SKIP LOCKED" if connection.vendor == "postgresql" else ""
    sql = f"""
        DELETE FROM ingest_deliveryevent WHERE id IN (
            SELECT d.id FROM ingest_deliveryevent d
            WHERE d.received_at < %s
              AND NOT EXISTS (SELECT 1 FROM todos_todo t WHERE t.delivery_event_id = d.id)
            ORDER BY d.received_at, d.id LIMIT %s {lock}
        )
    """
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, (cutoffs.deliveries_before, batch))
        return cursor.rowcount


def _delete_delivery_log_batch(cutoffs: Cutoffs, batch: int) -> int:
    """The delivery log's records past their window (served by deliveryrecord_at), then its
    per-minute dropped counts of the same age (a handful of rows per webhook and minute)."""
    lock = "FOR UPDATE SKIP LOCKED" if connection.vendor == "postgresql" else ""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"""
            DELETE FROM ingest_deliveryrecord WHERE id IN (
                SELECT id FROM ingest_deliveryrecord WHERE at < %s ORDER BY at LIMIT %s {lock}
            )""", (cutoffs.delivery_log_before, batch))
        deleted = cursor.rowcount
        cursor.execute(f"""
            DELETE FROM ingest_deliverydrops WHERE id IN (
                SELECT id FROM ingest_deliverydrops WHERE minute < %s LIMIT %s {lock}
            )""", (cutoffs.delivery_log_before, batch))
        return deleted + cursor.rowcount


def _delete_session_batch(cutoffs: Cutoffs, batch: int) -> int:
    """Ended MCP sessions (terminated, or expired by the idle sweep) past their day.
    Served by mcp_session_prune (terminated_at WHERE terminated_at IS NOT NULL). A session a
    stream attachment still names is left for a later pass (the attachment's foreign key would
    refuse the delete): its stream closes, or its dead process's rows are swept, first. No new
    attachment can appear on an ended session (``attach_stream`` guards on a live one)."""
    lock = "FOR UPDATE SKIP LOCKED" if connection.vendor == "postgresql" else ""
    sql = f"""
        DELETE FROM channels_push_mcpsession WHERE id IN (
            SELECT id FROM channels_push_mcpsession s
            WHERE terminated_at IS NOT NULL AND terminated_at < %s
            AND NOT EXISTS (SELECT 1 FROM channels_push_streamattachment a
                            WHERE a.session_id = s.id)
            ORDER BY terminated_at LIMIT %s {lock}
        )
    """
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, (cutoffs.sessions_before, batch))
        return cursor.rowcount


def prune_history_sweep() -> int:
    """The hourly sweep: ``prune_history`` now; returns the rows deleted, all kinds together."""
    return sum(prune_history().values())


# -- the replay ledger and the delivery log's dropped counts ------------------------------------
# Their own small sweeps, apart from the hourly prune: the ledger's window is its own, and the
# dropped counts must reach the database within seconds, not an hour.

# One pass deletes at most this many ledger entries: a short statement that never holds many
# row locks; a busy install accepts far fewer deliveries per pass interval (60 s).
REPLAY_LEDGER_PRUNE_BATCH = 1000


def prune_replay_ledger(*, now=None, pause_seconds=PAUSE_BETWEEN_BATCHES_SECONDS) -> int:
    """Delete replay-ledger entries older than SWITCHBOARD_REPLAY_WINDOW (they can no longer
    refuse anything), oldest first, in batches of REPLAY_LEDGER_PRUNE_BATCH until none is left
    (one batch per pass fell behind above ~17 accepted deliveries a second). Returns how many."""
    now = now or timezone.now()
    total = 0
    while True:
        expired = list(ReplayLedgerEntry.objects.filter(
            accepted_at__lt=now - settings.SWITCHBOARD_REPLAY_WINDOW,
        ).order_by("accepted_at").values_list("pk", flat=True)[:REPLAY_LEDGER_PRUNE_BATCH])
        if not expired:
            return total
        deleted, _ = ReplayLedgerEntry.objects.filter(pk__in=expired).delete()
        total += deleted
        if len(expired) < REPLAY_LEDGER_PRUNE_BATCH:
            return total
        time.sleep(pause_seconds)


# One pass deletes at most this many secrets: operators hand over a few per todo, so even a
# burst of completions clears in a pass or two of short statements.
ENDED_SECRETS_BATCH = 1000


def delete_secrets_of_ended_todos() -> int:
    """Delete at most ENDED_SECRETS_BATCH operator secrets whose todo has ended (done,
    cancelled or dead-lettered, ``todos.queries.ended``): a secret reads as missing from the
    moment its todo ends (``queries.read_secret``), and this takes it off the disk within a
    pass (docs/decisions/secrets-end-with-their-todo.md). Safe when two runs overlap (a
    secret deleted twice is deleted once). Returns how many."""
    ended = list(OperatorSecret.objects.filter(todo_queries.ended(OuterRef("todo_id")))
                 .values_list("pk", flat=True)[:ENDED_SECRETS_BATCH])
    if not ended:
        return 0
    deleted, _ = OperatorSecret.objects.filter(pk__in=ended).delete()
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
