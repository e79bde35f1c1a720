"""Tool descriptions an agent's client reads: output schemas every result validates against,
annotations, portable schemas, instructions per allowlist, and the size of an answer
(CONTRACT §6, issue 13 items 7-8, issue 15 item 3)."""

import itertools
import json
import re
from decimal import Decimal

import jsonschema
import pytest

from channels_push.mcp import instructions as mcp_instructions
from channels_push.mcp import schemas as mcp_schemas
from channels_push.mcp import tools as mcp_tools
from endpoints.models import AGENT_VERBS
from ingest import queries as ingest_queries
from todos import transitions

pytestmark = pytest.mark.django_db


def call(endpoint, name, arguments=None, session="session-a"):
    return mcp_tools.call_tool(endpoint=endpoint, session_id=session,
                               params={"name": name, "arguments": arguments or {}})


def tools_by_name(endpoint):
    return {tool.name: tool for tool in mcp_schemas.tools_for(endpoint)}


def test_every_result_success_and_refusal_validates_against_its_output_schema(endpoint, make_todo,
                                                                              vend, monkeypatch):
    monkeypatch.setattr(ingest_queries, "read_secret",
                        lambda caller, ref: {"ref": ref, "value": "v"})
    tools = tools_by_name(endpoint)
    first, second, third = (make_todo(payload={"n": n}) for n in range(3))
    held = transitions.claim_todo(transitions.Caller.agent(endpoint, "other"), third.pk)
    one = str(first.pk)
    reporting = transitions.claim_todo(transitions.Caller.agent(endpoint, "session-a"),
                                       make_todo(write_back="status").pk)
    outcomes = {
        "list_todos": [({}, False), ({"limit": 1}, False), ({"limit": 0}, True)],
        "claim": [({"todo_id": one}, False), ({"todo_id": one}, True)],
        "heartbeat": [({"todo_id": one}, False), ({"todo_id": "424242"}, True)],
        "complete": [({"todo_id": one, "result": [1, "x"]}, False),
                     ({"todo_id": one}, True)],  # already_done
        "claim_next": [({}, False), ({"queues": ["nowhere"]}, False), ({}, False),
                       ({"lease_ttl_seconds": 0}, True)],
        "fail": [({"todo_id": str(second.pk), "error": "boom"}, False),
                 ({"todo_id": str(held.pk)}, True)],
        "release": [({"todo_id": str(held.pk)}, True)],
        "cancel": [({"todo_id": str(transitions.claim_todo(
            transitions.Caller.agent(endpoint, "session-a"), make_todo().pk).pk),
            "reason": "not wanted"}, False), ({"todo_id": str(held.pk)}, True)],
        "post_update": [({"todo_id": str(reporting.pk), "text": "half way"}, False),
                        ({"todo_id": str(reporting.pk), "text": ""}, True)],
        "read_secret": [({"ref": "secret:1"}, False), ({"ref": 1}, True)],
        "clock_in": [({}, False), ({"x": 1}, True)],
        "clock_out": [({}, False)],
    }
    seen = set()
    for name, cases in outcomes.items():
        validator = jsonschema.Draft202012Validator(tools[name].output_schema)
        for arguments, is_error in cases:
            result = call(endpoint, name, arguments)
            assert result.is_error is is_error, (name, arguments, result.structured_content)
            validator.validate(result.structured_content)
            seen.add((name, is_error))
    assert {name for name, _ in seen} == set(AGENT_VERBS)
    assert len({name for name, is_error in seen if is_error}) == 11  # all but clock_out
    limited, _ = vend(slug="limited", verbs=["list_todos"])
    refused = call(limited, "claim_next")
    jsonschema.validate(refused.structured_content, tools["claim_next"].output_schema)


def test_output_schemas_are_valid_json_schema_objects(endpoint):
    for tool in mcp_schemas.tools_for(endpoint):
        jsonschema.Draft202012Validator.check_schema(tool.output_schema)
        jsonschema.Draft202012Validator.check_schema(tool.input_schema)
        assert tool.output_schema["type"] == "object"


