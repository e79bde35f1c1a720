"""Retention (CONTRACT §14): prune_history deletes exactly what is past retention, in bounded
batches, keeps dead letters unless told otherwise, and never makes a /metrics counter go down."""

import json
import re
import threading
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.utils import timezone

from channels_push.models import McpSession
from ingest import sweeps
from ingest.models import DeliveryEvent, OperatorSecret, TrustMode
from tests import plans
from todos import sweeps as todo_sweeps
from todos import transitions
from todos.models import PrunedEventTally, State, Todo, TodoEvent

pytestmark = pytest.mark.django_db(transaction=True)

NOW = timezone.now()
LONG_AGO = NOW - timedelta(days=45)  # past the default 30 days
RECENTLY = NOW - timedelta(days=2)


@pytest.fixture
def history(endpoint, agent):
    """Todos in every state, some finished long ago and some recently, with a secret and a
    delivery event each."""

    def delivery(at):
        return DeliveryEvent.objects.create(trust=TrustMode.OPERATOR, received_at=at,
                                            source="operator")

    endpoint.max_attempts = 1  # so that one failure dead-letters
    endpoint.save()

    def make(title, at, finish=None, *, shared_delivery=None):
        todo, _ = transitions.create_todo(
            endpoint=endpoint, queue="inbox", title=title, actor="test", now=at,
            delivery_event=shared_delivery or delivery(at),
        )
        OperatorSecret.objects.create(ref=OperatorSecret.mint_ref(), name="k", todo=todo,
                                      ciphertext=OperatorSecret.seal("v"))
        if finish:
            transitions.claim_todo(agent, todo.pk, now=at)
            finish(agent, todo.pk, now=at + timedelta(seconds=1))
        return Todo.objects.get(pk=todo.pk)

    old_done = [make(f"old done {n}", LONG_AGO, transitions.complete_todo) for n in range(3)]
    shared = old_done[0].delivery_event
    todos = {
        "old_done": old_done,
        "recent_done": make("recent done", RECENTLY, transitions.complete_todo),
        "old_dead": make("old dead", LONG_AGO, transitions.fail_todo),
        "old_pending": make("old pending", LONG_AGO),
        # An old delivery that fanned out to a done todo and a todo still pending: the delivery
        # event stays while any todo points at it.
        "pending_sharing_delivery": make("still pending", LONG_AGO, shared_delivery=shared),
        "no_route_delivery": delivery(LONG_AGO),
    }
    assert todos["old_dead"].is_dead_letter
    return todos


def test_prune_deletes_exactly_the_done_todos_past_retention_with_their_history(history):
    old_ids = [todo.pk for todo in history["old_done"]]
    events_of_old = TodoEvent.objects.filter(todo_id__in=old_ids).count()
    assert events_of_old == 3 * 3  # create, claim, complete

    pruned = sweeps.prune_history(now=NOW)

    assert pruned["done_todos"] == 3
    assert pruned["todo_events"] == events_of_old
    assert pruned["dead_letters"] == 0
    assert not Todo.objects.filter(pk__in=old_ids).exists()
    assert not TodoEvent.objects.filter(todo_id__in=old_ids).exists()
    assert not OperatorSecret.objects.filter(todo_id__in=old_ids).exists()
    kept = {history[name].pk for name in
            ("recent_done", "old_dead", "old_pending", "pending_sharing_delivery")}
    assert set(Todo.objects.values_list("pk", flat=True)) == kept
    # Secrets die with their todo's completion or dead letter (their own sweep deletes them);
    # only the unfinished todos keep theirs.
    sweeps.delete_secrets_of_ended_todos()
    unfinished = {history[name].pk for name in ("old_pending", "pending_sharing_delivery")}
    assert set(OperatorSecret.objects.values_list("todo_id", flat=True)) == unfinished
    # Delivery events: those of the two unshared old done todos and the one that created
    # nothing are gone; the one a pending todo still points at stays.
    assert pruned["delivery_events"] == 3
    assert DeliveryEvent.objects.filter(pk=history["old_done"][0].delivery_event_id).exists()
    assert not DeliveryEvent.objects.filter(pk=history["no_route_delivery"].pk).exists()
    # A second run finds nothing.
    assert sum(sweeps.prune_history(now=NOW).values()) == 0


