"""The MCP request handlers: each HTTP method's sync function, run in one thread hop by the
shell (``shell.McpEndpoint._sync``), so auth, rate limit, session check and the tool call share
that hop and a tool call costs one thread switch. ``answer_post`` answers one JSON-RPC message
(``initialize`` opens a session, the rest are dispatched on a live one); ``answer_delete`` ends
a session. The notification stream's GET is ``stream.open_stream``.

Order of checks on every request: method (405) → body size (413) → Origin (403) → bearer
(401) → rate limit (429) → Accept (406) → protocol version (400) → JSON-RPC framing (400) →
session (400 missing / 404 unknown, terminated or another endpoint's).
"""

import json
import logging

from channels_push.sessions import transitions as session_transitions
from switchboard.http import plain

from . import framing, instructions, longpoll, schemas, security, tools
from .framing import (LATEST_PROTOCOL_VERSION, SUPPORTED_PROTOCOL_VERSIONS, Answer, accepts, fault,
                      json_answer)

log = logging.getLogger("switchboard.mcp")

LOG_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")


def _content_type_is_json(header: str | None) -> bool:
    return (header or "").split(";")[0].strip().lower() == "application/json"


def _live_session(request: plain.Request, endpoint):
    """(session_id, None) for a live session of ``endpoint``, else (None, 400/404 Answer).
    The session was read with the bearer (``find_endpoint_with_session``); this only turns
    that into an answer and refreshes the session's last-seen time when it is due."""
    session_id = request.header("mcp-session-id")
    if not session_id:
        return None, fault(400, "Bad Request: Mcp-Session-Id header is required; "
                                "send initialize first")
    if not endpoint.session_live or not session_transitions.touch_session(
            endpoint=endpoint, session_id=session_id, fresh=endpoint.session_fresh):
        return None, fault(404, "Not Found: unknown or terminated session; initialize again")
    return session_id, None


def _initialize(endpoint, message) -> Answer:
    params = message.params or {}
    requested = params.get("protocolVersion")
    if not isinstance(requested, str):
        return fault(400, "Invalid params: initialize needs protocolVersion",
                     code=framing.INVALID_PARAMS, request_id=message.id)
    # Agree to the client's version when we speak it, else counter-offer our latest.
    version = requested if requested in SUPPORTED_PROTOCOL_VERSIONS else LATEST_PROTOCOL_VERSION
    client_info = params.get("clientInfo")
    client_info = client_info if isinstance(client_info, dict) else {}
    session = session_transitions.open_session(
        endpoint=endpoint, protocol_version=version,
        client_name=client_info.get("name"), client_version=client_info.get("version"),
    )
    log.info("mcp session opened", extra={"endpoint": endpoint.slug, "session": session.pk[:8],
                                          "protocol_version": version,
                                          "evicted": len(session.evicted_ids)})
    result = instructions.initialize_result(endpoint, version)
    answer = json_answer(200, framing.result_envelope(message.id, result),
                         {"Mcp-Session-Id": session.pk})
    answer.evicted_sessions = session.evicted_ids
    return answer


def _dispatch(endpoint, session_id: str, message) -> dict:
    if message.method == "ping":
        return framing.result_envelope(message.id, {})
    if message.method == "tools/list":
        return framing.result_envelope(message.id, schemas.list_tools_result(endpoint))
    if message.method == "logging/setLevel":
        # Accepted so generic clients can set it; this server sends no log notifications (its
        # logs are operator-side, key=value, and never carry agent data), so there is nothing
        # to filter and no level to keep.
        level = (message.params or {}).get("level")
        if level not in LOG_LEVELS:
            return framing.error_envelope(message.id, framing.INVALID_PARAMS,
                                          f"Invalid params: level must be one of {list(LOG_LEVELS)}")
        return framing.result_envelope(message.id, {})
    if message.method == "tools/call":
        try:
            result = tools.call_tool(endpoint=endpoint, session_id=session_id,
                                     params=message.params)
        except framing.JsonRpcError as error:
            return framing.error_envelope(message.id, error.code, error.message)
        return framing.result_envelope(message.id, result)
    return framing.error_envelope(message.id, framing.METHOD_NOT_FOUND,
                                  f"Method not found: {message.method}")


def answer_post(request: plain.Request, *, woken: bool = False) -> Answer:
    """One JSON-RPC message in, one JSON answer out (or 202 for notifications/responses).
    A long poll that was woken runs its request again (``woken``): bearer, session and the
    claim are all checked afresh, since any of them may have changed while it waited."""
    endpoint, refusal = security.authorize(request, rate_limited=not woken)
    if refusal:
        return refusal
    if not accepts(request.header("accept"), "application/json"):
        return fault(406, "Not Acceptable: Accept must include application/json "
                          "(and text/event-stream)")
    if not _content_type_is_json(request.header("content-type")):
        return fault(415, "Unsupported Media Type: Content-Type must be application/json")
    version = request.header("mcp-protocol-version")
    if version is not None and version not in SUPPORTED_PROTOCOL_VERSIONS:
        return framing.version_refusal(version, framing.request_id_of(request.body))
    try:
        message = framing.parse_message(request.body)
    except framing.JsonRpcError as error:
        return fault(400, error.message, code=error.code, request_id=error.request_id)
    if message.kind == "request" and message.method == "initialize":
        return _initialize(endpoint, message)
    if message.method == "server/discover" and not request.header("mcp-session-id"):
        return framing.version_refusal(version or "unknown", message.id)
    session_id, refusal = _live_session(request, endpoint)
    if refusal:
        return refusal
    if message.kind != "request":
        return Answer(202, headers={"Mcp-Session-Id": session_id})
    envelope = _dispatch(endpoint, session_id, message)
    answer = json_answer(200, envelope, {"Mcp-Session-Id": session_id})
    if message.method == "tools/call" and "result" in envelope:
        answer.long_poll = longpoll.long_poll_of(endpoint, message.params, envelope["result"],
                                                 session_id=session_id)
        meta = (message.params or {}).get("_meta")
        answer.progress_token = meta.get("progressToken") if isinstance(meta, dict) else None
    return answer


def release_claim_of_departed_client(request: plain.Request, answer: Answer) -> None:
    """The client of a woken long poll left between the claim and its answer: the claim is
    given back (the bearer is checked again: a client gone is no reason to act for a revoked
    one)."""
    endpoint, refusal = security.authorize(request, rate_limited=False)
    if refusal:
        return
    released = longpoll.release_undelivered_claim(
        endpoint, answer.headers["Mcp-Session-Id"], json.loads(answer.body))
    if released is not None:
        log.info("mcp long poll client left after its claim; released",
                 extra={"slug": request.slug, "todo_id": released})


def answer_delete(request: plain.Request) -> Answer:
    """End the session; its streams (on any process) are closed by the caller's group send."""
    endpoint, refusal = security.authorize(request)
    if refusal:
        return refusal
    session_id = request.header("mcp-session-id")
    if not session_id:
        return fault(400, "Bad Request: Mcp-Session-Id header is required")
    if not security.SESSION_ID_RE.match(session_id) or not session_transitions.terminate_session(
            endpoint=endpoint, session_id=session_id):
        return fault(404, "Not Found: unknown or terminated session")
    log.info("mcp session ended", extra={"endpoint": endpoint.slug, "session": session_id[:8]})
    return Answer(204, terminated_session=session_id)
