"""Wire framing for the MCP endpoint: JSON-RPC envelopes and the HTTP answer an MCP request
gets (its SSE lines are ``switchboard.http.sse``'s, as every stream's).

The envelopes are pure sync functions, no I/O, so they are unit-tested on their own
(``channels_push/mcp/tests/test_framing.py``). Envelope shapes come from the ``mcp`` package's
wire types (``mcp.types``), so a field name can never drift from the SDK's.
"""

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mcp.types as types
from pydantic import BaseModel

from switchboard import json_input
from switchboard.http import plain

if TYPE_CHECKING:
    from .longpoll import LongPoll

PARSE_ERROR = types.PARSE_ERROR  # -32700
INVALID_REQUEST = types.INVALID_REQUEST  # -32600
METHOD_NOT_FOUND = types.METHOD_NOT_FOUND  # -32601
INVALID_PARAMS = types.INVALID_PARAMS  # -32602
INTERNAL_ERROR = types.INTERNAL_ERROR  # -32603
UNSUPPORTED_PROTOCOL_VERSION = types.UNSUPPORTED_PROTOCOL_VERSION  # -32022
# The session-based (handshake) protocol versions only, on purpose: Claude Code turns channels
# off on the stateless 2026-07-28 protocol, so offering it would silence every doorbell. A
# client probing for it gets the refusal below, which lists these, and falls back to initialize.
SUPPORTED_PROTOCOL_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26")
LATEST_PROTOCOL_VERSION = SUPPORTED_PROTOCOL_VERSIONS[0]


class JsonRpcError(Exception):
    """A request answered with a JSON-RPC error instead of a result: a message that cannot be
    handled as JSON-RPC (``parse_message``) or a malformed tools/call (``tools.call_tool``).
    ``code`` is the JSON-RPC error code and ``request_id`` the id when one could be read."""

    def __init__(self, code: int, message: str, request_id=None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass(frozen=True)
class Message:
    """One inbound JSON-RPC message. ``kind`` is request, notification or response."""

    kind: str
    method: str | None = None
    id: str | int | None = None
    params: dict | None = None


def _valid_id(value) -> bool:
    # JSON-RPC ids are strings or integers (MCP forbids null ids on requests); bool is not int.
    # A string the answer could not carry back (a lone surrogate, which UTF-8 cannot encode, or
    # a NUL) is no id: echoing it failed while the answer was encoded, a 500.
    if isinstance(value, str):
        return json_input.unstorable_reason(value) is None
    return isinstance(value, int) and not isinstance(value, bool)


def parse_message(body: bytes) -> Message:
    """Decode one JSON-RPC message from a POST body. Raises JsonRpcError with -32700 for
    unparseable JSON and -32600 for a batch, a non-object or a malformed envelope."""
    try:
        data = json_input.loads_strict(body)
    except (ValueError, UnicodeDecodeError):
        raise JsonRpcError(PARSE_ERROR, "Parse error: the body is not valid JSON") from None
    if isinstance(data, list):
        raise JsonRpcError(INVALID_REQUEST, "Invalid Request: batches are not supported")
    if not isinstance(data, dict):
        raise JsonRpcError(INVALID_REQUEST, "Invalid Request: expected a JSON-RPC object")
    request_id = data.get("id") if _valid_id(data.get("id")) else None
    if data.get("jsonrpc") != "2.0":
        raise JsonRpcError(INVALID_REQUEST, 'Invalid Request: "jsonrpc" must be "2.0"', request_id)
    if "method" in data:
        method, params = data["method"], data.get("params")
        if not isinstance(method, str) or not method:
            raise JsonRpcError(INVALID_REQUEST, "Invalid Request: method must be a string", request_id)
        # Refused before any answer repeats it ("Method not found: …" failed to encode).
        reason = json_input.unstorable_reason(method)
        if reason is not None:
            raise JsonRpcError(INVALID_REQUEST, f"Invalid Request: method {reason}", request_id)
        if params is not None and not isinstance(params, dict):
            # A request whose params is not an object is well-formed JSON-RPC with bad params:
            # -32602 (docs/reference.md#refusal-codes: a non-object params is a JSON-RPC error).
            raise JsonRpcError(INVALID_PARAMS, "Invalid params: params must be an object", request_id)
        if "id" not in data:
            return Message(kind="notification", method=method, params=params)
        if not _valid_id(data["id"]):
            raise JsonRpcError(INVALID_REQUEST, "Invalid Request: id must be a string (of valid "
                                                "Unicode, no NUL) or an integer")
        return Message(kind="request", method=method, id=data["id"], params=params)
    if ("result" in data) != ("error" in data) and "id" in data:
        return Message(kind="response", id=request_id)
    raise JsonRpcError(INVALID_REQUEST, "Invalid Request: not a request, notification or response",
                       request_id)


def request_id_of(body: bytes):
    """The id of the request in ``body`` when one can be read, else None: a refusal given
    before the message is handled (an unsupported protocol version) still echoes it."""
    try:
        return parse_message(body).id
    except JsonRpcError as error:
        return error.request_id


# Result fields the mcp types carry for the 2026-07-28 (sessionless) era only; the handshake-era
# versions this endpoint speaks do not define them, so they are left off the wire.
MODERN_ONLY_RESULT_FIELDS = ("resultType", "ttlMs", "cacheScope")


def dump_result(result) -> dict:
    """An mcp.types result model as its handshake-era wire dict."""
    data = result.model_dump(by_alias=True, mode="json", exclude_none=True)
    for field in MODERN_ONLY_RESULT_FIELDS:
        data.pop(field, None)
    return data


def result_envelope(request_id, result) -> dict:
    """A JSON-RPC success; ``result`` is an mcp.types model or a plain dict of JSON values.

    Built as the dict ``types.JSONRPCResponse(...).model_dump(by_alias=True, mode="json")``
    gives (``jsonrpc``, ``id``, ``result``; mcp/tests/test_framing.py pins the equality):
    validating the result into the model and dumping it again walked every tool answer twice
    more on every call."""
    if isinstance(result, BaseModel):
        result = dump_result(result)
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


def error_envelope(request_id, code: int, message: str, data=None) -> dict:
    error = types.ErrorData(code=code, message=message, data=data)
    return types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error).model_dump(
        by_alias=True, mode="json", exclude_none=True
    ) | {"id": request_id}  # id stays present, as null, when it could not be read


