"""Priority and scheduled todos at ingest (docs/work-control.md): routes, the operator's
hand-over, and POST /api/v1/todos/<id>/priority | run_now."""

import json
from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command
from django.utils import timezone

from ingest import transitions
from ingest.models import DeliveryEvent, Route
from tests.factories import EndpointFactory, UserFactory
from todos import transitions as todo_transitions
from todos.models import Todo, TodoEvent

from .test_views import bearer, deliver, hand

pytestmark = pytest.mark.django_db


@pytest.fixture
def token(operator):
    return transitions.mint_operator_token(user=operator, name="laptop")[1]


def written():
    return (Todo.objects.count(), TodoEvent.objects.count(), DeliveryEvent.objects.count())


# -- routes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("one_statement", [True, False])
def test_a_route_gives_its_todos_its_priority_and_delay(make_webhook, endpoint, other_endpoints,
                                                        one_statement):
    webhook = make_webhook("github", routes=[])
    transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="inbox", priority=40,
                                  delay_seconds=600)
    if not one_statement:  # two routes: the transaction path
        transitions.add_webhook_route(webhook=webhook, endpoint=other_endpoints[0], queue="inbox")
    before = timezone.now()
    answer = deliver(webhook)
    assert answer.status_code == 202, answer.content
    todo = Todo.objects.get(endpoint=endpoint)
    assert todo.priority == 40
    assert before + timedelta(seconds=600) <= todo.not_before <= timezone.now() + timedelta(
        seconds=600)
    if not one_statement:
        other = Todo.objects.get(endpoint=other_endpoints[0])
        assert (other.priority, other.not_before) == (0, None)


@pytest.mark.parametrize("values, field", [
    ({"priority": 101}, "priority"),
    ({"priority": -101}, "priority"),
    ({"delay_seconds": 31 * 86400}, "delay_seconds"),
])
def test_a_route_with_bad_work_control_values_is_refused_naming_the_field(make_webhook, endpoint,
                                                                         values, field):
    webhook = make_webhook("github", routes=[])
    with pytest.raises(ValidationError) as refused:
        transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="inbox", **values)
    assert field in refused.value.error_dict
    assert not Route.objects.exists()


def test_add_webhook_route_takes_priority_and_delay_seconds(make_webhook, endpoint, capsys):
    make_webhook("github", routes=[])
    call_command("add_webhook_route", "github-hook", endpoint.slug, "--queue", "inbox",
                 "--priority", "-10", "--delay-seconds", "300", "--json")
    out = json.loads(capsys.readouterr().out)
    assert out == {**out, "priority": -10, "delay_seconds": 300}
    route = Route.objects.get()
    assert (route.priority, route.delay_seconds) == (-10, 300)
    with pytest.raises(CommandError, match="priority"):
        call_command("add_webhook_route", "github-hook", endpoint.slug, "--queue", "other",
                     "--priority", "500")


# -- the hand-over -------------------------------------------------------------------------------


def test_the_hand_over_takes_priority_and_a_schedule(client, endpoint, token):
    at = (timezone.now() + timedelta(hours=3)).replace(microsecond=0)
    answer = hand(client, endpoint.slug, {"queue": "inbox", "title": "later", "priority": 9,
                                          "not_before": at.isoformat()}, **bearer(token))
    assert answer.status_code == 201, answer.content
    data = answer.json()["todo"]
    assert data["priority"] == 9 and data["not_before"] == at.isoformat().replace("+00:00", "Z")
    answer = hand(client, endpoint.slug, {"queue": "inbox", "title": "soon",
                                          "delay_seconds": 60}, **bearer(token))
    assert answer.status_code == 201 and answer.json()["todo"]["not_before"] is not None
    now = hand(client, endpoint.slug, {"queue": "inbox", "title": "now"}, **bearer(token))
    assert now.json()["todo"]["priority"] == 0 and now.json()["todo"]["not_before"] is None


def test_the_hand_over_gives_the_todo_its_own_max_cost_over_the_endpoints(client, endpoint, token):
    from decimal import Decimal

    from todos import transitions as todo_transitions

    endpoint.max_cost_usd = Decimal("100")
    endpoint.save()
    answer = hand(client, endpoint.slug, {"queue": "inbox", "title": "cheap", "max_cost_usd": 0.25},
                  **bearer(token))
    assert answer.status_code == 201, answer.content
    todo = Todo.objects.get(pk=answer.json()["todo"]["id"])
    assert todo.max_cost_usd == Decimal("0.25")
    agent = todo_transitions.Caller.agent(endpoint, "s-1")
    held = todo_transitions.claim_todo(agent, todo.pk)
    dead = todo_transitions.fail_todo(agent, todo.pk, lease_id=held.lease_id, error="x",
                                      usage_reported={"cost_usd": 0.3})
    assert dead.is_dead_letter  # 0.30 is past its own 0.25, not the endpoint's 100


