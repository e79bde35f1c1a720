"""Threads' transitions: follow-ups, a held todo asked to stop, a thread stopped by its source
(docs/work-control.md#threads)."""

import threading

import pytest
from django.db import connection
from django.utils import timezone

from ingest.models import DeliveryEvent, Webhook
from todos import transitions
from todos.models import FollowUp, OutboxEntry, State, Todo, TodoEvent
from todos.transitions import Refusal

pytestmark = pytest.mark.django_db


def fold(todo, title="a comment", **kwargs):
    return transitions.add_followup(
        todo.pk, delivery_event=kwargs.pop("delivery_event", None), kind="issue_comment.created",
        title=title, actor="octocat", trust="signed", payload={"n": 1},
        now=kwargs.pop("now", timezone.now()), **kwargs)


def test_a_followup_counts_in_order_records_an_event_and_keeps_the_state(
        make_todo, published, django_capture_on_commit_callbacks):
    todo = make_todo()
    with django_capture_on_commit_callbacks(execute=True):
        first, second = fold(todo, "one"), fold(todo, "two\nlines")
    assert (first.seq, second.seq) == (1, 2)
    assert second.title == "two lines" and second.payload == {"n": 1} and second.actor == "octocat"
    assert Todo.objects.get(pk=todo.pk).followup_count == 2
    events = list(TodoEvent.objects.filter(todo=todo, action="followup")
                  .values_list("from_state", "to_state", "actor"))
    assert events == [("pending", "pending", "octocat")] * 2
    assert [c["action"] for c in published][-2:] == ["followup", "followup"]


def test_a_followup_of_an_ended_or_stopping_todo_is_refused_with_none(agent, make_todo):
    done = make_todo()
    transitions.claim_todo(agent, done.pk)
    transitions.complete_todo(agent, done.pk)
    assert fold(done) is None
    held = make_todo()
    transitions.claim_todo(agent, held.pk)
    transitions.request_cancel(held.pk, actor="webhook:gh")
    assert fold(held) is None
    assert not FollowUp.objects.exists()
    assert Todo.objects.get(pk=held.pk).followup_count == 0


@pytest.mark.parametrize("level, entries", [("off", []), ("ack", ["followup"]),
                                            ("status", ["followup"])])
def test_a_followup_tells_every_listening_source(make_todo, level, entries):
    todo = make_todo(write_back=level)
    OutboxEntry.objects.all().delete()
    fold(todo)
    assert list(OutboxEntry.objects.values_list("action", flat=True)) == entries


def test_a_followup_refuses_text_no_database_stores(make_todo):
    with pytest.raises(Refusal) as refused:
        fold(make_todo(), title="nul \x00 here")
    assert refused.value.code == "invalid_argument"


@pytest.mark.django_db(transaction=True)
def test_concurrent_followups_get_every_seq_once(make_todo):
    if connection.vendor != "postgresql":
        pytest.skip("concurrency: PostgreSQL")
    todo = make_todo()
    barrier, errors = threading.Barrier(8), []

    def add():
        try:
            barrier.wait()
            assert fold(todo) is not None
        except Exception as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=add) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert sorted(FollowUp.objects.filter(todo=todo).values_list("seq", flat=True)) == list(
        range(1, 9))


def test_request_cancel_marks_a_held_todo_once_and_announces_it(
        agent, make_todo, published, django_capture_on_commit_callbacks):
    todo = make_todo()
    transitions.claim_todo(agent, todo.pk)
    with django_capture_on_commit_callbacks(execute=True):
        asked = transitions.request_cancel(todo.pk, actor="alice", reason="not needed")
        again = transitions.request_cancel(todo.pk, actor="alice")
    assert asked.state == State.CLAIMED and asked.cancel_requested_at is not None
    assert again.cancel_requested_at == asked.cancel_requested_at
    events = list(TodoEvent.objects.filter(todo=todo, action="cancel_request")
                  .values_list("from_state", "to_state", "detail"))
    assert events == [("claimed", "claimed", {"reason": "not needed"})]
    assert [c["action"] for c in published].count("cancel_requested") == 1