def notification_envelope(method: str, params: dict | None = None) -> dict:
    return types.JSONRPCNotification(jsonrpc="2.0", method=method, params=params).model_dump(
        by_alias=True, mode="json", exclude_none=True
    )


def encode_json(payload) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


# -- HTTP answers ------------------------------------------------------------------------------


@dataclass
class Answer(plain.Answer):
    # Set when a DELETE ended a session: the async layer closes its streams everywhere.
    terminated_session: str | None = None
    # Set when a GET may open its stream.
    stream_session: str | None = None
    stream_endpoint_id: int | None = None
    # The process's StreamHost the stream was attached to (its detach names it).
    stream_host: str | None = None
    # Sessions an initialize evicted over the per-credential cap: their streams are closed.
    evicted_sessions: list = dataclasses.field(default_factory=list)
    # Set when a tools/call may wait (a claim_next with wait_seconds that found nothing): the
    # body is what to answer at the deadline; the async layer waits and re-runs the request
    # when woken (McpEndpoint._long_poll).
    long_poll: "LongPoll | None" = None
    progress_token: str | int | None = None


def json_answer(status: int, payload, headers=None) -> Answer:
    return Answer(status, encode_json(payload),
                  {"Content-Type": "application/json", **(headers or {})})


def fault(status: int, message: str, *, code=INVALID_REQUEST, request_id=None,
          data=None, headers=None) -> Answer:
    """An HTTP-level refusal with a JSON-RPC error body (the SDK client surfaces it as is)."""
    return json_answer(status, error_envelope(request_id, code, message, data), headers)


def version_refusal(version: str, request_id=None) -> Answer:
    # -32022 with the versions we speak: a client probing a newer, sessionless era (the SDK's
    # server/discover at 2026-07-28) reads these handshake versions and falls back to
    # initialize; any other client learns what to send.
    return fault(400, f"Unsupported protocol version: {version}",
                 code=UNSUPPORTED_PROTOCOL_VERSION, request_id=request_id,
                 data={"supported": list(SUPPORTED_PROTOCOL_VERSIONS), "requested": version})


def _media_types(header: str | None) -> list[tuple[str, float]]:
    result = []
    for part in (header or "").split(","):
        media, *params = [p.strip() for p in part.split(";")]
        if not media:
            continue
        quality = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        result.append((media.lower(), quality))
    return result


@functools.lru_cache(maxsize=256)
def accepts(header: str | None, media_type: str) -> bool:
    """Does an Accept header admit ``media_type`` (exactly, by type wildcard, or */*)?
    Remembered per header text (bounded): a client sends the same Accept on every call."""
    kind = media_type.split("/")[0]
    return any(q > 0 and m in (media_type, f"{kind}/*", "*/*") for m, q in _media_types(header))