def unportable_nodes(schema, path="$"):
    """The MCP Inspector's --strict rules, here so they run without Node: no ``type`` arrays,
    no boolean schemas, no schema node that constrains nothing."""
    if isinstance(schema, bool):
        yield path, "boolean schema"
        return
    if isinstance(schema.get("type"), list):
        yield path, "type array"
    constraining = set(schema) - {"description", "title", "default", "examples", "$comment"}
    if not constraining:
        yield path, "constrains nothing"
    for key in ("properties", "$defs"):
        for name, child in schema.get(key, {}).items():
            yield from unportable_nodes(child, f"{path}.{key}.{name}")
    for key in ("anyOf", "oneOf", "allOf"):
        for index, child in enumerate(schema.get(key, [])):
            yield from unportable_nodes(child, f"{path}.{key}[{index}]")
    if isinstance(schema.get("items"), dict):
        yield from unportable_nodes(schema["items"], f"{path}.items")


def test_schemas_keep_to_the_portable_subset(endpoint):
    """todo_id was ``"type": ["string", "integer"]``, which single-type dialects reject."""
    for tool in mcp_schemas.tools_for(endpoint):
        for schema in (tool.input_schema, tool.output_schema):
            assert list(unportable_nodes(schema)) == [], tool.name
    todo_id = mcp_schemas.TOOL_SCHEMAS["claim"][1]["properties"]["todo_id"]
    validator = jsonschema.Draft202012Validator(todo_id)
    assert validator.is_valid("12") and validator.is_valid(12)
    assert not validator.is_valid(True) and not validator.is_valid(None)


def test_tools_carry_annotations(endpoint):
    tools = tools_by_name(endpoint)
    for name, tool in tools.items():
        notes = tool.annotations
        assert tool.title and notes.title == tool.title
        assert notes.destructive_hint is False and notes.open_world_hint is False
        assert notes.read_only_hint is (name in ("list_todos", "read_secret"))
    idempotent = {name for name, tool in tools.items() if tool.annotations.idempotent_hint}
    assert {"heartbeat", "release", "complete", "list_todos"} <= idempotent
    assert not {"claim", "claim_next"} & idempotent
    wire = mcp_schemas.list_tools_result(endpoint).model_dump(by_alias=True, exclude_none=True)
    heartbeat = next(t for t in wire["tools"] if t["name"] == "heartbeat")
    assert heartbeat["annotations"] == {"title": "Extend a lease", "readOnlyHint": False,
                                        "destructiveHint": False, "idempotentHint": True,
                                        "openWorldHint": False}
    assert "outputSchema" in heartbeat


# Caps and a budget add the most text: their answers to an empty claim_next, their refusals.
@pytest.mark.parametrize("limits", [{}, {"max_claimed": 3, "budget_usd_per_day": Decimal("5")}],
                         ids=["plain", "capped_and_budgeted"])
def test_instructions_fit_every_allowlist_and_name_only_granted_verbs(vend, limits):
    """Issue 13.7: the instructions named every verb even when the allowlist granted two."""
    endpoint, _ = vend(slug="x" * 64, default_lease_seconds=86400)
    for name, value in limits.items():
        setattr(endpoint, name, value)
    for size in range(1, len(AGENT_VERBS) + 1):
        for verbs in itertools.combinations(AGENT_VERBS, size):
            endpoint.verbs = list(verbs)
            text = mcp_instructions.build_instructions(endpoint)
            assert len(text) <= mcp_instructions.INSTRUCTIONS_MAX_CHARS, verbs
            # Fits whole: the cap cuts from the end, where the trust note is.
            assert text.endswith(mcp_instructions.UNVERIFIED_TODOS_NOTE), verbs
            for verb in set(AGENT_VERBS) - set(verbs):
                assert not re.search(rf"\b{verb}\b", text), (verb, verbs)
            assert "meta.todo_id" in text and '"digest"' in text, verbs
            assert mcp_instructions.UNVERIFIED_TODOS_NOTE in text, verbs  # never cut short


def test_instructions_describe_the_amended_lease_listing_and_refusals(endpoint):
    text = mcp_instructions.build_instructions(endpoint)
    assert "scheduled (wait for its not_before)" in text
    assert "extends by the lease's own length" in text
    assert "already_done" in text and "lease_lost" in text and "lost at once" in text
    assert "next_cursor" in text and "pending, claimed, then failed" in text


