"""The approval gate at ingest (routes, the hand-over) and the operator API's cancel, approve
and reject: POST /api/v1/todos/<id>/<action>."""

import json

import pytest
from django.core.management import call_command

from ingest import sweeps, transitions
from ingest.models import OperatorSecret, Route
from tests.factories import EndpointFactory, UserFactory
from todos import transitions as todo_transitions
from todos.models import State, Todo, TodoEvent

from .test_views import ISSUE, bearer, deliver, hand

pytestmark = pytest.mark.django_db


@pytest.fixture
def token(operator):
    return transitions.mint_operator_token(user=operator, name="laptop")[1]


def act(client, todo_id, action, data=None, **meta):
    body = b"" if data is None else json.dumps(data).encode()
    return client.post(f"/api/v1/todos/{todo_id}/{action}", data=body,
                       content_type="application/json", **meta)


# -- the gate at ingest --------------------------------------------------------------------------


@pytest.mark.parametrize("routes", [1, 2], ids=["one route (one statement)", "two routes"])
def test_a_route_that_requires_approval_creates_todos_awaiting_it(
        make_webhook, endpoint, operator, routes):
    webhook = make_webhook("github", routes=[])
    transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="inbox",
                                  requires_approval=True)
    if routes == 2:
        transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="other")
    answer = deliver(webhook, ISSUE, delivery="d-1")
    assert answer.status_code == 202, answer.content
    states = dict(Todo.objects.values_list("queue", "state"))
    assert states["inbox"] == State.AWAITING_APPROVAL
    if routes == 2:
        assert states["other"] == State.PENDING
    gated = Todo.objects.get(queue="inbox")
    assert TodoEvent.objects.get(todo=gated).to_state == "awaiting_approval"
    # A redelivery while it waits collapses onto it (the key is live).
    assert deliver(webhook, ISSUE, delivery="d-1").status_code in (200, 202)
    assert Todo.objects.filter(queue="inbox").count() == 1


def test_the_route_command_sets_requires_approval_and_says_so(make_webhook, endpoint, capsys):
    webhook = make_webhook("github", routes=[])
    call_command("add_webhook_route", webhook.slug, endpoint.slug, "--queue", "gated",
                 "--requires-approval", "--json")
    printed = json.loads(capsys.readouterr().out)
    assert printed == {"webhook": webhook.slug, "endpoint": endpoint.slug, "queue": "gated",
                       "priority": 0, "delay_seconds": 0, "requires_approval": True,
                       "write_back": "status", "agent_permissions": {},
                       "follow_ups": "coalesce", "thread_key": "",
                       "stop": ["issues.closed", "pull_request.closed"]}
    assert Route.objects.get(queue="gated").requires_approval is True


def test_a_hand_over_may_require_approval(client, endpoint, token):
    answer = hand(client, endpoint.slug, {"queue": "inbox", "title": "deploy prod",
                                          "requires_approval": True}, **bearer(token))
    assert answer.status_code == 201, answer.content
    assert answer.json()["todo"]["state"] == "awaiting_approval"


def test_a_hand_over_with_a_non_boolean_requires_approval_is_refused(client, endpoint, token):
    answer = hand(client, endpoint.slug, {"queue": "inbox", "title": "t",
                                          "requires_approval": "yes"}, **bearer(token))
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "invalid_argument"
    assert "requires_approval" in answer.json()["error"]["message"]
    assert Todo.objects.count() == 0


# -- the operator API ----------------------------------------------------------------------------


def test_approve_then_cancel_over_the_api(client, endpoint, token, make_todo):
    gated = make_todo(requires_approval=True)
    answer = act(client, gated.pk, "approve", **bearer(token))
    assert answer.status_code == 200, answer.content
    assert answer.json()["todo"]["state"] == "pending"
    answer = act(client, gated.pk, "cancel", {"reason": "superseded"}, **bearer(token))
    assert answer.status_code == 200
    todo = answer.json()["todo"]
    assert todo["state"] == "cancelled" and todo["cancelled_at"] is not None
    assert TodoEvent.objects.filter(todo=gated).latest("id").detail == {"reason": "superseded"}


def test_promote_over_the_api_is_apart_from_approve(client, endpoint, token, make_todo):
    gated = make_todo(requires_approval=True, trust="unverified")
    approved = act(client, gated.pk, "approve", **bearer(token))
    assert approved.status_code == 200
    assert approved.json()["todo"]["trust"] == "unverified"
    promoted = act(client, gated.pk, "promote", **bearer(token))
    assert promoted.status_code == 200, promoted.content
    assert (promoted.json()["todo"]["trust"], promoted.json()["todo"]["state"]) == (
        "operator", "pending")
    again = act(client, gated.pk, "promote", **bearer(token))
    assert again.status_code == 409 and again.json()["error"]["code"] == "not_claimable"


def test_reject_over_the_api(client, endpoint, token, make_todo):
    gated = make_todo(requires_approval=True)
    answer = act(client, gated.pk, "reject", {"reason": "no"}, **bearer(token))
    assert answer.status_code == 200 and answer.json()["todo"]["state"] == "cancelled"
    assert TodoEvent.objects.filter(todo=gated).latest("id").action == "reject"


@pytest.mark.parametrize("action, setup, status, code", [
    ("approve", "pending", 409, "not_claimable"),
    ("reject", "pending", 409, "not_claimable"),
    ("cancel", "done", 409, "not_claimable"),
    ("cancel", "cancelled", 409, "not_claimable"),
])
def test_the_wrong_state_is_a_409_naming_the_todo_and_writes_nothing(
        client, endpoint, agent, token, make_todo, action, setup, status, code):
    todo = make_todo()
    if setup == "done":
        todo_transitions.claim_todo(agent, todo.pk)
        todo_transitions.complete_todo(agent, todo.pk)
    if setup == "cancelled":
        todo_transitions.cancel_todo(todo_transitions.Caller.operator(endpoint, "alice"), todo.pk)
    before = TodoEvent.objects.count()
    answer = act(client, todo.pk, action, **bearer(token))
    assert answer.status_code == status
    assert answer.json()["error"]["code"] == code
    assert answer.json()["error"]["message"].startswith(f"todo {todo.pk} is {setup}; ")
    assert TodoEvent.objects.count() == before


