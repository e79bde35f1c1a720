"""The MCP tools an agent works its queue with (CONTRACT §6, §11), and what ``initialize``
tells it.

Tool schemas and results are ``mcp.types`` models; every verb calls the same
``todos.transitions`` functions the board and the commands use, as
``Caller.agent(endpoint, session_id)`` so the lease owner is the MCP session.

Argument problems come in two kinds, answered differently on purpose:

* structural — arguments not an object, a required argument missing, a wrong JSON type, an
  unknown argument: the call itself is malformed, a JSON-RPC ``-32602`` (``ToolCallError``);
* a value out of range (limit 1…200, lease 1 s…24 h, an unknown state): a domain refusal
  ``invalid_argument``, returned as a tool result with ``isError`` so the agent can correct it.

``read_secret``: operator secrets are stored by ``ingest`` (CONTRACT §5), and ``channels_push``
must not import ``ingest`` (dependency direction, STYLE). So the reader is a hook: the app that
stores secrets registers one at ``AppConfig.ready()`` with ``register_secret_reader``; with none
registered every ref is ``not_found``.
"""

import json
import logging
from dataclasses import dataclass

import jsonschema
import mcp.types as types

from todos import queries as todo_queries
from todos import transitions
from todos.models import State

from . import mcp_framing

log = logging.getLogger("switchboard.mcp")

SERVER_NAME = "switchboard"
SERVER_VERSION = "1.0"
# Keep the whole text under the 2,048 characters some clients truncate instructions at.
INSTRUCTIONS_MAX_CHARS = 2048
# claim_next's long poll (CONTRACT §6): at most this long, like SQS's WaitTimeSeconds cap of 20 s
# but longer, since a waiting claim here costs neither a connection nor a thread.
MAX_WAIT_SECONDS = 60


class ToolCallError(Exception):
    """A malformed tools/call: answered as a JSON-RPC error, not a tool result."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# -- schemas -------------------------------------------------------------------------------------

_TODO_ID = {
    "type": ["string", "integer"],
    "description": "The todo's id (a string, e.g. from a doorbell's meta.todo_id).",
}
_LEASE_ID = {
    "type": "string",
    "description": "The lease_id your claim returned. Optional: without it, the lease held by "
                   "this MCP session is used.",
}
_LEASE_TTL = {
    "type": "number", "minimum": 1, "maximum": 86400,
    "description": "Lease length in seconds (1-86400). Default: this endpoint's lease.",
}


def _schema(properties: dict, required=()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


TOOL_SCHEMAS = {
    "list_todos": (
        "List this endpoint's todos (oldest first, full payloads) without claiming them. "
        "Use claim or claim_next to take work.",
        _schema({
            "queue": {"type": "string", "description": "Only this queue."},
            "state": {"type": "string", "enum": [s.value for s in State],
                      "description": "Only todos in this state."},
            "limit": {"type": "integer", "minimum": 1, "maximum": 200,
                      "description": "At most this many (1-200, default 50)."},
        }),
    ),
    "claim": (
        "Claim one pending todo by id (e.g. a doorbell's meta.todo_id) under a lease. Returns "
        "the todo with payload and lease. not_claimable: someone else has it; move on.",
        _schema({"todo_id": _TODO_ID, "lease_ttl_seconds": _LEASE_TTL}, ["todo_id"]),
    ),
    "claim_next": (
        "Claim the oldest pending todo in your queues (or only the given ones). Returns "
        '{"todo": …} or {"empty": true} when there is nothing to do. With wait_seconds, waits '
        "up to that long for a todo to become ready before answering empty (a long poll).",
        _schema({
            "queues": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                       "description": "Only these queues (each must be in your scope)."},
            "lease_ttl_seconds": _LEASE_TTL,
            "wait_seconds": {
                "type": "number", "minimum": 0, "maximum": MAX_WAIT_SECONDS,
                "description": f"Long poll: with nothing to claim, wait up to this many seconds "
                               f"(0-{MAX_WAIT_SECONDS}, default 0) for a todo to become ready."},
        }),
    ),
    "heartbeat": (
        "Extend your lease on a claimed todo while you still work on it. lease_lost: the lease "
        "lapsed and the todo went back to the queue; stop working on it.",
        _schema({"todo_id": _TODO_ID, "lease_id": _LEASE_ID, "lease_ttl_seconds": _LEASE_TTL},
                ["todo_id"]),
    ),
    "complete": (
        "Finish a claimed todo successfully, with an optional JSON result.",
        _schema({"todo_id": _TODO_ID, "lease_id": _LEASE_ID,
                 "result": {"description": "Any JSON value describing the outcome."}},
                ["todo_id"]),
    ),
    "fail": (
        "Give up on a claimed todo with an error. It is retried later with backoff, and "
        "dead-lettered once its attempts are spent.",
        _schema({"todo_id": _TODO_ID, "lease_id": _LEASE_ID,
                 "error": {"type": "string", "description": "What went wrong, one line."},
                 "result": {"description": "Any JSON value (partial output)."}},
                ["todo_id"]),
    ),
    "release": (
        "Hand a claimed todo back untouched: pending again at once, attempt refunded.",
        _schema({"todo_id": _TODO_ID, "lease_id": _LEASE_ID}, ["todo_id"]),
    ),
    "read_secret": (
        "Fetch an operator-supplied secret by the ref found in a todo's payload. Never echo "
        "the value into results, logs or messages.",
        _schema({"ref": {"type": "string", "description": "The secret ref from the payload."}},
                ["ref"]),
    ),
    "clock_in": (
        "Go on duty: doorbells resume, and if work waited you get one digest (meta.kind "
        "\"digest\") to drain with claim_next. With a shift schedule this holds until the next "
        "shift boundary.",
        _schema({}),
    ),
    "clock_out": (
        "Go off duty: no doorbells until you clock in (or your shift starts); todos wait, still "
        "pullable with claim_next. With a shift schedule this holds until the next boundary.",
        _schema({}),
    ),
}

# JSON Schema keywords whose violation means the call is malformed (-32602); any other
# violated keyword (minimum, maximum, enum, minItems) is a value the agent can correct.
_STRUCTURAL_KEYWORDS = frozenset({"type", "required", "additionalProperties"})

_VALIDATORS = {
    name: jsonschema.Draft202012Validator(schema) for name, (_, schema) in TOOL_SCHEMAS.items()
}


def tools_for(endpoint) -> list[types.Tool]:
    """The tools this endpoint's verb allowlist grants, in a stable order."""
    return [
        types.Tool(name=name, description=description, input_schema=schema)
        for name, (description, schema) in TOOL_SCHEMAS.items()
        if endpoint.allows(name)
    ]


