"""Promote: the operator vouches for an unverified todo (CONTRACT §12). One guarded statement:
pending and unverified -> trust operator, its ring budget fresh, a ``promote`` event; announced
as ready, so it rings like a new todo."""

import pytest

from todos import transitions
from todos.models import EDGES, State, Todo, TodoEvent, Trust
from todos.transitions import Caller, Refusal

pytestmark = pytest.mark.django_db


def test_promote_makes_a_pending_unverified_todo_operator_trusted(
        endpoint, make_todo, published, django_capture_on_commit_callbacks):
    todo = make_todo(trust=Trust.UNVERIFIED)
    with django_capture_on_commit_callbacks(execute=True):
        promoted = transitions.promote_todo(Caller.operator(endpoint, "alice"), todo.pk)
    assert (promoted.trust, promoted.state, promoted.ring_attempts) == (Trust.OPERATOR, State.PENDING, 0)
    event = TodoEvent.objects.filter(todo=todo).latest("id")
    assert (event.action, event.from_state, event.to_state, event.actor) == (
        "promote", "pending", "pending", "alice")
    assert ("promote", State.PENDING, State.PENDING) in EDGES
    assert published[-1]["action"] == "promote"


@pytest.mark.parametrize("trust", [Trust.SIGNED, Trust.OPERATOR])
def test_only_unverified_todos_are_promoted(endpoint, make_todo, trust):
    todo = make_todo(trust=trust)
    before = TodoEvent.objects.count()
    with pytest.raises(Refusal) as refusal:
        transitions.promote_todo(Caller.operator(endpoint, "alice"), todo.pk)
    assert refusal.value.code == "not_claimable"
    assert TodoEvent.objects.count() == before


def test_only_pending_todos_are_promoted(endpoint, agent, make_todo):
    todo = make_todo(trust=Trust.UNVERIFIED)
    transitions.claim_todo(agent, todo.pk)
    with pytest.raises(Refusal) as refusal:
        transitions.promote_todo(Caller.operator(endpoint, "alice"), todo.pk)
    assert refusal.value.code == "not_claimable"
    assert Todo.objects.get(pk=todo.pk).trust == Trust.UNVERIFIED


def test_another_endpoints_todo_is_not_found(endpoint, make_todo):
    from tests.factories import EndpointFactory

    other = EndpointFactory(slug="other")
    todo = make_todo(trust=Trust.UNVERIFIED, on=other)
    with pytest.raises(Refusal) as refusal:
        transitions.promote_todo(Caller.operator(endpoint, "alice"), todo.pk)
    assert refusal.value.code == "not_found"


def test_the_board_button_and_the_admin_action_promote(client, operator, endpoint, make_todo):
    operator.is_staff = operator.is_superuser = True
    operator.save()
    client.force_login(operator)
    on_board = make_todo(trust=Trust.UNVERIFIED)
    page = client.get(f"/todos/{on_board.pk}/").content.decode()
    assert f"/todos/{on_board.pk}/promote" in page
    assert client.post(f"/todos/{on_board.pk}/promote").status_code == 302
    assert Todo.objects.get(pk=on_board.pk).trust == Trust.OPERATOR
    assert f"/todos/{on_board.pk}/promote" not in client.get(f"/todos/{on_board.pk}/").content.decode()

    in_admin = make_todo(trust=Trust.UNVERIFIED)
    client.post("/admin/todos/todo/", {"action": "promote", "_selected_action": [in_admin.pk]})
    assert Todo.objects.get(pk=in_admin.pk).trust == Trust.OPERATOR


# -- promote beside approve: the gate's yes and the trust are two decisions -------------------


def test_promote_beside_approve_raises_an_awaiting_todos_trust_and_keeps_it_gated(
        endpoint, make_todo, published, django_capture_on_commit_callbacks):
    gated = make_todo(trust=Trust.UNVERIFIED, requires_approval=True)
    alice = Caller.operator(endpoint, "alice")
    with django_capture_on_commit_callbacks(execute=True):
        promoted = transitions.promote_todo(alice, gated.pk)
    assert (promoted.trust, promoted.state) == (Trust.OPERATOR, State.AWAITING_APPROVAL)
    event = TodoEvent.objects.filter(todo=gated).latest("id")
    assert (event.action, event.from_state, event.to_state, event.detail) == (
        "promote", "awaiting_approval", "awaiting_approval", {"from_trust": "unverified"})
    assert ("promote", State.AWAITING_APPROVAL, State.AWAITING_APPROVAL) in EDGES
    # Still gated: approving is its own step, and keeps the trust promote gave it.
    assert transitions.approve_todo(alice, gated.pk).trust == Trust.OPERATOR


def test_the_board_offers_promote_beside_approve_labelled_as_a_trust_change(
        client, operator, endpoint, make_todo):
    client.force_login(operator)
    gated = make_todo(trust=Trust.UNVERIFIED, requires_approval=True)
    page = client.get(f"/todos/{gated.pk}/").content.decode()
    assert f"/todos/{gated.pk}/approve" in page and f"/todos/{gated.pk}/promote" in page
    assert ">promote trust</button>" in page and "trust unverified becomes operator" in page
    signed = make_todo(trust=Trust.SIGNED, requires_approval=True)
    assert f"/todos/{signed.pk}/promote" not in client.get(f"/todos/{signed.pk}/").content.decode()
    client.post(f"/todos/{gated.pk}/approve", {"next": "/todos/"})
    assert Todo.objects.get(pk=gated.pk).trust == Trust.UNVERIFIED


def test_bulk_promote_raises_only_the_selected_unverified_todos(client, operator, make_todo):
    client.force_login(operator)
    gated = make_todo(trust=Trust.UNVERIFIED, requires_approval=True)
    pending = make_todo(trust=Trust.UNVERIFIED)
    signed = make_todo(trust=Trust.SIGNED)
    left = make_todo(trust=Trust.UNVERIFIED)
    ids = [gated.pk, pending.pk, signed.pk]
    confirm = client.get("/todos/bulk/promote", {"ids": ids}).content.decode()
    assert "operator" in confirm
    client.post("/todos/bulk/promote", {"ids": ids, "next": "/todos/"})
    trust = dict(Todo.objects.values_list("pk", "trust"))
    assert (trust[gated.pk], trust[pending.pk], trust[signed.pk], trust[left.pk]) == (
        Trust.OPERATOR, Trust.OPERATOR, Trust.SIGNED, Trust.UNVERIFIED)
    assert Todo.objects.get(pk=gated.pk).state == State.AWAITING_APPROVAL