def test_cancelled_todos_are_pruned_like_done_ones(endpoint, agent):
    operator = transitions.Caller.operator(endpoint, "alice")

    def cancelled(at, **kwargs):
        todo, _ = transitions.create_todo(endpoint=endpoint, queue="inbox", title="t",
                                          actor="test", now=at, **kwargs)
        return transitions.cancel_todo(operator, todo.pk, now=at + timedelta(seconds=1))

    old = [cancelled(LONG_AGO), cancelled(LONG_AGO, requires_approval=True)]
    recent = cancelled(RECENTLY)
    assert sweeps.prune_history(now=NOW, dry_run=True)["cancelled_todos"] == 2
    pruned = sweeps.prune_history(now=NOW)
    assert (pruned["cancelled_todos"], pruned["todo_events"]) == (2, 4)  # create, cancel each
    assert list(Todo.objects.values_list("pk", flat=True)) == [recent.pk]
    assert not TodoEvent.objects.filter(todo_id__in=[t.pk for t in old]).exists()


def test_dead_letters_are_kept_unless_their_own_retention_is_set(history, settings):
    sweeps.prune_history(now=NOW)
    assert Todo.objects.filter(pk=history["old_dead"].pk).exists()

    settings.SWITCHBOARD_RETAIN_DEAD = timedelta(days=60)
    assert sweeps.prune_history(now=NOW)["dead_letters"] == 0  # 45 days old: not yet

    settings.SWITCHBOARD_RETAIN_DEAD = timedelta(days=7)
    pruned = sweeps.prune_history(now=NOW)
    assert pruned["dead_letters"] == 1
    assert not Todo.objects.filter(pk=history["old_dead"].pk).exists()
    assert Todo.objects.filter(pk=history["old_pending"].pk).exists()


def test_dry_run_counts_what_the_prune_then_deletes_and_deletes_nothing(history, settings):
    settings.SWITCHBOARD_RETAIN_DEAD = timedelta(days=7)
    McpSession.objects.create(endpoint=history["old_pending"].endpoint, protocol_version="x",
                              created_at=LONG_AGO, last_seen_at=LONG_AGO,
                              terminated_at=NOW - timedelta(days=2))
    before = Todo.objects.count(), TodoEvent.objects.count(), DeliveryEvent.objects.count()
    would = sweeps.prune_history(now=NOW, dry_run=True)
    assert (Todo.objects.count(), TodoEvent.objects.count(),
            DeliveryEvent.objects.count()) == before
    assert sweeps.prune_history(now=NOW) == would
    assert would == {"done_todos": 3, "cancelled_todos": 0, "dead_letters": 1, "todo_events": 12,
                     "write_backs": 0, "delivery_events": 4, "delivery_log": 0,
                     "mcp_sessions": 1}


def test_ended_sessions_are_deleted_after_a_day_and_live_ones_never(endpoint):
    def session(terminated_at):
        return McpSession.objects.create(endpoint=endpoint, protocol_version="2025-06-18",
                                         created_at=LONG_AGO, last_seen_at=LONG_AGO,
                                         terminated_at=terminated_at)

    old_ended = session(NOW - timedelta(days=2))
    fresh_ended = session(NOW - timedelta(hours=2))
    live = session(None)
    assert sweeps.prune_history(now=NOW)["mcp_sessions"] == 1
    assert set(McpSession.objects.values_list("pk", flat=True)) == {fresh_ended.pk, live.pk}
    assert not McpSession.objects.filter(pk=old_ended.pk).exists()