def list_tools_result(endpoint) -> types.ListToolsResult:
    return types.ListToolsResult(tools=tools_for(endpoint))


# -- initialize ----------------------------------------------------------------------------------


def build_instructions(endpoint) -> str:
    lease_seconds = int(endpoint.effective_lease.total_seconds())
    text = (
        f"switchboard is the durable todo queue of endpoint '{endpoint.slug}'. Todos arrive as "
        "<channel> doorbell events (notifications/claude/channel), but the queue stays the "
        "record: a doorbell can be missed or repeated, so always act through the tools and "
        "handle each todo idempotently. Two notification kinds: (1) todo doorbell - "
        "meta.todo_id names one todo: call claim with that todo_id (not_claimable means "
        "another worker took it; move on). (2) digest - meta.kind is \"digest\" with "
        "meta.pending and meta.queues: drain the queue with claim_next until it returns "
        "{\"empty\": true}. Pull-only agents (no doorbells) loop on claim_next with "
        "wait_seconds (up to 60): it answers as soon as a todo is ready. clock_out stops "
        "doorbells while you are away (todos wait); clock_in resumes them with a digest. "
        f"Lease contract: a claim holds the todo under a lease of {lease_seconds} seconds by "
        "default (lease_ttl_seconds overrides, 1-86400). Call heartbeat before the lease "
        "lapses while you still work, then complete (with a result), fail (with an error; it "
        "is retried with backoff and dead-lettered after its last attempt) or release (hand it "
        "back). A lapsed lease returns the todo to the queue for another worker, and your "
        "late complete gets lease_lost. Refusals come back as tool results with isError and "
        "error.code: not_found, not_in_scope, not_claimable, lease_lost, verb_not_allowed, "
        "invalid_argument. Secrets in payloads are refs: fetch them with read_secret and never "
        "repeat their values."
    )
    return text[:INSTRUCTIONS_MAX_CHARS]


def initialize_result(endpoint, protocol_version: str) -> types.InitializeResult:
    return types.InitializeResult(
        protocol_version=protocol_version,
        capabilities=types.ServerCapabilities(
            tools=types.ToolsCapability(),
            logging=types.LoggingCapability(),  # setLevel accepted; no log messages are sent
            # Claude Code's channel extension: the doorbell arrives as
            # notifications/claude/channel on the session's stream (CONTRACT §7).
            experimental={"claude/channel": {}},
        ),
        server_info=types.Implementation(name=SERVER_NAME, version=SERVER_VERSION),
        instructions=build_instructions(endpoint),
    )


# -- read_secret hook ----------------------------------------------------------------------------

_secret_reader = None


def register_secret_reader(reader) -> None:
    """Install ``reader(caller, ref) -> {"ref", "value"}``, which raises
    ``todos.transitions.Refusal`` (``not_found`` when ``ref`` is missing or not visible to
    ``caller``'s endpoint and scope, ``invalid_argument`` when malformed). The app that stores
    secrets (ingest) installs it; channels_push never imports ingest."""
    global _secret_reader
    _secret_reader = reader


def unregister_secret_reader(reader) -> None:
    global _secret_reader
    if _secret_reader is reader:
        _secret_reader = None


# -- dispatch ------------------------------------------------------------------------------------


class _Refused(Exception):
    def __init__(self, code, message):
        self.code, self.message = code, message


def _structured(payload: dict, *, is_error: bool = False) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(text=json.dumps(payload, ensure_ascii=False))],
        structured_content=payload,
        is_error=is_error,
    )


