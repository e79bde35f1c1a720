"""Retention (docs/operating.md#retention): the hourly prune of history that has served its purpose.

Everything switchboard writes would otherwise stay forever: done todos with their audit events,
the delivery events behind them, operator secrets, ended MCP sessions. The prune is run from
here because ingest is the one app that sees all of them (importing downwards todos and the
push layer's sessions), and because the kinds refer to each other: the secrets of ended todos
go first, then the todos (``todos.sweeps.prune_settled_todos``), then the delivery events no
todo points at any more. Each app deletes its own rows; this only orders the calls.

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

from channels_push.sessions import queries as session_queries
from channels_push.sessions import transitions as session_transitions
from todos import queries as todo_queries
from todos import sweeps as todo_sweeps
from todos import transitions as todo_transitions

from switchboard import ratelimit
from switchboard.db import sql as dialect

from . import repo_tokens, transitions
from .models import (DeliveryDrops, DeliveryEvent, DeliveryRecord, OperatorSecret, RepoToken,
                     ReplayLedgerEntry, Webhook, WriteBack)

# Rows per statement: large enough that a backlog of a million rows clears in a few minutes,
# small enough that one batch holds its row locks for tens of milliseconds.
PRUNE_BATCH = 1000
# Pause between batches, so claims and deliveries interleave with a long prune.
PAUSE_BETWEEN_BATCHES_SECONDS = 0.05

# The kinds ``prune_history`` reports, in the order it deletes them: todos before the delivery
# events they point at.
KINDS = ("done_todos", "cancelled_todos", "dead_letters", "todo_events", "write_backs",
         "delivery_events", "delivery_log", "mcp_sessions")


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
    # The ended todos' secrets first, to the last batch, so nothing of ingest's refers to a
    # doomed todo and the todos' prune touches todos' tables only.
    while delete_secrets_of_ended_todos() == ENDED_SECRETS_BATCH:
        time.sleep(pause_seconds)
    RepoToken.objects.exclude(todo_id__in=todo_sweeps.todos_kept_by_retention(
        done_before=cutoffs.done_before, dead_before=cutoffs.dead_before)).delete()
    pruned.update(todo_sweeps.prune_settled_todos(
        done_before=cutoffs.done_before, dead_before=cutoffs.dead_before, batch=batch,
        pause_seconds=pause_seconds))
    for kind, delete_batch in (("write_backs", _delete_write_back_batch),
                               ("delivery_events", _delete_delivery_event_batch),
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
    settled = {"done_before": cutoffs.done_before, "dead_before": cutoffs.dead_before}
    return {
        **todo_sweeps.count_settled_todos(**settled),
        "write_backs": WriteBack.objects.filter(created_at__lt=cutoffs.done_before)
        .exclude(todo_id__in=todo_sweeps.todos_kept_by_retention(**settled)).count(),
        "delivery_events": DeliveryEvent.objects.filter(received_at__lt=cutoffs.deliveries_before)
        .exclude(id__in=todo_sweeps.delivery_events_kept_by_todos(**settled)).count(),
        "delivery_log": DeliveryRecord.objects.filter(at__lt=cutoffs.delivery_log_before).count()
        + DeliveryDrops.objects.filter(minute__lt=cutoffs.delivery_log_before).count(),
        "mcp_sessions": session_queries.count_deletable_sessions(cutoffs.sessions_before),
    }


# -- write-backs, delivery events, the delivery log, sessions --------------------------------


def _delete_write_back_batch(cutoffs: Cutoffs, batch: int) -> int:
    """Write-backs whose todo the prune took (no todo outlives its retention, and none is
    younger than its write-backs): served by writeback_prune (created_at). One statement."""
    lock = dialect.skip_locked()
    sql = f"""
        DELETE FROM ingest_writeback WHERE id IN (
            SELECT w.id FROM ingest_writeback w
            WHERE w.created_at < %s AND {todo_queries.todo_gone_sql("w.todo_id")}
            ORDER BY w.created_at LIMIT %s {lock}
        )
    """
    with connection.cursor() as cursor:
        cursor.execute(sql, (cutoffs.done_before, batch))
        return cursor.rowcount


def _delete_delivery_event_batch(cutoffs: Cutoffs, batch: int) -> int:
    """Delivery events past retention that no todo points at any more (their todos were pruned,
    or they created none: ``todos.queries.no_todo_points_at_sql``). Served by
    delivery_event_prune (received_at, id). One statement, its own transaction."""
    lock = dialect.skip_locked()
    sql = f"""
        DELETE FROM ingest_deliveryevent WHERE id IN (
            SELECT d.id FROM ingest_deliveryevent d
            WHERE d.received_at < %s AND {todo_queries.no_todo_points_at_sql("d")}
            ORDER BY d.received_at, d.id LIMIT %s {lock}
        )
    """
    with connection.cursor() as cursor:
        cursor.execute(sql, (cutoffs.deliveries_before, batch))
        return cursor.rowcount


def _delete_delivery_log_batch(cutoffs: Cutoffs, batch: int) -> int:
    """The delivery log's records past their window (served by deliveryrecord_at), then its
    per-minute dropped counts of the same age (a handful of rows per webhook and minute)."""
    lock = dialect.skip_locked()
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
    return session_transitions.delete_ended_sessions(ended_before=cutoffs.sessions_before,
                                                     limit=batch)


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


def revoke_ended_agent_tokens() -> dict:
    """What an agent held for a lease that has ended: todo tokens (they stopped working with
    the lease; this records it and ends their sessions) and repository tokens (revoked at
    GitHub). One bounded batch of each (``todos.transitions.ENDED_TOKENS_BATCH``,
    ``repo_tokens.REVOKE_BATCH``); safe when two runs overlap."""
    now = timezone.now()
    todo_tokens = todo_transitions.record_ended_todo_tokens(now=now)
    return {"todo_tokens": len(todo_tokens),
            "repo_tokens": repo_tokens.revoke_ended_repo_tokens(now=now)}