@pytest.mark.parametrize("setup, code", [("pending", "not_claimable"), ("done", "already_done"),
                                         ("cancelled", "already_done"), ("missing", "not_found"),
                                         ("other_endpoint", "not_found")])
def test_request_cancel_refusals(agent, make_todo, endpoint, setup, code):
    todo = make_todo()
    operator = transitions.Caller.operator(endpoint, "alice")
    if setup == "done":
        transitions.claim_todo(agent, todo.pk)
        transitions.complete_todo(agent, todo.pk)
    elif setup == "cancelled":
        transitions.cancel_todo(operator, todo.pk)
    elif setup == "other_endpoint":
        transitions.claim_todo(agent, todo.pk)
    target = 10**9 if setup == "missing" else todo.pk
    from tests.factories import EndpointFactory
    other = EndpointFactory(slug="other", owner=endpoint.owner)
    with pytest.raises(Refusal) as refused:
        transitions.request_cancel(target, actor="alice",
                                   endpoint=other if setup == "other_endpoint" else None)
    assert refused.value.code == code
    assert not TodoEvent.objects.filter(action="cancel_request").exists()


def on_thread(make_todo, webhook, thread, **kwargs):
    event = DeliveryEvent.objects.create(webhook=webhook, trust="signed",
                                         received_at=timezone.now())
    todo = make_todo(delivery_event=event, **kwargs)
    Todo.objects.filter(pk=todo.pk).update(thread=thread)
    return todo


def test_stop_thread_cancels_unheld_asks_held_and_leaves_others(agent, make_todo, endpoint,
                                                                 published):
    hook, other_hook = (Webhook.objects.create(slug=slug, owner=endpoint.owner, source="github",
                                               secret="s") for slug in ("gh", "gh2"))
    pending = on_thread(make_todo, hook, "o/r#1")
    held = on_thread(make_todo, hook, "o/r#1")
    transitions.claim_todo(agent, held.pk)
    gated = on_thread(make_todo, hook, "o/r#1", requires_approval=True)
    other_thread = on_thread(make_todo, hook, "o/r#2")
    other_webhook = on_thread(make_todo, other_hook, "o/r#1")
    done = on_thread(make_todo, hook, "o/r#1")
    transitions.claim_todo(agent, done.pk)
    transitions.complete_todo(agent, done.pk)

    stopped = transitions.stop_thread(endpoint.pk, "o/r#1", webhook_id=hook.pk,
                                      actor="webhook:gh")
    assert stopped == [str(pending.pk), str(held.pk), str(gated.pk)]
    states = dict(Todo.objects.values_list("pk", "state"))
    assert states[pending.pk] == states[gated.pk] == "cancelled"
    assert states[held.pk] == "claimed" and Todo.objects.get(pk=held.pk).cancel_requested_at
    assert states[other_thread.pk] == states[other_webhook.pk] == "pending"
    assert states[done.pk] == "done"
    cancels = TodoEvent.objects.filter(action="cancel", todo_id__in=[pending.pk, gated.pk])
    assert {(e.from_state, e.actor, e.detail["reason"]) for e in cancels} == {
        ("pending", "webhook:gh", "source_closed"), ("awaiting_approval", "webhook:gh",
                                                     "source_closed")}
    assert TodoEvent.objects.get(action="cancel_request").detail == {"reason": "source_closed"}
    # Nothing left to stop: a second stop is a no-op.
    assert transitions.stop_thread(endpoint.pk, "o/r#1", webhook_id=hook.pk,
                                   actor="webhook:gh") == [str(held.pk)]
    assert TodoEvent.objects.filter(action="cancel_request").count() == 1
    assert Webhook.objects.count() == 2