def refusal_result(code: str, message: str) -> types.CallToolResult:
    return _structured({"error": {"code": code, "message": message}}, is_error=True)


def _check_arguments(name: str, arguments: dict) -> None:
    errors = list(_VALIDATORS[name].iter_errors(arguments))
    structural = [e for e in errors if e.validator in _STRUCTURAL_KEYWORDS]
    if structural:
        raise ToolCallError(mcp_framing.INVALID_PARAMS,
                            f"Invalid params for {name}: {structural[0].message}")
    if errors:
        error = errors[0]
        where = ".".join(str(p) for p in error.absolute_path) or "arguments"
        raise _Refused("invalid_argument", f"{where}: {error.message}")


def _todo(todo) -> dict:
    return {"todo": todo_queries.todo_as_dict(todo)}


def _read_secret(caller, args):
    if _secret_reader is None:
        raise _Refused("not_found", f"no secret {args['ref']!r}")
    return _secret_reader(caller, args["ref"])


def _list_todos(caller, args):
    rows = todo_queries.list_todos(
        caller, queue=args.get("queue"), state=args.get("state"),
        limit=args.get("limit", todo_queries.LIST_LIMIT_DEFAULT),
    )
    return {"todos": [todo_queries.todo_as_dict(row) for row in rows]}


def _clock(caller, presence: str) -> dict:
    from . import doorbells  # doorbells -> mcp_transport -> mcp_tools: imported at call time

    return {"presence": doorbells.clock(caller.endpoint, presence, reason="clock_in")}


def _claim_next(caller, args):
    todo = transitions.claim_next_todo(
        caller, queues=args.get("queues"), lease_ttl_seconds=args.get("lease_ttl_seconds")
    )
    return {"empty": True} if todo is None else _todo(todo)


_VERBS = {
    "list_todos": _list_todos,
    "claim": lambda caller, a: _todo(transitions.claim_todo(
        caller, a["todo_id"], lease_ttl_seconds=a.get("lease_ttl_seconds"))),
    "claim_next": _claim_next,
    "heartbeat": lambda caller, a: _todo(transitions.heartbeat_todo(
        caller, a["todo_id"], lease_id=a.get("lease_id"),
        lease_ttl_seconds=a.get("lease_ttl_seconds"))),
    "complete": lambda caller, a: _todo(transitions.complete_todo(
        caller, a["todo_id"], lease_id=a.get("lease_id"), result=a.get("result"))),
    "fail": lambda caller, a: _todo(transitions.fail_todo(
        caller, a["todo_id"], lease_id=a.get("lease_id"), error=a.get("error"),
        result=a.get("result"))),
    "release": lambda caller, a: _todo(transitions.release_todo(
        caller, a["todo_id"], lease_id=a.get("lease_id"))),
    "read_secret": _read_secret,
    "clock_in": lambda caller, a: _clock(caller, "in"),
    "clock_out": lambda caller, a: _clock(caller, "out"),
}
assert set(_VERBS) == set(TOOL_SCHEMAS)


@dataclass(frozen=True)
class LongPoll:
    """An empty claim_next that asked to wait: how long, and for which queues (None: every
    queue of the endpoint) a ready todo should wake it."""

    endpoint_id: int
    wait_seconds: float
    queues: tuple | None


def long_poll_of(endpoint, params: dict | None, result: dict) -> LongPoll | None:
    """Whether the answer to tools/call ``params`` (``result``, as on the wire) should wait
    instead of going out now: a claim_next that found nothing and was given wait_seconds > 0."""
    params = params or {}
    arguments = params.get("arguments") or {}
    wait_seconds = arguments.get("wait_seconds") or 0
    if (params.get("name") != "claim_next" or result.get("isError") or wait_seconds <= 0
            or not (result.get("structuredContent") or {}).get("empty")):
        return None
    queues = arguments.get("queues")
    if queues is None and not endpoint.all_queues:
        queues = endpoint.scope
    return LongPoll(endpoint_id=endpoint.pk, wait_seconds=float(wait_seconds),
                    queues=tuple(sorted(set(queues))) if queues is not None else None)


def call_tool(*, endpoint, session_id: str, params: dict | None) -> types.CallToolResult:
    """Run one tools/call for a session of ``endpoint``. Raises ToolCallError for a malformed
    call (unknown tool, structurally bad arguments); every domain outcome, refusals included,
    is a CallToolResult."""
    params = params or {}
    name, arguments = params.get("name"), params.get("arguments")
    if not isinstance(name, str) or name not in _VERBS:
        raise ToolCallError(mcp_framing.INVALID_PARAMS, f"Unknown tool: {name!r}")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ToolCallError(mcp_framing.INVALID_PARAMS, "Invalid params: arguments must be an object")
    if not endpoint.allows(name):
        return refusal_result("verb_not_allowed", f"this endpoint may not use {name}")
    caller = transitions.Caller.agent(endpoint, session_id)
    try:
        _check_arguments(name, arguments)
        return _structured(_VERBS[name](caller, arguments))
    except _Refused as refused:
        return refusal_result(refused.code, refused.message)
    except transitions.Refusal as refusal:
        return refusal_result(refusal.code, refusal.message)
