"""POST /api/v1/todos/<id>/cancel with {"request": true}: an operator asks a held todo's agent to
stop instead of overriding its lease (docs/reference.md#the-operator-api)."""

import pytest

from todos import transitions as todo_transitions
from todos.models import State, Todo, TodoEvent

from .test_cancel_approval import act, token  # noqa: F401 (token is a fixture)
from .test_views import bearer

pytestmark = pytest.mark.django_db


def test_a_request_leaves_the_todo_claimed_and_tells_its_holder(client, endpoint, agent, token,
                                                              make_todo):
    held = todo_transitions.claim_todo(agent, make_todo().pk)
    answer = act(client, held.pk, "cancel", {"request": True, "reason": "wrong repo"},
                 **bearer(token))
    assert answer.status_code == 200, answer.content
    todo = answer.json()["todo"]
    assert todo["state"] == "claimed" and todo["cancel_requested"] is True
    event = TodoEvent.objects.filter(todo_id=held.pk).latest("id")
    assert (event.action, event.detail) == ("cancel_request", {"reason": "wrong repo"})
    beat = todo_transitions.heartbeat_todo(agent, held.pk)
    assert beat.cancel_requested_at is not None and beat.lease_id == held.lease_id
    # Asked again: the same answer, nothing recorded twice.
    assert act(client, held.pk, "cancel", {"request": True}, **bearer(token)).status_code == 200
    assert TodoEvent.objects.filter(todo_id=held.pk, action="cancel_request").count() == 1


def test_a_request_for_a_todo_nobody_holds_is_refused_and_changes_nothing(client, token,
                                                                         make_todo):
    waiting = make_todo()
    answer = act(client, waiting.pk, "cancel", {"request": True}, **bearer(token))
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "not_claimable"
    assert Todo.objects.get(pk=waiting.pk).state == State.PENDING
    bad = act(client, waiting.pk, "cancel", {"request": "yes"}, **bearer(token))
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_argument"


def test_without_request_it_stays_the_override(client, agent, token, make_todo):
    held = todo_transitions.claim_todo(agent, make_todo().pk)
    answer = act(client, held.pk, "cancel", {"request": False}, **bearer(token))
    assert answer.status_code == 200 and answer.json()["todo"]["state"] == "cancelled"
