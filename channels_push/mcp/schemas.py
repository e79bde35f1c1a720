"""What the MCP server offers an agent: each tool's input schema, output schema and
annotations, and the ``tools/list`` result built from them for one endpoint's verbs.

Every tool carries MCP annotations and an ``outputSchema`` that each of its results, success or
refusal, validates against (``channels_push/mcp/tests/test_schemas.py``). The schemas keep
to the portable subset (single-type ``type``, no bare ``true`` schemas) that the MCP Inspector's
``--strict`` check asks for.
"""

import mcp.types as types

from todos import queries as todo_queries
from todos import usage
from todos.models import MAX_PROGRESS_CHARS, THREAD_MAX_CHARS, State

# claim_next's long poll (docs/reference.md#long-poll): at most this long, like SQS's
# WaitTimeSeconds cap of 20 s but longer, since a waiting claim here costs neither a connection
# nor a thread.
MAX_WAIT_SECONDS = 60


# -- schemas -------------------------------------------------------------------------------------

# Not ``"type": ["string", "integer"]``: type arrays do not survive clients that map tool
# schemas onto a single-type dialect; anyOf branches with one type each do.
_TODO_ID = {
    "anyOf": [{"type": "string"}, {"type": "integer"}],
    "description": "The todo's id (a string, e.g. from a doorbell's meta.todo_id).",
}
# "Any JSON value", spelled so that every branch constrains something (a bare {} is flagged as
# unportable).
ANY_JSON_TYPES = ("object", "array", "string", "number", "boolean", "null")


def _any_json(description: str) -> dict:
    return {"anyOf": [{"type": t} for t in ANY_JSON_TYPES], "description": description}

_LEASE_ID = {
    "type": "string",
    "description": "The lease_id your claim returned. Optional: without it, the lease held by "
                   "this MCP session is used.",
}
_LEASE_TTL = {
    "type": "number", "minimum": 1, "maximum": 86400,
    "description": "Lease length in seconds (1-86400). Default: this endpoint's lease.",
}


_USAGE = {
    "type": "object",
    "description": "What this attempt cost, as your CLI reported it (each field optional): "
                   f"input_tokens and output_tokens (0-{usage.MAX_TOKENS_PER_ATTEMPT}), cost_usd "
                   f"(0-{usage.MAX_COST_USD_PER_ATTEMPT}), turns (0-{usage.MAX_TURNS_PER_ATTEMPT}),"
                   " model (its name).",
    "properties": {
        "input_tokens": {"type": "integer", "minimum": 0, "maximum": usage.MAX_TOKENS_PER_ATTEMPT},
        "output_tokens": {"type": "integer", "minimum": 0, "maximum": usage.MAX_TOKENS_PER_ATTEMPT},
        "cost_usd": {"type": "number", "minimum": 0,
                     "maximum": int(usage.MAX_COST_USD_PER_ATTEMPT)},
        "turns": {"type": "integer", "minimum": 0, "maximum": usage.MAX_TURNS_PER_ATTEMPT},
        "model": {"type": "string", "minLength": 1, "maxLength": usage.MAX_MODEL_CHARS},
    },
    "additionalProperties": False,
}


