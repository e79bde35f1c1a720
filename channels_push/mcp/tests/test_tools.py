"""Tool dispatch: every verb through todos.transitions, refusals as isError results."""

import json

import pytest

from channels_push.mcp import framing as mcp_framing
from channels_push.mcp import instructions as mcp_instructions
from channels_push.mcp import schemas as mcp_schemas
from channels_push.mcp import tools as mcp_tools
from ingest import queries as ingest_queries
from todos import transitions
from todos.models import Todo


def call(endpoint, name, arguments=None, session="session-a"):
    result = mcp_tools.call_tool(endpoint=endpoint, session_id=session,
                                 params={"name": name, "arguments": arguments or {}})
    payload = result.structured_content
    assert json.loads(result.content[0].text) == payload  # text rendering = same JSON
    return result.is_error, payload


def refusal_code(outcome):
    is_error, payload = outcome
    assert is_error is True
    return payload["error"]["code"]


def test_worker_loop_claim_next_heartbeat_complete(endpoint, make_todo):
    todo = make_todo(payload={"n": 1})
    is_error, claimed = call(endpoint, "claim_next")
    assert not is_error
    assert claimed["todo"]["id"] == str(todo.pk)
    assert claimed["todo"]["lease_owner"] == "session-a"[:8]  # a hint (CONTRACT §12)
    assert claimed["todo"]["payload"] == {"n": 1}
    lease_id = claimed["todo"]["lease_id"]
    _, beat = call(endpoint, "heartbeat", {"todo_id": str(todo.pk), "lease_ttl_seconds": 600})
    assert beat["todo"]["lease_expires_at"] > claimed["todo"]["lease_expires_at"]
    _, done = call(endpoint, "complete", {"todo_id": todo.pk, "lease_id": lease_id,
                                          "result": {"ok": True}})
    assert done["todo"]["state"] == "done" and done["todo"]["result"] == {"ok": True}
    assert call(endpoint, "claim_next") == (False, {"empty": True})


def test_fail_schedules_a_retry_and_release_refunds(endpoint, make_todo):
    first, second = make_todo(), make_todo()
    call(endpoint, "claim", {"todo_id": str(first.pk)})
    _, failed = call(endpoint, "fail", {"todo_id": str(first.pk), "error": "boom"})
    assert failed["todo"]["state"] == "failed" and failed["todo"]["retry_at"]
    assert failed["todo"]["last_error"] == "boom"
    call(endpoint, "claim", {"todo_id": str(second.pk)})
    _, released = call(endpoint, "release", {"todo_id": str(second.pk)})
    assert released["todo"]["state"] == "pending" and released["todo"]["attempts"] == 0


def test_other_sessions_lease_is_lost(endpoint, make_todo):
    todo = make_todo()
    call(endpoint, "claim", {"todo_id": str(todo.pk)}, session="one")
    assert refusal_code(call(endpoint, "complete", {"todo_id": str(todo.pk)},
                             session="two")) == "lease_lost"
    assert refusal_code(call(endpoint, "claim", {"todo_id": str(todo.pk)},
                             session="two")) == "not_claimable"


def test_list_todos_with_filters_and_limit_range(endpoint, make_todo):
    make_todo(queue="inbox"), make_todo(queue="reviews"), make_todo(queue="inbox")
    _, listed = call(endpoint, "list_todos", {"queue": "inbox", "limit": 1})
    assert [t["queue"] for t in listed["todos"]] == ["inbox"]
    assert len(call(endpoint, "list_todos", {"limit": 200})[1]["todos"]) == 3
    assert refusal_code(call(endpoint, "list_todos", {"limit": 0})) == "invalid_argument"
    assert refusal_code(call(endpoint, "list_todos", {"limit": 201})) == "invalid_argument"
    assert refusal_code(call(endpoint, "list_todos", {"state": "lost"})) == "invalid_argument"


def test_lease_ttl_out_of_range_is_invalid_argument(endpoint, make_todo):
    todo = make_todo()
    assert refusal_code(call(endpoint, "claim", {"todo_id": str(todo.pk),
                                                 "lease_ttl_seconds": 0})) == "invalid_argument"
    assert Todo.objects.get(pk=todo.pk).state == "pending"


