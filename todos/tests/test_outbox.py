"""The outbox entries transitions write in their own statement (docs/write-back.md#the-outbox):
for a todo whose source hears every change, one per transition but a heartbeat; for one that
hears only of its creation, its create; for the rest, none."""

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from todos import transitions
from todos.models import OutboxEntry

pytestmark = pytest.mark.django_db


def entries(todo) -> list[str]:
    return list(OutboxEntry.objects.filter(todo_id=todo.pk).order_by("id")
                .values_list("action", flat=True))


def test_every_transition_of_a_status_todo_but_a_heartbeat_writes_an_entry(agent, make_todo,
                                                                          endpoint):
    todo = make_todo(write_back="status")
    transitions.claim_todo(agent, todo.pk)
    transitions.heartbeat_todo(agent, todo.pk)
    transitions.fail_todo(agent, todo.pk, error="boom")
    operator = transitions.Caller.operator(endpoint, "alice")
    transitions.requeue_todo(operator, todo.pk)
    transitions.claim_todo(agent, todo.pk)
    transitions.complete_todo(agent, todo.pk, result={"summary": "ok"})
    assert entries(todo) == ["create", "claim", "fail", "requeue", "claim", "complete"]


def test_an_ack_todo_writes_only_its_create_and_an_off_todo_nothing(agent, make_todo):
    ack, off = make_todo(write_back="ack"), make_todo(write_back="off")
    for todo in (ack, off):
        transitions.claim_todo(agent, todo.pk)
        transitions.complete_todo(agent, todo.pk)
    assert entries(ack) == ["create"] and entries(off) == []


def test_the_entry_rides_in_the_transitions_own_statement(agent, make_todo):
    todo = make_todo(write_back="status")
    with CaptureQueriesContext(connection) as queries:
        transitions.claim_todo(agent, todo.pk)
    if connection.vendor == "postgresql":
        (claim,) = [q["sql"] for q in queries.captured_queries if "todos_outboxentry" in q["sql"]]
        assert "UPDATE todos_todo" in claim and "INSERT INTO todos_todoevent" in claim


def test_a_rolled_back_transition_leaves_no_entry(agent, make_todo):
    todo = make_todo(write_back="status")
    with pytest.raises(RuntimeError), transaction.atomic():
        transitions.claim_todo(agent, todo.pk)
        raise RuntimeError("rolled back")
    assert entries(todo) == ["create"]


def test_taking_entries_deletes_them_oldest_first(agent, make_todo):
    first, second = make_todo(write_back="status"), make_todo(write_back="ack")
    transitions.claim_todo(agent, first.pk)
    with transaction.atomic():
        assert transitions.take_outbox_entries(limit=2) == [(first.pk, "create"),
                                                            (second.pk, "create")]
    assert transitions.take_outbox_entries(limit=10) == [(first.pk, "claim")]
    assert not OutboxEntry.objects.exists()


# -- post_update: the holder's progress line -----------------------------------------------------


def test_post_update_keeps_the_latest_line_and_a_new_claim_clears_it(agent, make_todo):
    todo = make_todo(write_back="status")
    transitions.claim_todo(agent, todo.pk)
    transitions.post_update_todo(agent, todo.pk, text="reading the code")
    updated = transitions.post_update_todo(agent, todo.pk, text="tests pass locally")
    assert updated.progress == "tests pass locally" and updated.state == "claimed"
    assert entries(todo) == ["create", "claim", "progress", "progress"]
    transitions.release_todo(agent, todo.pk)
    assert transitions.claim_todo(agent, todo.pk).progress is None


def test_post_update_is_refused_where_the_source_hears_no_status(agent, make_todo):
    for level in ("off", "ack"):
        todo = make_todo(write_back=level)
        transitions.claim_todo(agent, todo.pk)
        with pytest.raises(transitions.Refusal) as refused:
            transitions.post_update_todo(agent, todo.pk, text="half way")
        assert refused.value.code == "write_back_off"


@pytest.mark.parametrize("text", ["", "   ", "x" * 2001, 42, None])
def test_post_update_takes_1_to_2000_characters(agent, make_todo, text):
    todo = make_todo(write_back="status")
    transitions.claim_todo(agent, todo.pk)
    with pytest.raises(transitions.Refusal) as refused:
        transitions.post_update_todo(agent, todo.pk, text=text)
    assert refused.value.code == "invalid_argument"


def test_post_update_is_fenced_like_heartbeat(agent, endpoint, make_todo):
    todo = make_todo(write_back="status")
    transitions.claim_todo(agent, todo.pk)
    other = transitions.Caller.agent(endpoint, "session-b")
    with pytest.raises(transitions.Refusal) as refused:
        transitions.post_update_todo(other, todo.pk, text="not mine")
    assert refused.value.code == "lease_lost"
    unclaimed = make_todo(write_back="status")
    with pytest.raises(transitions.Refusal) as refused:
        transitions.post_update_todo(agent, unclaimed.pk, text="never claimed")
    assert refused.value.code == "lease_lost"
