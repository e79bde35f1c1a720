"""The MCP tools an agent works its queue with (docs/reference.md#tools): ``call_tool`` checks
a tools/call's arguments against its tool's schema (``schemas``) and runs its verb.

Tool results are ``mcp.types`` models; every verb calls the same
``todos.transitions`` functions the board and the commands use, as
``Caller.agent(endpoint, session_id)`` so the lease owner is the MCP session.

Argument problems a model can correct — a wrong JSON type, a missing or unknown argument, a
value out of range — are tool results with ``isError`` and ``error.code = "invalid_argument"``
naming the argument and what it expects: the model sees tool results, not JSON-RPC errors,
so this is how it learns to correct the call. Only an unknown tool or a
``params``/``arguments`` that is not an object stays a JSON-RPC ``-32602``
(``framing.JsonRpcError``).

``read_secret``: operator secrets are stored by ``ingest``, which the MCP server sits above in
the layers, so the verb calls ``ingest.queries.read_secret`` directly.
"""

import json
import logging
from datetime import datetime

import jsonschema
import mcp.types as types
from django.conf import settings

from endpoints import transitions as endpoint_transitions
from ingest import queries as ingest_queries
from ingest import repo_tokens
from switchboard import json_input, tracing
from todos import queries as todo_queries
from todos import transitions

from . import framing, schemas
from .schemas import ANY_JSON_TYPES, TOOL_SCHEMAS

log = logging.getLogger("switchboard.mcp")

# Arguments a known client adds to every call on its own (Gemini CLI's ``wait_for_previous``):
# dropped before validation, never advertised, or every call from it would fail.
IGNORED_ARGUMENTS = frozenset({"wait_for_previous"})

_VALIDATORS = {
    name: jsonschema.Draft202012Validator(schema) for name, (_, schema) in TOOL_SCHEMAS.items()
}


# -- dispatch ------------------------------------------------------------------------------------


# Above this many characters the text content summarises the result (structuredContent carries
# it whole); small results keep the full JSON in text too, for clients that read only text.
TEXT_RENDERING_MAX_CHARS = 16 * 1024


def _without_bulk(todo: dict) -> dict:
    return {key: value for key, value in todo.items()
            if key not in ("payload", "result", "followups") and value is not None}


def render_text(payload: dict, text: str) -> str:
    """The text content for ``payload`` whose JSON is ``text``: that JSON when small, else a
    summary: the todos without payload, result, follow-ups and null fields (or only their
    ids), with a note saying
    where the rest is."""
    if len(text) <= TEXT_RENDERING_MAX_CHARS:
        return text
    brief = dict(payload)
    if isinstance(brief.get("todo"), dict):
        brief["todo"] = _without_bulk(brief["todo"])
    if isinstance(brief.get("todos"), list):
        brief["todos"] = [_without_bulk(todo) for todo in brief["todos"]]
    brief["summary"] = (f"a {len(text)}-character result, summarised here: payload, result, "
                        "followups and null fields are left out; structuredContent carries the "
                        "whole result (or call again with a lower limit)")
    summary = json.dumps(brief, ensure_ascii=False)
    if len(summary) > TEXT_RENDERING_MAX_CHARS and isinstance(brief.get("todos"), list):
        brief["todos"] = [todo.get("id") for todo in brief["todos"]]
        summary = json.dumps(brief, ensure_ascii=False)
    return summary[:TEXT_RENDERING_MAX_CHARS]


def _structured(payload: dict, *, is_error: bool = False) -> types.CallToolResult:
    text = json.dumps(payload, ensure_ascii=False)
    size = len(text.encode())
    cap = settings.SWITCHBOARD_MCP_MAX_RESULT_BYTES
    if size > cap:
        return refusal_result(
            "invalid_argument",
            f"limit: the result would be {size} bytes, over this server's {cap}-byte answer "
            "cap; call again with a lower limit (and page on with cursor)")
    return types.CallToolResult(
        content=[types.TextContent(text=render_text(payload, text))],
        structured_content=payload,
        is_error=is_error,
    )


def refusal_result(code: str, message: str, data: dict | None = None) -> types.CallToolResult:
    return _structured({"error": {"code": code, "message": message, **(data or {})}},
                       is_error=True)


_JSON_TYPE_NAMES = {"object": "an object", "array": "a list", "string": "a string",
                    "integer": "an integer", "number": "a number", "boolean": "true or false",
                    "null": "null"}