def test_prune_works_in_bounded_batches(endpoint, agent):
    for n in range(7):
        todo, _ = transitions.create_todo(endpoint=endpoint, queue="inbox", title=f"t{n}",
                                          actor="test", now=LONG_AGO)
        transitions.claim_todo(agent, todo.pk, now=LONG_AGO)
        transitions.complete_todo(agent, todo.pk, now=LONG_AGO)
    statements = []

    def count_deletes(execute, sql, params, many, context):
        if "DELETE" in sql and "todos_todo" in sql:
            statements.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(count_deletes):
        pruned = sweeps.prune_history(now=NOW, batch=3, pause_seconds=0)
    assert pruned["done_todos"] == 7
    assert not Todo.objects.exists()
    # 3 + 3 + 1: three batches (on SQLite each batch is a few statements, all naming todos),
    # besides the cancelled todos' one batch that finds none.
    batches = [sql for sql in statements if (re.search(r"DELETE FROM .?todos_todo.? ", sql)
               or "WITH doomed" in sql) and "state = 'cancelled'" not in sql]
    assert len(batches) == 3, statements


def test_metrics_counters_do_not_go_down_when_history_is_pruned(history, client, settings):
    settings.SWITCHBOARD_METRICS_TOKEN = "scrape"

    def counters():
        text = client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape").content.decode()
        return {name: float(value) for name, value in
                re.findall(r"^(switchboard_todo\w*_total) (\S+)$", text, re.M)}

    before = counters()
    assert before["switchboard_todo_completions_total"] == 4
    assert before["switchboard_todos_created_total"] == 7
    sweeps.prune_history(now=NOW)
    assert TodoEvent.objects.filter(action="complete").count() == 1  # only the recent one left
    assert counters() == before
    # New work still counts on top.
    endpoint = history["old_pending"].endpoint
    transitions.create_todo(endpoint=endpoint, queue="inbox", title="new", actor="test")
    after = counters()
    assert after["switchboard_todos_created_total"] == before["switchboard_todos_created_total"] + 1
    assert PrunedEventTally.objects.get(action="complete", to_state="done").count == 3


def test_a_todo_another_transaction_holds_is_skipped_not_waited_for(endpoint, agent):
    if connection.vendor != "postgresql":
        pytest.skip("row locks are PostgreSQL's; SQLite's single writer serialises the prune")
    held, free = [transitions.create_todo(endpoint=endpoint, queue="inbox", title=t,
                                          actor="test", now=LONG_AGO)[0] for t in "ab"]
    for todo in (held, free):
        transitions.claim_todo(agent, todo.pk, now=LONG_AGO)
        transitions.complete_todo(agent, todo.pk, now=LONG_AGO)
    locked, release = threading.Event(), threading.Event()

    def hold_row():
        with transaction.atomic():
            Todo.objects.select_for_update().get(pk=held.pk)
            locked.set()
            release.wait(10)
        connection.close()

    holder = threading.Thread(target=hold_row)
    holder.start()
    try:
        assert locked.wait(10)
        assert sweeps.prune_history(now=NOW)["done_todos"] == 1
        assert Todo.objects.filter(pk=held.pk).exists()
    finally:
        release.set()
        holder.join()
    assert sweeps.prune_history(now=NOW)["done_todos"] == 1  # the next run takes it


def test_prune_command_prints_counts_as_json(history):
    from io import StringIO

    out = StringIO()
    call_command("prune", "--dry-run", "--json", stdout=out)
    assert json.loads(out.getvalue()) == {"would_prune": {
        "done_todos": 3, "cancelled_todos": 0, "dead_letters": 0, "todo_events": 9,
        "write_backs": 0, "delivery_events": 3,
        "delivery_log": 0, "mcp_sessions": 0}}
    out = StringIO()
    call_command("prune", "--json", stdout=out)
    assert json.loads(out.getvalue())["pruned"]["done_todos"] == 3