def test_a_large_result_is_summarised_in_text_and_whole_in_structured_content(endpoint, make_todo):
    """Issue 15.3: list_todos at limit 200 sent every payload twice (text and structured)."""
    for n in range(30):
        make_todo(payload={"blob": "x" * 2000, "n": n})
    result = call(endpoint, "list_todos", {"limit": 200})
    structured = result.structured_content
    assert len(structured["todos"]) == 30 and structured["todos"][0]["payload"]["blob"]
    whole = len(json.dumps(structured))
    text = result.content[0].text
    assert len(text) <= mcp_tools.TEXT_RENDERING_MAX_CHARS < whole
    summary = json.loads(text)
    assert "structuredContent" in summary["summary"] and summary["has_more"] is False
    assert [t["id"] for t in summary["todos"]] == [t["id"] for t in structured["todos"]]
    small = call(endpoint, "list_todos", {"limit": 1})
    assert json.loads(small.content[0].text) == small.structured_content  # small: the same JSON


def test_an_answer_over_the_cap_asks_for_a_lower_limit(endpoint, make_todo, settings):
    settings.SWITCHBOARD_MCP_MAX_RESULT_BYTES = 64 * 1024
    for n in range(40):
        make_todo(payload={"blob": "y" * 4000})
    result = call(endpoint, "list_todos", {"limit": 40})
    assert result.is_error is True
    error = result.structured_content["error"]
    assert error["code"] == "invalid_argument" and "lower limit" in error["message"]
    assert error["message"].startswith("limit:")
    assert call(endpoint, "list_todos", {"limit": 5}).is_error is False


def test_tools_skipping_validation_for_empty_arguments_accept_them_by_their_schema():
    # _check_arguments skips the validator for {} on tools that require nothing: that must be
    # exactly the tools whose schema accepts {}, and a tool that requires something still
    # refuses {} by name.
    for name, (_, schema) in mcp_schemas.TOOL_SCHEMAS.items():
        accepts_empty = jsonschema.Draft202012Validator(schema).is_valid({})
        assert (name in mcp_tools._TAKE_EMPTY_ARGUMENTS) == accepts_empty, name
    assert "claim_next" in mcp_tools._TAKE_EMPTY_ARGUMENTS
    with pytest.raises(transitions.Refusal) as refused:
        mcp_tools._check_arguments("complete", {})
    assert refused.value.code == "invalid_argument" and "todo_id" in refused.value.message


def test_every_tool_accepts_and_ignores_gemini_clis_wait_for_previous(endpoint, make_todo,
                                                                       monkeypatch):
    """Gemini CLI adds ``wait_for_previous`` to every tool call it makes; refusing it as an
    unknown argument would make that client unusable."""
    monkeypatch.setattr(ingest_queries, "read_secret",
                        lambda caller, ref: {"ref": ref, "value": "v"})

    def every_call():
        first, second, third, fourth = (
            str(make_todo(payload={"n": n}, write_back="status" if n == 0 else "off").pk)
            for n in range(4))
        return [("list_todos", {}), ("claim", {"todo_id": first}),
                ("heartbeat", {"todo_id": first}),
                ("post_update", {"todo_id": first, "text": "half way"}),
                ("complete", {"todo_id": first}),
                ("claim_next", {}), ("claim", {"todo_id": third}),
                ("release", {"todo_id": third}), ("claim", {"todo_id": fourth}),
                ("cancel", {"todo_id": fourth}), ("read_secret", {"ref": "secret:1"}),
                ("clock_out", {}), ("clock_in", {})], second

    for flag in (True, False):
        calls, claimed_next = every_call()
        for name, arguments in calls:
            result = call(endpoint, name, {**arguments, "wait_for_previous": flag})
            assert not result.is_error, (name, result.structured_content)
        claimed = transitions.claim_next_todo(transitions.Caller.agent(endpoint, "session-a"))
        result = call(endpoint, "fail", {"todo_id": str(claimed.pk), "error": "x",
                                         "wait_for_previous": flag})
        assert not result.is_error, result.structured_content
        assert {name for name, _ in calls} | {"fail"} == set(AGENT_VERBS)
    # Not advertised: it is one client's habit, not part of any tool.
    for tool in mcp_schemas.tools_for(endpoint):
        assert "wait_for_previous" not in tool.input_schema["properties"]
    # Any other unknown argument is still refused, naming it.
    refused = call(endpoint, "list_todos", {"wait_for_previous": True, "bogus": 1})
    assert refused.is_error
    assert refused.structured_content["error"]["code"] == "invalid_argument"
    assert "bogus" in refused.structured_content["error"]["message"]