def _expected(schema: dict) -> str:
    """What an argument's schema accepts, in words: "a string or an integer", "an integer from
    1 to 200", "one of [...]"."""
    if "anyOf" in schema:
        kinds = [_JSON_TYPE_NAMES.get(branch.get("type"), "a value") for branch in schema["anyOf"]]
        text = "any JSON value" if len(kinds) >= len(ANY_JSON_TYPES) else " or ".join(kinds)
    else:
        text = _JSON_TYPE_NAMES.get(schema.get("type"), "a value")
    if schema.get("type") == "array" and schema.get("items", {}).get("type") == "string":
        text = "a non-empty list of strings" if schema.get("minItems") else "a list of strings"
    if "enum" in schema:
        text = f"one of {schema['enum']}"
    if "minimum" in schema and "maximum" in schema:
        text += f" from {schema['minimum']} to {schema['maximum']}"
    return text


def _json_type_of(value) -> str:
    for name, kind in (("null", type(None)), ("boolean", bool), ("integer", int), ("number", float),
                       ("string", str), ("list", list), ("object", dict)):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _argument_problem(name: str, error) -> str:
    """One jsonschema error as a sentence naming the argument and what it expects."""
    properties = TOOL_SCHEMAS[name][1]["properties"]
    takes = ", ".join(properties) or "no arguments"
    if error.validator == "required":
        missing = error.message.split("'")[1] if "'" in error.message else "an argument"
        return f"{missing}: missing; expected {_expected(properties.get(missing, {}))}"
    if error.absolute_path and (len(error.absolute_path) > 1
                                or error.validator == "additionalProperties"):
        # Inside an object argument (usage): the path names the field.
        return f"{'.'.join(str(step) for step in error.absolute_path)}: {error.message}"
    if error.validator == "additionalProperties":
        unknown = sorted(set(error.instance) - set(properties))
        return f"{', '.join(unknown)}: unknown argument; {name} takes {takes}"
    argument = str(error.absolute_path[0]) if error.absolute_path else "arguments"
    schema = properties.get(argument, {})
    given = error.instance
    shown = _json_type_of(given)
    if not isinstance(given, (dict, list)):
        shown = f"{given!r}"[:60] + f" ({shown})"
    return f"{argument}: expected {_expected(schema)}, got {shown}"


# Tools whose empty ``arguments`` is valid as it stands: the validator (its setup most of the
# cost) is skipped for claim_next's usual call.
_TAKE_EMPTY_ARGUMENTS = frozenset(
    name for name, (_, schema) in TOOL_SCHEMAS.items() if not schema["required"])


# Checked by the write itself, in the one walk of the value it stores (complete, fail): up to
# the result cap, so not walked twice.
_STORED_WHOLE = frozenset({"result"})


def _check_text(arguments: dict) -> None:
    """No argument may carry text the database cannot take (a NUL character, a lone
    surrogate): PostgreSQL refuses it mid-query, which would be an internal error instead of
    a refusal the model can correct. Every argument is walked, names included."""
    for argument, value in arguments.items():
        reason = json_input.unstorable_reason(argument)
        if reason is not None:
            raise transitions.Refusal("invalid_argument",
                                      f"{argument!r}: the argument name {reason}")
        if argument in _STORED_WHOLE:
            continue
        reason = json_input.unstorable_reason(value)
        if reason is not None:
            raise transitions.Refusal("invalid_argument", f"{argument}: {reason}")


def _check_arguments(name: str, arguments: dict) -> None:
    if not arguments and name in _TAKE_EMPTY_ARGUMENTS:
        return
    _check_text(arguments)
    errors = sorted(_VALIDATORS[name].iter_errors(arguments), key=lambda e: [str(p) for p in e.path])
    if errors:
        raise transitions.Refusal("invalid_argument", "; ".join(
            dict.fromkeys(_argument_problem(name, error) for error in errors)))


def _todo(todo, followups=None) -> dict:
    # Every verb that answers with one todo answers for the caller's own lease (claim made it,
    # the fenced verbs matched it), so its holder is the row's own lease owner.
    return {"todo": todo_queries.todo_as_dict(todo, holder=todo.lease_owner, followups=followups)}


def _heartbeat(caller, args):
    """The todo with its follow-ups, the ones this lease had not been given yet
    (``heartbeat_todo`` moved the mark in its statement), and whether to stop."""
    todo = transitions.heartbeat_todo(caller, args["todo_id"], lease_id=args.get("lease_id"),
                                      lease_ttl_seconds=args.get("lease_ttl_seconds"))
    followups = todo_queries.given_followups(todo)
    prior = todo.prior_followups_given or 0
    return {**_todo(todo, followups),
            "followups": [todo_queries.followup_as_dict(followup) for followup in followups
                          if followup.seq > prior],
            "cancel_requested": todo.cancel_requested_at is not None}


def _claimed(todo) -> dict:
    """A claim's answer: the todo with every follow-up (the claim handed them all over) and
    its todo token (docs/security.md#the-todo-token)."""
    return {**_todo(todo, todo_queries.given_followups(todo)),
            "todo_token": transitions.issue_todo_token(todo)}