def test_the_hourly_sweep_is_scheduled_for_beat_and_the_embedded_scheduler():
    from switchboard import scheduler
    from switchboard.celery import app

    assert (sweeps.prune_history_sweep, 3600.0) in scheduler.embedded_sweeps()
    entry = app.conf.beat_schedule["prune-history"]
    assert entry == {"task": "ingest.tasks.prune_history", "schedule": 3600.0}


@pytest.mark.skipif("connection.vendor != 'postgresql'",
                    reason="query plans are PostgreSQL's; SQLite runs the same SQL unplanned")
def test_prune_batches_use_their_partial_indexes(endpoint):
    states = ["done"] * 8 + ["pending", "failed"]
    Todo.objects.bulk_create(
        Todo(endpoint=endpoint, queue="inbox", title="t", state=states[i % 10],
             dead_lettered_at=LONG_AGO if states[i % 10] == "failed" else None,
             created_at=LONG_AGO, updated_at=LONG_AGO if i % 3 else NOW)
        for i in range(5000)
    )
    with connection.cursor() as cursor:
        plans.analyze_every_table(cursor)
    cutoffs = sweeps.Cutoffs.at(NOW)

    def plan(doomed):
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN " + doomed.select_sql(), (*doomed.params, sweeps.PRUNE_BATCH))
            return "\n".join(row[0] for row in cursor.fetchall())

    text = plan(todo_sweeps.done_past_retention(cutoffs.done_before))
    assert "todo_prune_done" in text and "Sort" not in text, text
    text = plan(todo_sweeps.dead_past_retention(NOW))
    assert "todo_prune_dead" in text and "Sort" not in text, text


def test_a_pruned_todo_answers_a_clear_not_found_page(client, operator, make_todo, agent):
    todo = make_todo(now=LONG_AGO)
    transitions.claim_todo(agent, todo.pk, now=LONG_AGO)
    transitions.complete_todo(agent, todo.pk, now=LONG_AGO)
    client.force_login(operator)
    assert client.get(f"/todos/{todo.pk}/").status_code == 200
    sweeps.prune_history()
    answer = client.get(f"/todos/{todo.pk}/")
    assert answer.status_code == 404
    assert b"pruned" in answer.content
    board = client.get("/todos/")
    assert board.status_code == 200 and f"#{todo.pk}".encode() not in board.content
    # The admin's change page of a pruned todo says so instead of failing.
    operator.is_staff = operator.is_superuser = True
    operator.save()
    admin = client.get(f"/admin/todos/todo/{todo.pk}/change/", follow=True)
    assert admin.status_code == 200
    assert b"doesn" in admin.content  # "… doesn't exist. Perhaps it was deleted?"


def test_the_delivery_log_is_pruned_after_its_own_window(operator, settings):
    from ingest.models import DeliveryDrops, DeliveryRecord, Outcome
    from ingest import transitions as ingest_transitions

    settings.SWITCHBOARD_RETAIN_DELIVERY_LOG = timedelta(days=14)
    webhook, _ = ingest_transitions.create_webhook(slug="logged", owner=operator, source="github")

    def record(at):
        return DeliveryRecord.objects.create(webhook=webhook, at=at, outcome=Outcome.BAD_SIGNATURE,
                                             status=401)

    old, fresh = record(NOW - timedelta(days=15)), record(NOW - timedelta(days=13))
    DeliveryDrops.objects.create(webhook=webhook, minute=NOW - timedelta(days=20), dropped=7)
    kept_drops = DeliveryDrops.objects.create(webhook=webhook, minute=NOW, dropped=3)
    assert sweeps.prune_history(now=NOW, dry_run=True)["delivery_log"] == 2
    assert sweeps.prune_history(now=NOW)["delivery_log"] == 2
    assert list(DeliveryRecord.objects.values_list("pk", flat=True)) == [fresh.pk]
    assert list(DeliveryDrops.objects.values_list("pk", flat=True)) == [kept_drops.pk]
    assert not DeliveryRecord.objects.filter(pk=old.pk).exists()