def _schema(properties: dict, required=()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


TOOL_SCHEMAS = {
    "list_todos": (
        "List todos without claiming them, full payloads. Without state: the live ones - "
        "pending, then claimed, then failed waiting to retry - oldest first (done and cancelled "
        "ones only when asked for by state). Todos awaiting an operator's approval are never "
        "listed. Pages: pass "
        "next_cursor back as cursor while has_more. Use claim or claim_next to take work.",
        _schema({
            "queue": {"type": "string", "description": "Only this queue."},
            # Not awaiting_approval: no agent reads a gated todo (docs/work-control.md#approval).
            "state": {"type": "string", "enum": [s.value for s in State
                                                 if s != State.AWAITING_APPROVAL],
                      "description": "Only todos in this state."},
            "limit": {"type": "integer", "minimum": 1, "maximum": todo_queries.LIST_LIMIT_MAX,
                      "description": f"At most this many (1-{todo_queries.LIST_LIMIT_MAX}, "
                                     f"default {todo_queries.LIST_LIMIT_DEFAULT})."},
            "cursor": {"type": "string",
                       "description": "next_cursor of the previous page, to list the next one."},
            "scheduled": {"type": "boolean",
                          "description": "true: only scheduled todos (pending, not claimable "
                                         "before not_before); false: leave them out."},
            "thread": {"type": "string", "maxLength": THREAD_MAX_CHARS,
                       "description": "Only this thread's todos (a todo's thread, e.g. "
                                      "owner/repo#12)."},
        }),
    ),
    "claim": (
        "Claim one pending todo by id (e.g. a doorbell's meta.todo_id) under a lease. Returns "
        "the todo with payload and lease. not_claimable: someone else has it; move on. "
        "scheduled: not before its not_before; leave it until then.",
        _schema({"todo_id": _TODO_ID, "lease_ttl_seconds": _LEASE_TTL}, ["todo_id"]),
    ),
    "claim_next": (
        "Claim the next ready todo in your queues (or only the given ones): highest priority, "
        "then oldest. Returns "
        '{"todo": …} or {"empty": true} when there is nothing to do ({"empty": true, '
        '"paused": […]} when the operator paused every queue you asked for, "at_capacity": true '
        "when the endpoint's cap on claimed todos is reached, \"over_budget\": true when its "
        "daily budget is spent: wait, do not conclude the work is done). With wait_seconds, "
        "waits up to that long for a todo to become ready before answering empty (a long "
        "poll).",
        _schema({
            "queues": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                       "description": "Only these queues (each must be in your scope)."},
            "lease_ttl_seconds": _LEASE_TTL,
            "wait_seconds": {
                "type": "number", "minimum": 0, "maximum": MAX_WAIT_SECONDS,
                "description": f"Long poll: with nothing to claim, wait up to this many seconds "
                               f"(0-{MAX_WAIT_SECONDS}, default 0) for a todo to become ready."},
            "verified_only": {
                "type": "boolean",
                "description": 'Skip todos with trust "unverified" (from an unauthenticated '
                               "sender). Default false."},
        }),
    ),
    "heartbeat": (
        "Extend your lease on a claimed todo while you still work on it: by the lease's own "
        "length, or to now + lease_ttl_seconds when given. lease_lost: the lease lapsed (or an "
        "operator ended it) and the todo went back to the queue; stop working on it. Answers "
        "followups (later events on the todo's thread you have not been given yet: third-party "
        "text, fold them into the work) and cancel_requested (true: the source closed or the "
        "operator asked you to stop: stop and call cancel, or complete if already done).",
        _schema({"todo_id": _TODO_ID, "lease_id": _LEASE_ID, "lease_ttl_seconds": _LEASE_TTL},
                ["todo_id"]),
    ),
    "complete": (
        "Finish a claimed todo successfully, with an optional JSON result. already_done: this "
        "lease completed it before (e.g. a retry after a network error); the work is recorded.",
        _schema({"todo_id": _TODO_ID, "lease_id": _LEASE_ID,
                 "result": _any_json("Any JSON value describing the outcome."),
                 "usage": _USAGE},
                ["todo_id"]),
    ),
    "fail": (
        "Give up on a claimed todo with an error. It is retried later with backoff, and "
        "dead-lettered once its attempts are spent (or its cost passes its max_cost_usd).",
        _schema({"todo_id": _TODO_ID, "lease_id": _LEASE_ID,
                 "error": {"type": "string", "description": "What went wrong, one line."},
                 "result": _any_json("Any JSON value (partial output)."),
                 "usage": _USAGE},
                ["todo_id"]),
    ),
    "cancel": (
        "End a claimed todo you hold without doing it (state cancelled, never retried): when "
        "heartbeat says cancel_requested, or the work is no longer wanted.",
        _schema({"todo_id": _TODO_ID, "lease_id": _LEASE_ID,
                 "reason": {"type": "string", "maxLength": 500,
                            "description": "Why, one line (optional)."}},
                ["todo_id"]),
    ),
    "release": (
        "Hand a claimed todo back untouched: pending again at once, attempt refunded (one asked "
        "to stop is cancelled instead).",
        _schema({"todo_id": _TODO_ID, "lease_id": _LEASE_ID}, ["todo_id"]),
    ),
    "post_update": (
        "Tell the people where a claimed todo came from (the GitHub issue or pull request) how "
        "the work goes: your text becomes the progress line of switchboard's status there. You "
        "need no token of that source. The latest text wins; the status is edited at most every "
        "10 s. write_back_off: that source hears no status from switchboard.",
        _schema({"todo_id": _TODO_ID, "lease_id": _LEASE_ID,
                 "text": {"type": "string", "minLength": 1, "maxLength": MAX_PROGRESS_CHARS,
                          "description": "One progress update, plain text (no markup)."}},
                ["todo_id", "text"]),
    ),
    "repo_token": (
        "Get a GitHub token for the repository a claimed todo came from, with only the "
        "permissions the operator granted its route, valid while you hold the lease (about an "
        'hour at most). Returns {"token", "expires_at", "repository", "permissions"}; call '
        "again for a fresh one when it is about to expire. verb_not_allowed: this todo's route "
        "grants no repository token.",
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


# -- results: output schemas and annotations ------------------------------------------------------

_NULLABLE_STRING = {"anyOf": [{"type": "string"}, {"type": "null"}]}
_TODO_OUTPUT = {
    "type": "object",
    "description": "A todo. Times are ISO-8601 UTC; a done todo shows no lease.",
    "properties": {
        "id": {"type": "string"},
        "endpoint": {"type": "string"},
        "queue": {"type": "string"},
        "state": {"type": "string", "enum": [s.value for s in State]},
        "title": {"type": "string"},
        "kind": {"type": "string"},
        "source": {"type": "string"},
        "trust": {"type": "string"},
        "payload": _any_json("The todo's payload (secrets appear as refs)."),
        "priority": {"type": "integer", "minimum": -100, "maximum": 100,
                     "description": "Higher is claimed first by claim_next (default 0)."},
        "not_before": {**_NULLABLE_STRING,
                       "description": "Set on a scheduled todo: not claimable before then."},
        "attempts": {"type": "integer"},
        "max_attempts": {"type": "integer"},
        "lease_id": _NULLABLE_STRING,
        "lease_owner": _NULLABLE_STRING,
        "lease_expires_at": _NULLABLE_STRING,
        "retry_at": _NULLABLE_STRING,
        "dead_lettered_at": _NULLABLE_STRING,
        "cancelled_at": {**_NULLABLE_STRING,
                         "description": "When its operator cancelled it (state cancelled)."},
        "result": _any_json("What complete or fail stored."),
        "last_error": _NULLABLE_STRING,
        "created_at": {"type": "string"},
        "updated_at": {"type": "string"},
        "usage": {"anyOf": [{"type": "object"}, {"type": "null"}],
                  "description": "Summed over the attempts that reported usage (null: none "
                                 "did): input_tokens, output_tokens, cost_usd, turns, model."},
        "traceparent": {**_NULLABLE_STRING,
                        "description": "The W3C traceparent of the trace its delivery started "
                                       "(null: none); pass it on to join that trace."},
        "thread": {**_NULLABLE_STRING,
                   "description": "The issue, pull request or conversation it is about "
                                  "(e.g. owner/repo#12); null: none."},
        "followup_count": {"type": "integer", "description": "How many follow-ups it has."},
        "followups": {"anyOf": [{"type": "array", "items": {"type": "object"}},
                                {"type": "null"}],
                      "description": "Later events on its thread, in order (claim, claim_next "
                                     "and heartbeat; null elsewhere): id, kind, title, actor, "
                                     "trust, payload, at. Third-party text, like the todo's."},
        "cancel_requested": {"type": "boolean",
                             "description": "Its source or operator asked the holder to stop."},
    },
    "required": ["id", "queue", "state", "title", "payload", "attempts", "max_attempts",
                 "created_at", "updated_at"],
}
_ERROR_OUTPUT = {
    "type": "object",
    "description": "A refusal (isError): code is one of not_found, not_in_scope, not_claimable, "
                   "lease_lost, already_done, paused, scheduled, at_capacity, over_budget, "
                   "awaiting_approval, "
                   "verb_not_allowed, "
                   "invalid_argument.",
    "properties": {"code": {"type": "string"}, "message": {"type": "string"},
                   "usage_recorded": {"type": "boolean", "description": "On a refused "
                                      "complete or fail that carried usage: whether it was "
                                      "recorded on the attempt this lease settled."}},
    "required": ["code", "message"],
}


def _output_schema(properties: dict, *alternatives) -> dict:
    """A tool's outputSchema: one of its success shapes (each a list of required keys) or a
    refusal. Extra keys are allowed, so a result may grow a field without breaking clients
    that validate."""
    return {
        "type": "object",
        "properties": {**properties, "error": _ERROR_OUTPUT},
        "anyOf": [{"required": list(required)} for required in alternatives] + [
            {"required": ["error"]}],
    }


_TODO_RESULT = _output_schema({"todo": _TODO_OUTPUT}, ["todo"])
_TODO_TOKEN_OUTPUT = {
    "type": "string",
    "description": "A bearer for this MCP URL good for this todo and this lease only "
                   "(heartbeat, complete, fail, release, post_update, read_secret, repo_token): "
                   "give it, not your own credential, to whatever does the work."}
_PRESENCE_RESULT = _output_schema({
    "presence": {"type": "string", "enum": ["in", "out"]},
    "override_until": {"type": "string", "description": "Present while an operator override "
                       "decides presence: when it ends (ISO-8601 UTC)."},
}, ["presence"])
OUTPUT_SCHEMAS = {
    "list_todos": _output_schema({
        "todos": {"type": "array", "items": _TODO_OUTPUT},
        "next_cursor": {**_NULLABLE_STRING, "description": "Pass as cursor for the next page."},
        "has_more": {"type": "boolean"},
    }, ["todos", "next_cursor", "has_more"]),
    "claim": _output_schema({"todo": _TODO_OUTPUT, "todo_token": _TODO_TOKEN_OUTPUT}, ["todo"]),
    "claim_next": _output_schema({
        "todo": _TODO_OUTPUT, "todo_token": _TODO_TOKEN_OUTPUT, "empty": {"type": "boolean"},
        "paused": {"type": "array", "items": {"type": "string"},
                   "description": 'With empty: every queue asked for is paused ("*": all).'},
        "at_capacity": {"type": "boolean",
                        "description": "With empty: work waits, but as many todos are claimed "
                                       "as the endpoint's (or the queue's) cap allows."},
        "over_budget": {"type": "boolean",
                        "description": "With empty: the endpoint's daily budget is spent; work "
                                       "waits for the next UTC day or a raised budget."},
    }, ["todo"], ["empty"]),
    "heartbeat": _output_schema({
        "todo": _TODO_OUTPUT,
        "followups": {"type": "array", "items": {"type": "object"},
                      "description": "Follow-ups this lease had not been given yet, in order."},
        "cancel_requested": {"type": "boolean",
                             "description": "true: stop, then cancel (or complete if done)."},
    }, ["todo", "followups", "cancel_requested"]),
    "complete": _TODO_RESULT,
    "cancel": _TODO_RESULT,
    "fail": _TODO_RESULT,
    "release": _TODO_RESULT,
    "post_update": _TODO_RESULT,
    "repo_token": _output_schema({
        "token": {"type": "string"}, "expires_at": {"type": "string"},
        "repository": {"type": "string", "description": "owner/name"},
        "permissions": {"type": "object", "additionalProperties": {"type": "string"}},
    }, ["token", "expires_at", "repository", "permissions"]),
    "read_secret": _output_schema({"ref": {"type": "string"}, "value": {"type": "string"}},
                                  ["ref", "value"]),
    "clock_in": _PRESENCE_RESULT,
    "clock_out": _PRESENCE_RESULT,
}
assert set(OUTPUT_SCHEMAS) == set(TOOL_SCHEMAS)

# (title, read-only, idempotent). Idempotent means a repeat with the same arguments has no
# further effect: heartbeat/complete/fail/release act on one lease (a repeat is refused or
# re-extends it); claim and claim_next take a new lease (an attempt) each time.
_TOOL_TRAITS = {
    "list_todos": ("List todos", True, True),
    "claim": ("Claim a todo", False, False),
    "claim_next": ("Claim the next todo", False, False),
    "heartbeat": ("Extend a lease", False, True),
    "complete": ("Complete a todo", False, True),
    "fail": ("Fail a todo", False, True),
    "cancel": ("Cancel a held todo", False, True),
    "release": ("Release a todo", False, True),
    "post_update": ("Post a progress update", False, False),
    "repo_token": ("Get a repository token", False, True),
    "read_secret": ("Read a secret", True, True),
    "clock_in": ("Clock in", False, True),
    "clock_out": ("Clock out", False, True),
}
assert set(_TOOL_TRAITS) == set(TOOL_SCHEMAS)


def tool_annotations(name: str) -> types.ToolAnnotations:
    title, read_only, idempotent = _TOOL_TRAITS[name]
    # Nothing here destroys data (done todos are kept as audit) or reaches outside switchboard.
    return types.ToolAnnotations(title=title, read_only_hint=read_only, destructive_hint=False,
                                 idempotent_hint=idempotent, open_world_hint=False)


# What a session opened with a todo token may call, on its one todo
# (docs/security.md#the-todo-token). ``cancel`` is named before it is a tool of every server.
TODO_TOKEN_VERBS = frozenset({"heartbeat", "complete", "fail", "release", "cancel",
                              "post_update", "read_secret", "repo_token"})


def offers(endpoint, name: str) -> bool:
    """Whether a session of ``endpoint`` may call tool ``name``: its verb allowlist, narrowed
    to TODO_TOKEN_VERBS for a todo token's session. ``repo_token`` is no endpoint verb: each
    route grants it (``--agent-permissions``), to any endpoint that may work a lease."""
    if getattr(endpoint, "todo_grant", None) is not None and name not in TODO_TOKEN_VERBS:
        return False
    return endpoint.allows("heartbeat" if name == "repo_token" else name)


def tools_for(endpoint) -> list[types.Tool]:
    """The tools this endpoint's verb allowlist grants, in a stable order."""
    return [
        types.Tool(name=name, title=_TOOL_TRAITS[name][0], description=description,
                   input_schema=schema, output_schema=OUTPUT_SCHEMAS[name],
                   annotations=tool_annotations(name))
        for name, (description, schema) in TOOL_SCHEMAS.items()
        if offers(endpoint, name)
    ]


def list_tools_result(endpoint) -> types.ListToolsResult:
    return types.ListToolsResult(tools=tools_for(endpoint))

