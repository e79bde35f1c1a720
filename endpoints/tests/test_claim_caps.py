"""Setting concurrency caps (docs/work-control.md#caps): set_claim_caps, ``manage.py limit``,
``vend_endpoint --max-claimed``; bad caps name their field and write nothing."""

import pytest
from django.core.exceptions import ValidationError

from endpoints import transitions
from endpoints.models import Endpoint, EndpointEvent
from tests.cli import run_manage
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def endpoint(operator):
    return EndpointFactory(slug="agent", owner=operator, scope=["inbox", "deploys"])


def test_set_claim_caps_records_one_event_and_merges_queue_limits(endpoint):
    transitions.set_claim_caps(endpoint, max_claimed=3, queue_limits={"deploys": 1},
                               actor="alice")
    transitions.set_claim_caps(endpoint, queue_limits={"inbox": 2}, actor="alice")
    transitions.set_claim_caps(endpoint, queue_limits={"inbox": 2}, actor="alice")  # no change
    row = Endpoint.objects.get(pk=endpoint.pk)
    assert (row.max_claimed, row.queue_limits) == (3, {"deploys": 1, "inbox": 2})
    events = EndpointEvent.objects.filter(endpoint=endpoint, action="limit")
    assert events.count() == 2
    transitions.set_claim_caps(endpoint, max_claimed=None, queue_limits={"deploys": None},
                               actor="alice")
    row.refresh_from_db()
    assert (row.max_claimed, row.queue_limits) == (None, {"inbox": 2})


@pytest.mark.parametrize("kwargs,field", [
    ({"max_claimed": -1}, "max_claimed"),
    ({"queue_limits": {"deploys": -1}}, "queue_limits"),
    ({"queue_limits": {"elsewhere": 1}}, "queue_limits"),  # outside the scope
    ({"queue_limits": {"no spaces": 1}}, "queue_limits"),
])
def test_a_bad_cap_names_its_field_and_writes_nothing(endpoint, kwargs, field):
    with pytest.raises(ValidationError) as refused:
        transitions.set_claim_caps(endpoint, actor="alice", **kwargs)
    assert field in refused.value.message_dict
    row = Endpoint.objects.get(pk=endpoint.pk)
    assert (row.max_claimed, row.queue_limits) == (None, {})
    assert not EndpointEvent.objects.filter(endpoint=endpoint).exists()


def test_limit_command_contract_form_and_flag_form(capsys, endpoint):
    run = run_manage(capsys, "limit", "agent", "3", "--json")
    assert run.code == 0, run.err
    assert run.json() == {"endpoint": "agent", "max_claimed": 3, "queue_limits": {}}
    run = run_manage(capsys, "limit", "agent", "--queue", "deploys", "1", "--json")
    assert run.json() == {"endpoint": "agent", "max_claimed": 3, "queue_limits": {"deploys": 1}}
    run = run_manage(capsys, "limit", "agent", "--max-claimed", "none", "--queue", "inbox=2",
                     "--queue", "deploys=none", "--json")
    assert run.json() == {"endpoint": "agent", "max_claimed": None, "queue_limits": {"inbox": 2}}
    run = run_manage(capsys, "limit", "agent", "--json")  # no cap given: prints them
    assert run.json() == {"endpoint": "agent", "max_claimed": None, "queue_limits": {"inbox": 2}}


@pytest.mark.parametrize("argv,field", [
    (["-1"], "max_claimed"),
    (["--max-claimed", "-4"], "max_claimed"),
    (["--max-claimed", "many"], "max_claimed"),
    (["--queue", "deploys=-1"], "queue_limits"),
    (["--queue", "deploys", "-1"], "queue_limits"),
])
def test_limit_command_refuses_a_bad_cap_naming_the_field(capsys, endpoint, argv, field):
    run = run_manage(capsys, "limit", "agent", *argv)
    assert run.code != 0 and field in run.err
    row = Endpoint.objects.get(pk=endpoint.pk)
    assert (row.max_claimed, row.queue_limits) == (None, {})


def test_limit_command_names_an_unknown_endpoint(capsys, endpoint):
    run = run_manage(capsys, "limit", "nobody", "3")
    assert run.code != 0 and "nobody" in run.err


def test_vend_endpoint_max_claimed(capsys, operator):
    run = run_manage(capsys, "vend_endpoint", "capped", "--owner", operator.username,
                     "--max-claimed", "2", "--json")
    assert run.code == 0, run.err
    assert run.json()["max_claimed"] == 2
    assert Endpoint.objects.get(slug="capped").max_claimed == 2
    run = run_manage(capsys, "vend_endpoint", "negative", "--owner", operator.username,
                     "--max-claimed", "-2")
    assert run.code != 0 and "max_claimed" in run.err
    assert not Endpoint.objects.filter(slug="negative").exists()
