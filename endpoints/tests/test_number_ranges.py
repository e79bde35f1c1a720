"""Every number an operator sets on an endpoint has a documented range
(docs/reference.md#number-ranges), checked where it comes in — the model, the commands, the
endpoint page, admin — so that no stored value breaks a later request: a queue cap of three
billion was accepted and then every claim_next of the endpoint was a 500."""

import pytest
from django.core.exceptions import ValidationError
from django.test import Client

from channels_push.mcp import tools as mcp_tools
from endpoints import transitions
from endpoints.models import (MAX_APPROVAL_TIMEOUT_SECONDS, MAX_ATTEMPTS_LIMIT, MAX_CLAIM_CAP,
                              Endpoint)
from tests.cli import run_manage
from todos import transitions as todo_transitions

pytestmark = pytest.mark.django_db

HUGE = 3_000_000_000


@pytest.fixture
def endpoint(operator):
    from tests.factories import EndpointFactory

    return EndpointFactory(slug="agent", owner=operator)


def claim_next(endpoint):
    result = mcp_tools.call_tool(endpoint=endpoint, session_id="session-a",
                                 params={"name": "claim_next", "arguments": {}})
    return result.is_error, result.structured_content


def unchanged(endpoint):
    row = Endpoint.objects.get(pk=endpoint.pk)
    return (row.max_claimed, row.queue_limits, row.max_attempts) == (None, {}, 5)


@pytest.mark.parametrize("caps, field", [
    ({"max_claimed": HUGE}, "max_claimed"),
    ({"max_claimed": MAX_CLAIM_CAP + 1}, "max_claimed"),
    ({"queue_limits": {"inbox": HUGE}}, "queue_limits"),
    ({"queue_limits": {"inbox": MAX_CLAIM_CAP + 1}}, "queue_limits"),
])
def test_a_cap_past_its_range_is_refused_and_claim_next_keeps_working(endpoint, make_todo,
                                                                       caps, field):
    todo = make_todo()
    with pytest.raises(ValidationError) as refused:
        transitions.set_claim_caps(endpoint, actor="alice", **caps)
    assert field in refused.value.message_dict
    assert str(MAX_CLAIM_CAP) in " ".join(refused.value.message_dict[field])
    assert unchanged(endpoint)
    endpoint.refresh_from_db()
    is_error, answer = claim_next(endpoint)
    assert not is_error and answer["todo"]["id"] == str(todo.pk)


def test_the_largest_cap_is_taken_and_claims_under_it(endpoint, make_todo):
    todo = make_todo()
    transitions.set_claim_caps(endpoint, actor="alice", max_claimed=MAX_CLAIM_CAP,
                               queue_limits={"inbox": MAX_CLAIM_CAP})
    endpoint.refresh_from_db()
    is_error, answer = claim_next(endpoint)
    assert not is_error and answer["todo"]["id"] == str(todo.pk)


@pytest.mark.parametrize("argv, field", [
    (["limit", "agent", str(HUGE)], "max_claimed"),
    (["limit", "agent", "--max-claimed", str(HUGE)], "max_claimed"),
    (["limit", "agent", "--queue", "inbox", str(HUGE)], "queue_limits"),
    (["limit", "agent", "--queue", f"inbox={HUGE}"], "queue_limits"),
])
def test_the_limit_command_refuses_a_huge_cap_naming_the_field(capsys, endpoint, argv, field):
    run = run_manage(capsys, *argv)
    assert run.code == 1 and field in run.err and "Traceback" not in run.err, run.err
    assert unchanged(endpoint)


@pytest.mark.parametrize("flag, value, field", [
    ("--max-claimed", HUGE, "max_claimed"),
    ("--max-attempts", MAX_ATTEMPTS_LIMIT + 1, "max_attempts"),
    ("--max-attempts", 40_000, "max_attempts"),
    ("--lease-seconds", HUGE, "default_lease_seconds"),
])
def test_vend_endpoint_refuses_a_number_past_its_range(capsys, operator, flag, value, field):
    run = run_manage(capsys, "vend_endpoint", "big", "--owner", operator.username,
                     flag, str(value))
    assert run.code == 1 and field in run.err and "Traceback" not in run.err, run.err
    assert not Endpoint.objects.filter(slug="big").exists()