NOW = timezone.now()


@pytest.mark.parametrize("fields, named", [
    ({"priority": 101}, "priority"),
    ({"priority": "high"}, "priority"),
    ({"priority": 2.5}, "priority"),
    ({"not_before": (NOW - timedelta(hours=1)).isoformat()}, "not_before"),
    ({"not_before": (NOW + timedelta(days=40)).isoformat()}, "not_before"),
    ({"not_before": "soon"}, "not_before"),
    ({"delay_seconds": -5}, "delay_seconds"),
    ({"delay_seconds": 60, "not_before": (NOW + timedelta(hours=1)).isoformat()}, "not_before"),
    ({"max_cost_usd": -1}, "max_cost_usd"),
    ({"max_cost_usd": 10001}, "max_cost_usd"),
    ({"max_cost_usd": "0.5"}, "max_cost_usd"),
    ({"max_cost_usd": 0.0000001}, "max_cost_usd"),
])
def test_a_bad_hand_over_schedule_or_priority_is_400_naming_the_field_and_writes_nothing(
        client, endpoint, token, fields, named):
    before = written()
    answer = hand(client, endpoint.slug, {"queue": "inbox", "title": "t", **fields},
                  **bearer(token))
    assert answer.status_code == 400, answer.content
    error = answer.json()["error"]
    assert error["code"] == "invalid_argument" and named in error["message"]
    assert written() == before


# -- POST /api/v1/todos/<id>/priority | run_now -------------------------------------------------


def act(client, todo_id, action, data=None, **meta):
    body = b"" if data is None else json.dumps(data).encode()
    return client.post(f"/api/v1/todos/{todo_id}/{action}", data=body,
                       content_type="application/json", **meta)


def test_the_operator_sets_a_todos_priority(client, endpoint, make_todo, token):
    todo = make_todo()
    answer = act(client, todo.pk, "priority", {"priority": 25}, **bearer(token))
    assert answer.status_code == 200, answer.content
    assert answer.json()["todo"]["priority"] == 25
    event = TodoEvent.objects.get(todo=todo, action="prioritize")
    assert event.actor == "alice" and event.detail == {"priority": 25}


@pytest.mark.parametrize("body", [{"priority": 101}, {"priority": None}, {}, {"priority": "1"},
                                  {"priority": 1, "extra": 2}])
def test_a_bad_priority_is_400_and_writes_nothing(client, make_todo, token, body):
    todo = make_todo()
    before = written()
    answer = act(client, todo.pk, "priority", body, **bearer(token))
    assert answer.status_code == 400, answer.content
    assert answer.json()["error"]["code"] == "invalid_argument"
    assert written() == before
    todo.refresh_from_db()
    assert todo.priority == 0


def test_priority_of_a_claimed_todo_is_409_not_claimable(client, agent, make_todo, token):
    todo = todo_transitions.claim_todo(agent, make_todo().pk)
    answer = act(client, todo.pk, "priority", {"priority": 5}, **bearer(token))
    assert answer.status_code == 409
    assert answer.json()["error"]["code"] == "not_claimable"


@pytest.mark.parametrize("spelling", ["run_now", "run-now"])
def test_run_now_clears_the_schedule(client, agent, make_todo, token, spelling):
    todo = make_todo(not_before=timezone.now() + timedelta(hours=5))
    answer = act(client, todo.pk, spelling, **bearer(token))
    assert answer.status_code == 200, answer.content
    assert answer.json()["todo"]["not_before"] is None
    assert todo_transitions.claim_next_todo(agent).pk == todo.pk
    again = act(client, todo.pk, spelling, **bearer(token))
    assert again.status_code == 409 and again.json()["error"]["code"] == "not_claimable"


def test_somebody_elses_todo_is_404_and_unauthenticated_is_401(client, make_todo, token):
    stranger = EndpointFactory(slug="theirs", owner=UserFactory(username="mallory"))
    theirs = make_todo(on=stranger, not_before=timezone.now() + timedelta(hours=1))
    before = written()
    assert act(client, theirs.pk, "run_now", **bearer(token)).status_code == 404
    assert act(client, theirs.pk, "priority", {"priority": 1}, **bearer(token)).status_code == 404
    assert act(client, 999999, "run_now", **bearer(token)).status_code == 404
    assert act(client, theirs.pk, "run_now").status_code == 401
    assert act(client, theirs.pk, "explode", **bearer(token)).status_code == 404
    assert written() == before
    theirs.refresh_from_db()
    assert theirs.not_before is not None