def test_bad_bodies_unknown_and_foreign_todos(client, endpoint, token, make_todo):
    todo = make_todo(requires_approval=True)
    other = EndpointFactory(slug="theirs", owner=UserFactory(username="bob"))
    foreign, _ = todo_transitions.create_todo(endpoint=other, queue="inbox", title="t",
                                              actor="t", requires_approval=True)
    for todo_id in (foreign.pk, 999_999, "abc"):
        answer = act(client, todo_id, "approve", **bearer(token))
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"
    cases = [({"reason": 7}, "reason must be a string"),
             ({"reason": "a\u0000b"}, "reason contains"),
             ({"why": "x"}, "unknown fields: ['why']")]
    for data, message in cases:
        answer = act(client, todo.pk, "reject", data, **bearer(token))
        assert answer.status_code == 400, answer.content
        assert answer.json()["error"]["code"] == "invalid_argument"
        assert message in answer.json()["error"]["message"]
    assert act(client, todo.pk, "approve", {"reason": "x"}, **bearer(token)).status_code == 400
    assert act(client, todo.pk, "approve").status_code == 401
    assert client.get(f"/api/v1/todos/{todo.pk}/approve", **bearer(token)).status_code == 405
    assert act(client, todo.pk, "explode", **bearer(token)).status_code == 404
    assert Todo.objects.get(pk=todo.pk).state == State.AWAITING_APPROVAL
    assert TodoEvent.objects.filter(todo__in=[todo, foreign]).count() == 2


# -- cancel deletes the todo's secrets -----------------------------------------------------------


@pytest.mark.parametrize("state", ["awaiting_approval", "pending", "claimed"])
def test_cancel_and_reject_delete_the_todos_operator_secrets(client, endpoint, agent, token,
                                                             state):
    answer = hand(client, endpoint.slug, {
        "queue": "inbox", "title": "deploy", "secrets": {"deploy_token": "tok-123"},
        "requires_approval": state == "awaiting_approval"}, **bearer(token))
    todo_id = answer.json()["todo"]["id"]
    kept = hand(client, endpoint.slug, {"queue": "inbox", "title": "other",
                                        "secrets": {"k": "v"}}, **bearer(token))
    if state == "claimed":
        todo_transitions.claim_todo(agent, todo_id)
    assert OperatorSecret.objects.filter(todo_id=todo_id).count() == 1
    verb = "reject" if state == "awaiting_approval" else "cancel"
    assert act(client, todo_id, verb, **bearer(token)).status_code == 200
    assert sweeps.delete_secrets_of_ended_todos() == 1
    assert OperatorSecret.objects.filter(todo_id=todo_id).count() == 0
    assert OperatorSecret.objects.filter(todo_id=kept.json()["todo"]["id"]).count() == 1


# -- manage.py cancel / approve / reject ---------------------------------------------------------


def run(capsys, *args):
    """(exit code, the JSON printed, stderr) of one command."""
    from django.core.management.base import CommandError

    code = 0
    try:
        call_command(*args, "--json")
    except CommandError:
        code = 1
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if captured.out else None, captured.err


def test_the_promote_command_raises_trust_and_approve_keeps_it(capsys, make_todo):
    gated = make_todo(requires_approval=True, trust="unverified")
    signed = make_todo(trust="signed")
    assert run(capsys, "approve", str(gated.pk))[0] == 0
    assert Todo.objects.get(pk=gated.pk).trust == "unverified"
    code, printed, _ = run(capsys, "promote", str(gated.pk), str(signed.pk))
    assert (code, printed) == (1, {"promoted": [str(gated.pk)], "skipped": [
        {"id": str(signed.pk), "code": "not_claimable"}]})
    assert Todo.objects.get(pk=gated.pk).trust == "operator"


def test_the_commands_act_by_id_and_report_what_they_skipped(capsys, make_todo, agent):
    first, second = make_todo(requires_approval=True), make_todo(requires_approval=True)
    pending = make_todo()
    code, printed, _ = run(capsys, "approve", str(first.pk), str(pending.pk), "424242")
    assert code == 1
    assert printed == {"approved": [str(first.pk)], "skipped": [
        {"id": str(pending.pk), "code": "not_claimable"},
        {"id": "424242", "code": "not_found"}]}
    code, printed, _ = run(capsys, "reject", str(second.pk), "--reason", "not now")
    assert (code, printed) == (0, {"rejected": [str(second.pk)], "skipped": []})
    assert TodoEvent.objects.filter(todo=second).latest("id").detail == {"reason": "not now"}
    code, printed, _ = run(capsys, "cancel", str(first.pk), str(pending.pk))
    assert (code, printed) == (0, {"cancelled": [str(first.pk), str(pending.pk)], "skipped": []})
    assert set(Todo.objects.values_list("state", flat=True)) == {"cancelled"}
    assert TodoEvent.objects.filter(action="cancel").first().actor == "manage.py cancel"


def test_the_commands_refuse_ids_that_are_not_ids_and_write_nothing(capsys, make_todo):
    todo = make_todo()
    before = TodoEvent.objects.count()
    code, printed, err = run(capsys, "cancel", str(todo.pk), "x1")
    assert (code, printed) == (1, None)
    assert TodoEvent.objects.count() == before