def _read_secret(caller, args):
    return ingest_queries.read_secret(caller, args["ref"])


def _check_grant(grant, name: str, arguments: dict) -> dict:
    """A todo token's call, on its own todo and lease only: ``arguments`` with the lease filled
    in (a todo token's session is not the one that claimed, so its fenced verbs go by lease),
    or ``not_found`` for any other todo, as one outside the endpoint would be."""
    if name == "read_secret":
        return arguments
    if str(arguments.get("todo_id")) != str(grant.todo_id):
        raise transitions.Refusal("not_found", f"todo {arguments.get('todo_id')} not found")
    return {**arguments, "lease_id": arguments.get("lease_id") or grant.lease_id}


def _repo_token(caller, args):
    return repo_tokens.get_repo_token(caller, args["todo_id"], lease_id=args.get("lease_id"))


def _list_todos(caller, args):
    queue = args.get("queue")
    if queue is not None and not caller.covers(queue):
        raise transitions.Refusal("not_in_scope",
                                  f"queue {queue!r} is outside this endpoint's scope")
    try:
        rows, next_cursor = todo_queries.list_todos(
            caller, queue=queue, state=args.get("state"), cursor=args.get("cursor"),
            limit=args.get("limit", todo_queries.LIST_LIMIT_DEFAULT),
            scheduled=args.get("scheduled"), thread=args.get("thread"),
        )
    except ValueError as bad_cursor:
        raise transitions.Refusal("invalid_argument", f"cursor: {bad_cursor}") from None
    # Other sessions' leases show no lease_id and only an owner hint
    # (docs/security.md#who-may-read-who-may-act).
    return {"todos": [todo_queries.todo_as_dict(row, holder=caller.actor) for row in rows],
            "next_cursor": next_cursor, "has_more": next_cursor is not None}


def _clock(caller, presence: str) -> dict:
    """``{"presence"}``, plus ``override_until`` when an operator override decides it (a
    clock_in during an override changes nothing yet, and the agent learns why and until when)."""
    endpoint_transitions.clock(caller.endpoint, presence, reason="clock_in")
    report = endpoint_transitions.presence_report(caller.endpoint)
    return {key: value for key, value in report.items() if value is not None}


def _claim_next(caller, args):
    try:
        todo = transitions.claim_next_todo(
            caller, queues=args.get("queues"), lease_ttl_seconds=args.get("lease_ttl_seconds"),
            verified_only=args.get("verified_only", False),
        )
    except transitions.Refusal as refusal:
        if refusal.code not in ("at_capacity", "over_budget"):
            raise
        # A cap or a spent budget is not a fault: the agent waits, as it waits for work.
        return {"empty": True, refusal.code: True}
    if todo is not None:
        return _claimed(todo)
    # Everything asked for is paused (docs/reference.md#pausing): say so, so the agent waits
    # instead of concluding the queue is drained.
    paused = caller.endpoint.paused_among(args.get("queues") or caller.queues)
    return {"empty": True, "paused": paused} if paused else {"empty": True}


_VERBS = {
    "list_todos": _list_todos,
    "claim": lambda caller, a: _claimed(transitions.claim_todo(
        caller, a["todo_id"], lease_ttl_seconds=a.get("lease_ttl_seconds"))),
    "claim_next": _claim_next,
    "heartbeat": _heartbeat,
    "complete": lambda caller, a: _todo(transitions.complete_todo(
        caller, a["todo_id"], lease_id=a.get("lease_id"), result=a.get("result"),
        usage_reported=a.get("usage"))),
    "fail": lambda caller, a: _todo(transitions.fail_todo(
        caller, a["todo_id"], lease_id=a.get("lease_id"), error=a.get("error"),
        result=a.get("result"), usage_reported=a.get("usage"))),
    "cancel": lambda caller, a: _todo(transitions.cancel_held_todo(
        caller, a["todo_id"], lease_id=a.get("lease_id"), reason=a.get("reason"))),
    "release": lambda caller, a: _todo(transitions.release_todo(
        caller, a["todo_id"], lease_id=a.get("lease_id"))),
    "post_update": lambda caller, a: _todo(transitions.post_update_todo(
        caller, a["todo_id"], lease_id=a.get("lease_id"), text=a["text"])),
    "repo_token": _repo_token,
    "read_secret": _read_secret,
    "clock_in": lambda caller, a: _clock(caller, "in"),
    "clock_out": lambda caller, a: _clock(caller, "out"),
}
assert set(_VERBS) == set(TOOL_SCHEMAS)


