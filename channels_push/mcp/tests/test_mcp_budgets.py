"""Usage and budgets over MCP (docs/reference.md#usage-and-budgets): complete and fail take a
``usage`` object (a bad one is invalid_argument naming the field), the todo carries its sums;
over a daily budget claim_next answers ``{"empty": true, "over_budget": true}`` and claim
refuses ``over_budget``; a raised budget sends one digest (reason ``budget``)."""

from decimal import Decimal

import jsonschema
import pytest

from channels_push.mcp import schemas as mcp_schemas
from channels_push.tests.conftest import make_ready_todo
from todos import transitions, usage
from todos.models import State, Todo

pytestmark = pytest.mark.django_db(transaction=True)


def spend_the_budget(endpoint, cost=1.0):
    todo = make_ready_todo(endpoint, title="spent")
    other = transitions.Caller.agent(endpoint, "another-session")
    held = transitions.claim_todo(other, todo.pk)
    transitions.complete_todo(other, held.pk, lease_id=held.lease_id,
                              usage_reported={"cost_usd": cost})


@pytest.fixture
def budgeted_agent(mcp):
    mcp.endpoint.budget_usd_per_day = Decimal("1")
    mcp.endpoint.save()
    mcp.initialize()
    return mcp


def test_complete_with_usage_answers_the_todo_with_its_sums(mcp):
    mcp.initialize()
    todo = make_ready_todo(mcp.endpoint)
    mcp.call("claim", {"todo_id": str(todo.pk)})
    result = mcp.call("complete", {"todo_id": str(todo.pk), "usage": {
        "input_tokens": 1200, "output_tokens": 340, "cost_usd": 0.0421, "turns": 2,
        "model": "claude-sonnet-4-5"}})["result"]
    assert result["isError"] is False
    assert result["structuredContent"]["todo"]["usage"] == {
        "input_tokens": 1200, "output_tokens": 340, "cost_usd": 0.0421, "turns": 2,
        "model": "claude-sonnet-4-5"}
    jsonschema.validate(result["structuredContent"], mcp_schemas.OUTPUT_SCHEMAS["complete"])


@pytest.mark.parametrize("bad,named", [
    ({"cost_usd": -1}, "usage.cost_usd"),
    ({"input_tokens": "12"}, "usage.input_tokens"),
    ({"cents": 5}, "usage"),
])
def test_a_bad_usage_is_invalid_argument_naming_the_field_and_the_lease_goes_on(mcp, bad, named):
    mcp.initialize()
    todo = make_ready_todo(mcp.endpoint)
    mcp.call("claim", {"todo_id": str(todo.pk)})
    result = mcp.call("fail", {"todo_id": str(todo.pk), "error": "x", "usage": bad})["result"]
    assert result["isError"] is True
    error = result["structuredContent"]["error"]
    assert error["code"] == "invalid_argument" and error["message"].startswith(named)
    assert Todo.objects.get(pk=todo.pk).state == State.CLAIMED


def test_over_budget_claim_next_is_empty_and_over_budget_and_claim_is_refused(budgeted_agent):
    spend_the_budget(budgeted_agent.endpoint)
    waiting_todo = make_ready_todo(budgeted_agent.endpoint)
    result = budgeted_agent.call("claim_next")["result"]
    assert result["isError"] is False
    assert result["structuredContent"] == {"empty": True, "over_budget": True}
    jsonschema.validate(result["structuredContent"], mcp_schemas.OUTPUT_SCHEMAS["claim_next"])
    refused = budgeted_agent.call("claim", {"todo_id": str(waiting_todo.pk)})["result"]
    assert refused["isError"] is True
    assert refused["structuredContent"]["error"]["code"] == "over_budget"
    jsonschema.validate(refused["structuredContent"], mcp_schemas.OUTPUT_SCHEMAS["claim"])
    assert Todo.objects.get(pk=waiting_todo.pk).state == State.PENDING