def test_scope_hides_todos_outside_it(make_todo, vend):
    narrow, _ = vend(slug="narrow", scope=["reviews"])
    hidden, _ = transitions.create_todo(endpoint=narrow, queue="inbox", title="x", actor="t")
    visible, _ = transitions.create_todo(endpoint=narrow, queue="reviews", title="y", actor="t")
    assert refusal_code(call(narrow, "claim", {"todo_id": str(hidden.pk)})) == "not_found"
    assert [t["id"] for t in call(narrow, "list_todos")[1]["todos"]] == [str(visible.pk)]
    assert refusal_code(call(narrow, "list_todos", {"queue": "inbox"})) == "not_in_scope"
    assert refusal_code(call(narrow, "claim_next", {"queues": ["inbox"]})) == "not_in_scope"
    assert call(narrow, "claim_next")[1]["todo"]["id"] == str(visible.pk)


def test_another_endpoints_todo_looks_missing(endpoint, vend):
    other, _ = vend(slug="other")
    theirs, _ = transitions.create_todo(endpoint=other, queue="inbox", title="x", actor="t")
    outcome = call(endpoint, "claim", {"todo_id": str(theirs.pk)})
    missing = call(endpoint, "claim", {"todo_id": "987654321"})
    assert refusal_code(outcome) == refusal_code(missing) == "not_found"
    assert outcome[1]["error"]["message"].replace(str(theirs.pk), "N") == \
        missing[1]["error"]["message"].replace("987654321", "N")


def test_verb_not_allowed(vend, make_todo):
    limited, _ = vend(slug="limited", verbs=["list_todos"])
    assert refusal_code(call(limited, "claim_next")) == "verb_not_allowed"


def test_unknown_tool_and_non_object_arguments_raise(endpoint):
    with pytest.raises(mcp_framing.JsonRpcError):
        mcp_tools.call_tool(endpoint=endpoint, session_id="s", params={"name": "nope"})
    with pytest.raises(mcp_framing.JsonRpcError):
        mcp_tools.call_tool(endpoint=endpoint, session_id="s",
                            params={"name": "claim", "arguments": ["todo_id"]})
    assert refusal_code(call(endpoint, "claim", {"todo_id": None})) == "invalid_argument"


def test_read_secret_asks_ingest_for_the_agent_and_passes_its_refusals_on(endpoint, vend,
                                                                          monkeypatch):
    seen = []

    def reader(caller, ref):
        seen.append((caller.endpoint.slug, caller.actor, ref))
        if (caller.endpoint.pk, ref) != (endpoint.pk, "secret:1"):
            raise transitions.Refusal("not_found", "no such secret")
        return {"ref": ref, "value": "s3cr3t"}

    monkeypatch.setattr(ingest_queries, "read_secret", reader)
    assert call(endpoint, "read_secret", {"ref": "secret:1"}) == (
        False, {"ref": "secret:1", "value": "s3cr3t"})
    other, _ = vend(slug="other")
    assert refusal_code(call(other, "read_secret", {"ref": "secret:1"})) == "not_found"
    assert seen[0] == (endpoint.slug, "session-a", "secret:1")


def test_instructions_fit_and_name_both_notification_kinds(endpoint):
    text = mcp_instructions.build_instructions(endpoint)
    assert len(text) <= mcp_instructions.INSTRUCTIONS_MAX_CHARS
    assert "meta.todo_id" in text and '"digest"' in text and "claim_next" in text
    assert f"{int(endpoint.effective_lease.total_seconds())} seconds" in text


BAD_TEXT = {"nul": "a\x00b", "lone_surrogate": "a\ud800b"}


@pytest.mark.parametrize("bad", sorted(BAD_TEXT))
def test_nul_or_a_lone_surrogate_in_any_tool_argument_is_invalid_argument_naming_it(
        endpoint, make_todo, bad):
    todo = make_todo()
    _, claimed = call(endpoint, "claim", {"todo_id": str(todo.pk)})
    lease_id = claimed["todo"]["lease_id"]
    text = BAD_TEXT[bad]
    checked = 0
    for tool, (_, schema) in mcp_schemas.TOOL_SCHEMAS.items():
        for argument, spec in schema["properties"].items():
            if spec.get("type") not in ("string", "array", None) and "anyOf" not in spec:
                continue  # numbers and booleans cannot carry text
            arguments = {name: value for name, value in
                         {"todo_id": str(todo.pk), "lease_id": lease_id, "ref": "sec_x"}.items()
                         if name in schema["required"]}
            arguments[argument] = [text] if spec.get("type") == "array" else text
            is_error, payload = call(endpoint, tool, arguments)
            assert is_error, (tool, argument)
            assert payload["error"]["code"] == "invalid_argument", (tool, argument, payload)
            assert payload["error"]["message"].startswith(f"{argument}"), (tool, payload)
            checked += 1
    assert checked >= 15
    # Nothing changed: the todo is still claimed under the same lease, never completed.
    todo.refresh_from_db()
    assert (todo.state, todo.lease_id) == ("claimed", lease_id)
