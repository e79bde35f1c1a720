"""What an agent sees of the approval gate and of cancelled todos over MCP."""

import json
from datetime import timedelta

import jsonschema
import pytest
from django.utils import timezone

from channels_push.mcp import instructions as mcp_instructions
from channels_push.mcp import schemas as mcp_schemas
from channels_push.mcp import tools as mcp_tools
from todos import transitions

pytestmark = pytest.mark.django_db


def call(endpoint, name, arguments=None, session="session-a"):
    result = mcp_tools.call_tool(endpoint=endpoint, session_id=session,
                                 params={"name": name, "arguments": arguments or {}})
    assert json.loads(result.content[0].text) == result.structured_content
    schema = {tool.name: tool for tool in mcp_schemas.tools_for(endpoint)}[name].output_schema
    jsonschema.Draft202012Validator(schema).validate(result.structured_content)
    return result.is_error, result.structured_content


def test_a_todo_awaiting_approval_is_refused_unlisted_and_skipped_until_approved(endpoint,
                                                                                make_todo):
    gated = make_todo(requires_approval=True)
    assert call(endpoint, "claim", {"todo_id": str(gated.pk)}) == (True, {"error": {
        "code": "awaiting_approval", "message": f"todo {gated.pk} waits for its operator's "
        "approval; it cannot be claimed until it is approved"}})
    assert call(endpoint, "claim_next") == (False, {"empty": True})
    assert call(endpoint, "list_todos")[1]["todos"] == []
    transitions.approve_todo(transitions.Caller.operator(endpoint, "alice"), gated.pk)
    _, claimed = call(endpoint, "claim_next")
    assert claimed["todo"]["id"] == str(gated.pk)


def test_list_todos_never_shows_a_gated_todo_whatever_the_filter(endpoint, make_todo):
    gated = make_todo(requires_approval=True, title="gated text")
    scheduled_gated = make_todo(requires_approval=True, not_before=timezone.now()
                                + timedelta(hours=1), title="gated and scheduled")
    rejected = make_todo(requires_approval=True, title="rejected text")
    timed_out = make_todo(requires_approval=True, title="cancelled unapproved")
    alice = transitions.Caller.operator(endpoint, "alice")
    transitions.reject_todo(alice, rejected.pk)
    transitions.cancel_todo(alice, timed_out.pk)
    approved_then_cancelled = make_todo(requires_approval=True, title="said yes")
    transitions.approve_todo(alice, approved_then_cancelled.pk)
    transitions.cancel_todo(alice, approved_then_cancelled.pk)
    hidden = {str(gated.pk), str(scheduled_gated.pk), str(rejected.pk), str(timed_out.pk)}
    shown = set()
    for arguments in ({}, {"queue": "inbox"}, {"scheduled": True}, {"scheduled": False},
                      *({"state": state} for state in ("pending", "claimed", "done", "failed",
                                                       "cancelled"))):
        is_error, listed = call(endpoint, "list_todos", arguments)
        assert not is_error, arguments
        shown |= {todo["id"] for todo in listed["todos"]}
        assert not hidden & shown, arguments
    assert shown == {str(approved_then_cancelled.pk)}
    # Asking for the gated state by name is a refusal that says why, not an empty page.
    is_error, refused = call(endpoint, "list_todos", {"state": "awaiting_approval"})
    assert is_error and refused["error"]["code"] == "invalid_argument"
    assert "state" in refused["error"]["message"]
    assert "awaiting_approval" not in {tool.name: tool for tool in mcp_schemas.tools_for(
        endpoint)}["list_todos"].input_schema["properties"]["state"]["enum"]


def test_a_cancelled_todo_shows_cancelled_at_and_its_holder_gets_lease_lost(endpoint, make_todo):
    todo = make_todo()
    _, claimed = call(endpoint, "claim", {"todo_id": str(todo.pk)})
    transitions.cancel_todo(transitions.Caller.operator(endpoint, "alice"), todo.pk)
    for verb in ("heartbeat", "complete", "fail"):
        is_error, refused = call(endpoint, verb, {"todo_id": str(todo.pk),
                                                  "lease_id": claimed["todo"]["lease_id"]})
        assert is_error and refused["error"]["code"] == "lease_lost"
    _, listed = call(endpoint, "list_todos", {"state": "cancelled"})
    (shown,) = listed["todos"]
    assert shown["state"] == "cancelled" and shown["cancelled_at"].endswith("Z")
    assert shown["lease_id"] is None and shown["lease_owner"] is None


def test_the_schemas_and_instructions_name_the_new_states_and_code(endpoint):
    tools = {tool.name: tool for tool in mcp_schemas.tools_for(endpoint)}
    state = tools["list_todos"].input_schema["properties"]["state"]["enum"]
    assert "cancelled" in state and "awaiting_approval" not in state  # never listed
    todo = tools["claim"].output_schema["properties"]["todo"]
    assert {"awaiting_approval", "cancelled"} <= set(todo["properties"]["state"]["enum"])
    assert "cancelled_at" in todo["properties"]
    assert "awaiting_approval" in tools["claim"].output_schema["properties"]["error"]["description"]
    instructions = mcp_instructions.build_instructions(endpoint)
    assert "awaiting_approval" in instructions and "cancelled" in instructions
    assert len(instructions) <= mcp_instructions.INSTRUCTIONS_MAX_CHARS
