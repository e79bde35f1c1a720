"""The board's approval banner, its approve/reject/cancel buttons and its confirmed bulk
actions."""

import pytest

from tests.factories import EndpointFactory, UserFactory
from todos import transitions
from todos.models import State, Todo, TodoEvent
from console.tests.test_views import alice_client  # noqa: F401 — a fixture

pytestmark = pytest.mark.django_db


def test_the_board_header_counts_approvals_and_links_to_them(alice_client, make_todo):
    page = alice_client.get("/todos/").content.decode()
    assert 'id="approvals"' in page and "awaiting your approval" not in page
    gated = [make_todo(requires_approval=True) for _ in range(2)]
    bob = EndpointFactory(slug="bobs", owner=UserFactory(username="bob"))
    transitions.create_todo(endpoint=bob, queue="inbox", title="t", actor="t",
                            requires_approval=True)  # not alice's: not counted
    page = alice_client.get("/todos/").content.decode()
    assert "2 todos awaiting your approval" in page
    assert 'href="/todos/?state=awaiting_approval"' in page
    banner = alice_client.get("/todos/approvals").content.decode()
    assert "2 todos awaiting your approval" in banner
    listed = alice_client.get("/todos/?state=awaiting_approval").content.decode()
    assert all(f'id="todo-{todo.pk}"' in listed for todo in gated)
    assert f'/todos/{gated[0].pk}/approve' in listed and f'/todos/{gated[0].pk}/reject' in listed


def test_one_click_approve_reject_and_cancel(alice_client, make_todo, agent):
    first, second = make_todo(requires_approval=True), make_todo(requires_approval=True)
    claimed = transitions.claim_todo(agent, make_todo().pk)
    for todo, action in ((first, "approve"), (second, "reject"), (claimed, "cancel")):
        answer = alice_client.post(f"/todos/{todo.pk}/{action}", {"next": "/todos/"})
        assert answer.status_code == 302
    states = dict(Todo.objects.values_list("pk", "state"))
    assert [states[t.pk] for t in (first, second, claimed)] == ["pending", "cancelled",
                                                                "cancelled"]
    cancel = TodoEvent.objects.filter(todo_id=claimed.pk).latest("id")
    assert (cancel.action, cancel.actor, cancel.detail["override"]) == ("cancel", "alice", True)
    again = alice_client.post(f"/todos/{first.pk}/approve", {"next": "/todos/"}, follow=True)
    assert "not_claimable" in again.content.decode()  # pending now: nothing to approve


def test_bulk_actions_are_confirmed_first_then_applied(alice_client, make_todo):
    todos = [make_todo(requires_approval=True) for _ in range(3)]
    done = make_todo()
    ids = [str(t.pk) for t in todos]
    before = TodoEvent.objects.count()
    confirm = alice_client.get("/todos/bulk/cancel", {"ids": ids, "next": "/todos/"})
    assert confirm.status_code == 200
    page = confirm.content.decode()
    assert "Cancel 3 todos?" in page and 'name="reason"' in page
    assert TodoEvent.objects.count() == before  # nothing changed before the confirmation
    answer = alice_client.post("/todos/bulk/approve", {"ids": ids[:2], "next": "/todos/"},
                               follow=True)
    assert "approved 2" in answer.content.decode()
    answer = alice_client.post("/todos/bulk/cancel", {"ids": [*ids, str(done.pk)],
                                                      "reason": "sprint over", "next": "/todos/"},
                               follow=True)
    assert "cancelled 4" in answer.content.decode()
    assert set(Todo.objects.values_list("state", flat=True)) == {State.CANCELLED}
    assert TodoEvent.objects.filter(action="cancel", detail__reason="sprint over").count() == 4


def test_bulk_approve_and_reject_take_only_todos_awaiting_approval_of_the_operator(
        alice_client, make_todo):
    mine, pending = make_todo(requires_approval=True), make_todo()
    bob = EndpointFactory(slug="bobs", owner=UserFactory(username="bob"))
    theirs, _ = transitions.create_todo(endpoint=bob, queue="inbox", title="t", actor="t",
                                        requires_approval=True)
    page = alice_client.get("/todos/bulk/reject",
                            {"ids": [mine.pk, pending.pk, theirs.pk]}).content.decode()
    assert "Reject 1 todo?" in page
    answer = alice_client.post("/todos/bulk/reject", {"ids": [mine.pk, pending.pk, theirs.pk]})
    assert answer.status_code == 302
    states = dict(Todo.objects.values_list("pk", "state"))
    assert [states[t.pk] for t in (mine, pending, theirs)] == [
        "cancelled", "pending", "awaiting_approval"]