def test_raising_the_budget_above_the_days_spend_sends_one_digest(
        budgeted_agent, django_capture_on_commit_callbacks, monkeypatch):
    from channels_push.doorbells import doorbells

    spend_the_budget(budgeted_agent.endpoint)
    make_ready_todo(budgeted_agent.endpoint, title="waiting")
    sent = []
    monkeypatch.setattr(doorbells, "send_digest",
                        lambda endpoint, reason, now=None: sent.append(reason) or 1)
    endpoint = budgeted_agent.endpoint
    with django_capture_on_commit_callbacks(execute=True):
        usage.set_endpoint_budget(endpoint, actor="alice", budget_usd_per_day=Decimal("0.5"))
    assert sent == []  # lowered: still over
    with django_capture_on_commit_callbacks(execute=True):
        usage.set_endpoint_budget(endpoint, actor="alice", budget_usd_per_day=Decimal("2"))
    assert sent == ["budget"]
    with django_capture_on_commit_callbacks(execute=True):
        usage.set_endpoint_budget(endpoint, actor="alice", budget_usd_per_day=Decimal("3"))
    assert sent == ["budget"]  # it was not held: nothing new to announce
    result = budgeted_agent.call("claim_next")["result"]["structuredContent"]
    assert result["todo"]["title"] == "waiting"


def test_the_instructions_name_over_budget_only_for_a_budgeted_endpoint_and_still_fit(mcp):
    plain = mcp.initialize().json["result"]["instructions"]
    assert "over_budget" not in plain
    mcp.endpoint.budget_tokens_per_day = 10**6
    mcp.endpoint.queue_limits = {"deploys": 1}
    mcp.endpoint.save()
    budgeted = mcp.initialize().json["result"]["instructions"]
    assert "over_budget" in budgeted and len(budgeted) <= 2048
    assert "repeat their values." in budgeted  # not cut short


def test_a_long_poll_over_budget_waits_and_claims_once_the_budget_is_raised(budgeted_agent):
    """Over budget, claim_next with wait_seconds waits as at a cap (it does not answer at once);
    the raise lets its re-check claim the waiting todo before the deadline."""
    from channels.db import database_sync_to_async

    from channels_push.mcp.tests.test_mcp_long_poll import Call, claimed_id, run, waiting

    spend_the_budget(budgeted_agent.endpoint)
    waiting_todo = make_ready_todo(budgeted_agent.endpoint, title="held")

    async def scenario():
        call = await Call(budgeted_agent, {"wait_seconds": 30}).start()
        await waiting(budgeted_agent.endpoint.pk)
        await database_sync_to_async(usage.set_endpoint_budget)(
            budgeted_agent.endpoint, actor="alice", budget_usd_per_day=Decimal("10"))
        await call.response(timeout=30)
        return call

    call = run(scenario)
    assert claimed_id(call.result()) == str(waiting_todo.pk)


def test_a_complete_repeated_with_usage_after_the_agents_own_records_it_and_says_so(mcp):
    """What the runner sends after an agent settled its own todo: ``complete`` with only the
    todo, its lease and the run's usage. The answer is the refusal a repeat always got, with
    ``usage_recorded``; the todo's sums take the usage once."""
    mcp.initialize()
    todo = make_ready_todo(mcp.endpoint)
    lease_id = mcp.call("claim", {"todo_id": str(todo.pk)})["result"]["structuredContent"][
        "todo"]["lease_id"]
    assert mcp.call("complete", {"todo_id": str(todo.pk), "lease_id": lease_id,
                                 "result": {"summary": "done"}})["result"]["isError"] is False
    report = {"todo_id": str(todo.pk), "lease_id": lease_id,
              "usage": {"input_tokens": 10, "output_tokens": 4, "cost_usd": 0.01}}
    for recorded in (True, False):
        result = mcp.call("complete", report)["result"]
        assert result["isError"] is True
        error = result["structuredContent"]["error"]
        assert (error["code"], error["usage_recorded"]) == ("already_done", recorded)
        jsonschema.validate(result["structuredContent"], mcp_schemas.OUTPUT_SCHEMAS["complete"])
    row = Todo.objects.get(pk=todo.pk)
    assert (row.state, row.result, row.usage_reports) == (State.DONE, {"summary": "done"}, 1)
    assert usage.todo_usage(row)["cost_usd"] == 0.01