@pytest.mark.parametrize("grace", ["-1", str(HUGE * 1000), str(30 * 86400 + 1)])
def test_rotate_credential_refuses_a_grace_past_a_month(capsys, endpoint, grace):
    credentials = list(endpoint.credentials.values_list("pk", "expires_at"))
    run = run_manage(capsys, "rotate_credential", "agent", "--grace-seconds", grace)
    assert run.code == 1 and "--grace-seconds" in run.err and "Traceback" not in run.err, run.err
    assert list(endpoint.credentials.values_list("pk", "expires_at")) == credentials


@pytest.mark.parametrize("values, field", [
    ({"approval_timeout_seconds": MAX_APPROVAL_TIMEOUT_SECONDS + 1}, "approval_timeout_seconds"),
    ({"approval_timeout_seconds": HUGE}, "approval_timeout_seconds"),
    ({"max_attempts": MAX_ATTEMPTS_LIMIT + 1}, "max_attempts"),
    ({"max_claimed": HUGE}, "max_claimed"),
    ({"queue_limits": {"inbox": HUGE}}, "queue_limits"),
])
def test_the_model_refuses_each_number_past_its_range(endpoint, values, field):
    for name, value in values.items():
        setattr(endpoint, name, value)
    with pytest.raises(ValidationError) as refused:
        endpoint.full_clean()
    assert field in refused.value.message_dict


@pytest.mark.parametrize("form, field", [
    ({"max_claimed": str(HUGE), "queue_limits": ""}, "max_claimed"),
    ({"max_claimed": "", "queue_limits": f"inbox={HUGE}"}, "queue_limits"),
])
def test_the_endpoint_pages_caps_form_refuses_a_huge_cap(operator, endpoint, form, field):
    client = Client()
    client.force_login(operator)
    answer = client.post("/todos/endpoints/agent/limits", form)
    assert answer.status_code == 400 and field in answer.content.decode()
    assert unchanged(endpoint)


@pytest.mark.parametrize("field, value", [
    ("max_claimed", str(HUGE)),
    ("queue_limits", f'{{"inbox": {HUGE}}}'),
    ("approval_timeout_seconds", str(HUGE)),
    ("max_attempts", str(MAX_ATTEMPTS_LIMIT + 1)),
])
def test_admin_refuses_a_number_past_its_range_as_a_form_error(operator, endpoint, field, value):
    from endpoints.models import AGENT_VERBS
    from tests.factories import UserFactory

    client = Client()
    client.force_login(UserFactory(username="root", is_superuser=True, is_staff=True))
    form = {"slug": "agent", "owner": operator.pk, "scope": "*", "verbs": list(AGENT_VERBS),
            "max_attempts": "5", "active": "on",
            "credentials-TOTAL_FORMS": "0", "credentials-INITIAL_FORMS": "0", field: value}
    answer = client.post(f"/admin/endpoints/endpoint/{endpoint.pk}/change/", form)
    assert answer.status_code == 200 and b"errornote" in answer.content
    assert field in answer.context["adminform"].form.errors
    assert unchanged(endpoint)


def test_priority_and_leases_keep_their_ranges_on_the_agents_and_operators_edges(endpoint,
                                                                                 make_todo):
    todo = make_todo()
    alice = todo_transitions.Caller.operator(endpoint, "alice")
    for bad in (HUGE, 101, -101, 1.5, float("nan")):
        with pytest.raises(todo_transitions.Refusal) as refused:
            todo_transitions.set_priority_todo(alice, todo.pk, bad)
        assert refused.value.code == "invalid_argument" and "priority" in refused.value.message
    result = mcp_tools.call_tool(endpoint=endpoint, session_id="session-a", params={
        "name": "claim", "arguments": {"todo_id": str(todo.pk), "lease_ttl_seconds": HUGE}})
    assert result.is_error
    assert result.structured_content["error"]["code"] == "invalid_argument"
    assert "lease_ttl_seconds" in result.structured_content["error"]["message"]
