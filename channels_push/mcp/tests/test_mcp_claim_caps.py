"""Concurrency caps over MCP (docs/work-control.md#caps): claim_next answers
``{"empty": true, "at_capacity": true}`` (and a long poll waits for a slot), claim refuses
``at_capacity``; the instructions and schemas say so."""

import time

import jsonschema
import pytest
from channels.db import database_sync_to_async

from channels_push.mcp import schemas as mcp_schemas
from channels_push.tests.conftest import make_ready_todo
from channels_push.mcp.tests.test_mcp_long_poll import Call, claimed_id, run, waiting
from todos import transitions
from todos.models import State, Todo

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def capped_agent(mcp):
    mcp.endpoint.max_claimed = 1
    mcp.endpoint.save()
    mcp.initialize()
    return mcp


def hold_the_only_slot(endpoint):
    todo = make_ready_todo(endpoint, title="held")
    other = transitions.Caller.agent(endpoint, "another-session")
    return transitions.claim_todo(other, todo.pk), other


def test_claim_next_at_the_cap_answers_empty_and_at_capacity(capped_agent):
    hold_the_only_slot(capped_agent.endpoint)
    waiting_todo = make_ready_todo(capped_agent.endpoint)
    result = capped_agent.call("claim_next")["result"]
    assert result["isError"] is False
    assert result["structuredContent"] == {"empty": True, "at_capacity": True}
    jsonschema.validate(result["structuredContent"], mcp_schemas.OUTPUT_SCHEMAS["claim_next"])
    assert Todo.objects.get(pk=waiting_todo.pk).state == State.PENDING


def test_claim_by_id_at_the_cap_is_refused_at_capacity(capped_agent):
    hold_the_only_slot(capped_agent.endpoint)
    waiting_todo = make_ready_todo(capped_agent.endpoint)
    result = capped_agent.call("claim", {"todo_id": str(waiting_todo.pk)})["result"]
    assert result["isError"] is True
    assert result["structuredContent"]["error"]["code"] == "at_capacity"
    jsonschema.validate(result["structuredContent"], mcp_schemas.OUTPUT_SCHEMAS["claim"])


def test_the_instructions_name_at_capacity_only_for_a_capped_endpoint(mcp):
    plain = mcp.initialize().json["result"]["instructions"]
    assert "at_capacity" not in plain
    mcp.endpoint.queue_limits = {"deploys": 1}
    mcp.endpoint.save()
    capped = mcp.initialize().json["result"]["instructions"]
    assert '"at_capacity": true' in capped and len(capped) <= 2048
    assert "repeat their values." in capped  # not cut short


@pytest.mark.parametrize("settle", ["complete", "fail"])
def test_a_long_poll_at_capacity_is_woken_when_a_claim_settles(capped_agent, settle):
    held, other = hold_the_only_slot(capped_agent.endpoint)
    waiting_todo = make_ready_todo(capped_agent.endpoint)

    def settle_it():
        if settle == "complete":
            transitions.complete_todo(other, held.pk)
        else:
            transitions.fail_todo(other, held.pk, error="boom")

    async def scenario():
        call = await Call(capped_agent, {"wait_seconds": 60}).start()
        await waiting(capped_agent.endpoint.pk)
        settled_at = time.monotonic()
        await database_sync_to_async(settle_it)()
        await call.response()
        return call, call.chunks[-1][0] - settled_at

    call, latency = run(scenario)
    assert claimed_id(call.result()) == str(waiting_todo.pk)
    assert latency < 30  # woken by the settling claim, not by the 60 s deadline