def call_tool(*, endpoint, session_id: str, params: dict | None) -> types.CallToolResult:
    """Run one tools/call for a session of ``endpoint``. Raises framing.JsonRpcError for a
    malformed call (unknown tool, ``arguments`` not an object); every other outcome, argument
    errors and refusals included, is a CallToolResult. With traces on, the call is a span in
    its todo's trace (``_trace_call``)."""
    if not tracing.enabled():
        return _call_tool(endpoint=endpoint, session_id=session_id, params=params)
    started_ns = tracing.now_ns()
    result = _call_tool(endpoint=endpoint, session_id=session_id, params=params)
    _trace_call(endpoint, session_id, params or {}, result, started_ns)
    return result


def _queue_wait_seconds(todo: dict) -> float | None:
    """How long a todo just claimed waited: from its creation to this claim (its update)."""
    try:
        waited = (datetime.fromisoformat(todo["updated_at"])
                  - datetime.fromisoformat(todo["created_at"]))
    except (KeyError, TypeError, ValueError):
        return None
    return round(waited.total_seconds(), 6)


def _trace_call(endpoint, session_id: str, params: dict, result: types.CallToolResult,
                started_ns: int) -> None:
    """The call's span, recorded once its todo is known (a claim_next learns it at the end):
    a child of the todo's traceparent, linked to the one the client put in ``_meta``; a call on
    no todo continues the client's trace, and a listing links to each todo it shows. Ids,
    names, states and codes only: never arguments, results or text. A refused call names its
    todo only when the caller may see it: the ``todo_id`` it passed is the agent's text."""
    name = params.get("name")
    arguments = params.get("arguments") if isinstance(params.get("arguments"), dict) else {}
    meta = params.get("_meta") if isinstance(params.get("_meta"), dict) else {}
    client_parent = tracing.valid_traceparent(meta.get("traceparent"))
    structured = result.structured_content if isinstance(result.structured_content, dict) else {}
    todo = structured.get("todo") if isinstance(structured.get("todo"), dict) else None
    error = structured.get("error") if isinstance(structured.get("error"), dict) else {}
    if todo is None and "todo_id" in arguments:
        todo = todo_queries.find_traced_todo(transitions.Caller.agent(endpoint, session_id),
                                             arguments["todo_id"])
    parent = todo.get("traceparent") if todo else None
    listed = structured.get("todos") if isinstance(structured.get("todos"), list) else []
    links = [row.get("traceparent") for row in listed if isinstance(row, dict)]
    # Few attributes, each one a reader filters on: the SDK's per-attribute checks are much of
    # a span's cost, and this span is on every call (bench/mcp.py).
    attributes = {
        "gen_ai.tool.name": name, "switchboard.endpoint": endpoint.slug,
        "switchboard.todo_id": str(todo["id"]) if todo else None,
        "switchboard.queue": todo["queue"] if todo else None,
        "switchboard.attempt": todo["attempts"] if todo else None,
        "switchboard.refusal": error.get("code"),
        "switchboard.todos_listed": len(listed) if "todos" in structured else None,
        "switchboard.empty": True if structured.get("empty") else None,
    }
    if todo and name in ("claim", "claim_next") and not error:
        attributes["switchboard.queue_wait_seconds"] = _queue_wait_seconds(todo)
    tracing.record(f"tools/call {name}", start_ns=started_ns, parent=parent or client_parent,
                   kind="server", links=[client_parent, *links] if parent else links,
                   **attributes)


def _call_tool(*, endpoint, session_id: str, params: dict | None) -> types.CallToolResult:
    params = params or {}
    name, arguments = params.get("name"), params.get("arguments")
    if not isinstance(name, str) or name not in _VERBS:
        raise framing.JsonRpcError(framing.INVALID_PARAMS, f"Unknown tool: {name!r}")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise framing.JsonRpcError(framing.INVALID_PARAMS,
                                   "Invalid params: arguments must be an object")
    if IGNORED_ARGUMENTS.intersection(arguments):
        arguments = {k: v for k, v in arguments.items() if k not in IGNORED_ARGUMENTS}
    grant = getattr(endpoint, "todo_grant", None)
    if not schemas.offers(endpoint, name):
        return refusal_result("verb_not_allowed", (
            f"a todo token may not use {name}: it acts only on its own todo "
            f"({', '.join(sorted(schemas.TODO_TOKEN_VERBS))})") if grant is not None
            else f"this endpoint may not use {name}")
    # A todo token acts as its lease's holder (the claiming session), on that lease only.
    caller = transitions.Caller.agent(endpoint, grant.lease_owner if grant else session_id)
    try:
        _check_arguments(name, arguments)
        if grant is None:
            return _structured(_VERBS[name](caller, arguments))
        arguments = _check_grant(grant, name, arguments)
        if name == "read_secret":
            return _structured(ingest_queries.read_secret(caller, arguments["ref"],
                                                          todo_id=grant.todo_id))
        return _structured(_VERBS[name](caller, arguments))
    except transitions.Refusal as refusal:
        return refusal_result(refusal.code, refusal.message, refusal.data)
