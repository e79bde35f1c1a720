"""The vended MCP endpoint, ``/mcp/<endpoint_slug>``: MCP Streamable HTTP (CONTRACT §6).

Why the transport and session layer are ours: the ``mcp`` SDK's Streamable HTTP server keeps
each session (its streams, its negotiated state) in one process's memory, so a restart forgets
every session and a second web process answers 404 to sessions the first one minted. switchboard
runs any number of daphne processes without sticky routing, and an agent's session must
survive a deploy. So sessions are database rows (``McpSession``), every request re-checks its
session there, and server-to-client notifications travel over the channel layer (Redis) to
whichever process holds the session's stream. What we take from the SDK is what does not care
where state lives: the wire types (``mcp.types``) for every envelope, result and tool schema.

Layout: each HTTP method is answered by a plain sync function (``answer_post``,
``answer_delete``, ``open_stream``) that runs in one thread hop (``McpEndpoint._sync``) —
auth, rate limit, session check and the tool call share that hop, so a tool call costs one
thread switch.
``McpEndpoint`` is the thin ASGI application around them: it reads the capped body, writes the
answer, and runs the long-lived notification stream (GET) and the long poll (a claim_next with
``wait_seconds`` that found nothing waits in ``longpoll``'s wait room, answering over SSE).

Order of checks on every request: method (405) → body size (413) → Origin (403) → bearer
(401) → rate limit (429) → Accept (406) → protocol version (400) → JSON-RPC framing (400) →
session (400 missing / 404 unknown, terminated or another endpoint's).
"""

import asyncio
import functools
import json
import logging
import re
import time
from dataclasses import dataclass, field
from datetime import timedelta

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import DatabaseError

from endpoints.models import hash_credential

from switchboard import health, metrics, ratelimit
from switchboard.http import origins, plain

from . import longpoll, mcp_framing, mcp_tools
from channels_push.doorbells import doorbells
from channels_push.bus import group_reader
from .sessions import transitions as session_transitions
from channels_push.bus.groups import NOTIFY_MESSAGE_TYPE, TERMINATE_MESSAGE_TYPE, session_group
from channels_push.doorbells.doorbells import CHANNEL_METHOD
from .stream_heartbeat import StreamHeartbeat

log = logging.getLogger("switchboard.mcp")

# /mcp/<endpoint_slug>, with an optional trailing slash served as is: never a redirect
# (clients must not follow redirects on POST).
ROUTE_PATTERN = r"^mcp/(?P<slug>[-a-zA-Z0-9_]+)/?$"
# The session-based (handshake) protocol versions only, on purpose: Claude Code turns channels
# off on the stateless 2026-07-28 protocol, so offering it would silence every doorbell. A
# client probing for it gets the refusal below, which lists these, and falls back to initialize.
SUPPORTED_PROTOCOL_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26")
LATEST_PROTOCOL_VERSION = SUPPORTED_PROTOCOL_VERSIONS[0]
ALLOWED_METHODS = "GET, POST, DELETE"
# Keep-alive comments on a stream (settings.SWITCHBOARD_STREAM_KEEPALIVE_SECONDS, default
# 15 s: below the 30-60 s idle cut of common proxies). The process's stream heartbeat
# re-checks every held session's credential at the same interval (one query for all), so this
# is also how soon a revoked stream closes (CONTRACT §12).
KEEPALIVE_SECONDS = 15.0
# Reconnect hint sent on every stream: long enough not to hammer a restarting server.
RETRY_HINT_MS = 3000
# A request refreshes its session's last-seen time at most this often (the idle limit is an
# hour; see transitions.touch_session for why not on every call).
SESSION_TOUCH_INTERVAL = timedelta(seconds=30)
# Frames a stream holds for a client that reads slower than doorbells arrive. Beyond this the
# stream drops the new frame (and logs it) instead of growing without bound or slowing the
# channel layer: the queue is the ledger, a missed doorbell costs nothing but latency.
STREAM_BUFFER_FRAMES = 100
# Mcp-Session-Id values we mint are 43 URL-safe characters; anything that is not visible ASCII
# or is longer than the column cannot be one of ours.
SESSION_ID_RE = re.compile(r"^[\x21-\x7e]{1,64}$")
LOG_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")


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
    evicted_sessions: list = field(default_factory=list)
    # Set when a tools/call may wait (a claim_next with wait_seconds that found nothing): the
    # body is what to answer at the deadline; the async layer waits and re-runs the request
    # when woken (McpEndpoint._long_poll).
    long_poll: mcp_tools.LongPoll | None = None
    progress_token: str | int | None = None


def _json_answer(status: int, payload, headers=None) -> Answer:
    return Answer(status, mcp_framing.encode_json(payload),
                  {"Content-Type": "application/json", **(headers or {})})


def _fault(status: int, message: str, *, code=mcp_framing.INVALID_REQUEST, request_id=None,
           data=None, headers=None) -> Answer:
    """An HTTP-level refusal with a JSON-RPC error body (the SDK client surfaces it as is)."""
    return _json_answer(status, mcp_framing.error_envelope(request_id, code, message, data), headers)


# -- checks (pure) -----------------------------------------------------------------------------


def origin_allowed(origin: str | None) -> bool:
    """Absent Origin (non-browser clients) is allowed. A present one must equal, as (scheme,
    host, port), one of SWITCHBOARD_ALLOWED_ORIGINS (the public URL's origin plus the configured
    extras): that is what stops a web page — another local port, a rebound DNS name — from
    driving an agent's endpoint. Anything unparseable, ``null`` included, is refused."""
    if origin is None:
        return True
    parsed = origins.parse_origin(origin)
    return parsed is not None and parsed in settings.SWITCHBOARD_ALLOWED_ORIGINS


def bearer_of(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


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


def _content_type_is_json(header: str | None) -> bool:
    return (header or "").split(";")[0].strip().lower() == "application/json"


# -- sync handlers (one thread hop each: McpEndpoint._sync) --------------------------------------


# Bearer digests this process accepted, and until when they pass an address's failure block:
# only a lookup hint (every request still checks its credential in the database), bounded.
ACCEPTED_BEARER_MEMORY_SECONDS = 600.0
_accepted_bearers: dict[str, float] = {}


def _recently_accepted(digest: str) -> bool:
    return bool(digest) and _accepted_bearers.get(digest, 0.0) > time.monotonic()


def _note_accepted(digest: str) -> None:
    _accepted_bearers.pop(digest, None)  # re-insert: dict order is recency
    _accepted_bearers[digest] = time.monotonic() + ACCEPTED_BEARER_MEMORY_SECONDS
    while len(_accepted_bearers) > ratelimit.MAX_LOCAL_BUCKETS:
        _accepted_bearers.pop(next(iter(_accepted_bearers)))


def _authorize(request: plain.Request, *, rate_limited: bool = True):
    """Origin, bearer, rate limit. Returns (endpoint, None) or (None, refusal Answer). The
    request's session is read in the same statement as the bearer (see ``_live_session``).
    ``rate_limited=False``: a woken long poll re-checks its bearer without taking a second
    token for the one request it is."""
    if not origin_allowed(request.header("origin")):
        return None, _fault(403, "Forbidden: Origin not allowed")
    credential = bearer_of(request.header("authorization"))
    digest = hash_credential(credential) if credential else ""
    # Unknown slugs and bad bearers spend their client address's budget (§12), not a query. A
    # bearer this process accepted recently is let through to its (uncached) check even then:
    # a flood of bad bearers from an address (a NAT, a CI runner, a stale runner after a
    # rotation) must not lock out the good agents behind it.
    refused = ratelimit.refuse_failing_client("mcp-auth", request.client)
    if not refused.allowed and not _recently_accepted(digest):
        return None, _fault(429, "Too Many Requests",
                            headers={"Retry-After": str(refused.retry_after_seconds)})
    endpoint = session_transitions.find_endpoint_with_session(
        slug=request.slug, credential=credential or "", session_id=_session_id_of(request),
        fresh_within=SESSION_TOUCH_INTERVAL)
    if endpoint is None:
        refused = ratelimit.charge_client_failure(
            "mcp-auth", request.client, per_minute=settings.SWITCHBOARD_UNKNOWN_CLIENT_PER_MINUTE)
        if not refused.allowed:
            return None, _fault(429, "Too Many Requests",
                                headers={"Retry-After": str(refused.retry_after_seconds)})
        # Same answer for a missing, wrong, expired or other endpoint's credential.
        return None, _fault(401, "Unauthorized: a valid bearer credential for this endpoint "
                                 "is required", headers={"WWW-Authenticate": 'Bearer realm="switchboard"'})
    _note_accepted(digest)
    if not rate_limited:
        return endpoint, None
    decision = ratelimit.take_token("mcp", digest,
                                      per_minute=settings.SWITCHBOARD_MCP_RATE_PER_MINUTE)
    if not decision.allowed:
        log.info("mcp rate limited", extra={"endpoint": endpoint.slug})
        return None, _fault(429, "Too Many Requests",
                            headers={"Retry-After": str(decision.retry_after_seconds)})
    return endpoint, None


def _session_id_of(request: plain.Request) -> str | None:
    """The Mcp-Session-Id header when it could be one of ours, else None."""
    session_id = request.header("mcp-session-id")
    return session_id if session_id and SESSION_ID_RE.match(session_id) else None


def _version_refusal(version: str, request_id=None) -> Answer:
    # -32022 with the versions we speak: a client probing a newer, sessionless era (the SDK's
    # server/discover at 2026-07-28) reads these handshake versions and falls back to
    # initialize; any other client learns what to send.
    return _fault(400, f"Unsupported protocol version: {version}",
                  code=mcp_framing.UNSUPPORTED_PROTOCOL_VERSION, request_id=request_id,
                  data={"supported": list(SUPPORTED_PROTOCOL_VERSIONS), "requested": version})


def _live_session(request: plain.Request, endpoint):
    """(session_id, None) for a live session of ``endpoint``, else (None, 400/404 Answer).
    The session was read with the bearer (``find_endpoint_with_session``); this only turns
    that into an answer and refreshes the session's last-seen time when it is due."""
    session_id = request.header("mcp-session-id")
    if not session_id:
        return None, _fault(400, "Bad Request: Mcp-Session-Id header is required; "
                                 "send initialize first")
    if not endpoint.session_live or not session_transitions.touch_session(
            endpoint=endpoint, session_id=session_id, fresh=endpoint.session_fresh):
        return None, _fault(404, "Not Found: unknown or terminated session; initialize again")
    return session_id, None


def _initialize(endpoint, message) -> Answer:
    params = message.params or {}
    requested = params.get("protocolVersion")
    if not isinstance(requested, str):
        return _fault(400, "Invalid params: initialize needs protocolVersion",
                      code=mcp_framing.INVALID_PARAMS, request_id=message.id)
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
    result = mcp_tools.initialize_result(endpoint, version)
    answer = _json_answer(200, mcp_framing.result_envelope(message.id, result),
                          {"Mcp-Session-Id": session.pk})
    answer.evicted_sessions = session.evicted_ids
    return answer


def _dispatch(endpoint, session_id: str, message) -> dict:
    if message.method == "ping":
        return mcp_framing.result_envelope(message.id, {})
    if message.method == "tools/list":
        return mcp_framing.result_envelope(message.id, mcp_tools.list_tools_result(endpoint))
    if message.method == "logging/setLevel":
        # Accepted so generic clients can set it; this server sends no log notifications (its
        # logs are operator-side, key=value, and never carry agent data), so there is nothing
        # to filter and no level to keep.
        level = (message.params or {}).get("level")
        if level not in LOG_LEVELS:
            return mcp_framing.error_envelope(message.id, mcp_framing.INVALID_PARAMS,
                                              f"Invalid params: level must be one of {list(LOG_LEVELS)}")
        return mcp_framing.result_envelope(message.id, {})
    if message.method == "tools/call":
        try:
            result = mcp_tools.call_tool(endpoint=endpoint, session_id=session_id,
                                         params=message.params)
        except mcp_tools.ToolCallError as error:
            return mcp_framing.error_envelope(message.id, error.code, error.message)
        return mcp_framing.result_envelope(message.id, result)
    return mcp_framing.error_envelope(message.id, mcp_framing.METHOD_NOT_FOUND,
                                      f"Method not found: {message.method}")


def answer_post(request: plain.Request, *, woken: bool = False) -> Answer:
    """One JSON-RPC message in, one JSON answer out (or 202 for notifications/responses).
    A long poll that was woken runs its request again (``woken``): bearer, session and the
    claim are all checked afresh, since any of them may have changed while it waited."""
    endpoint, refusal = _authorize(request, rate_limited=not woken)
    if refusal:
        return refusal
    if not accepts(request.header("accept"), "application/json"):
        return _fault(406, "Not Acceptable: Accept must include application/json "
                           "(and text/event-stream)")
    if not _content_type_is_json(request.header("content-type")):
        return _fault(415, "Unsupported Media Type: Content-Type must be application/json")
    version = request.header("mcp-protocol-version")
    if version is not None and version not in SUPPORTED_PROTOCOL_VERSIONS:
        return _version_refusal(version, mcp_framing.request_id_of(request.body))
    try:
        message = mcp_framing.parse_message(request.body)
    except mcp_framing.FramingError as error:
        return _fault(400, error.message, code=error.code, request_id=error.request_id)
    if message.kind == "request" and message.method == "initialize":
        return _initialize(endpoint, message)
    if message.method == "server/discover" and not request.header("mcp-session-id"):
        return _version_refusal(version or "unknown", message.id)
    session_id, refusal = _live_session(request, endpoint)
    if refusal:
        return refusal
    if message.kind != "request":
        return Answer(202, headers={"Mcp-Session-Id": session_id})
    envelope = _dispatch(endpoint, session_id, message)
    answer = _json_answer(200, envelope, {"Mcp-Session-Id": session_id})
    if message.method == "tools/call" and "result" in envelope:
        answer.long_poll = mcp_tools.long_poll_of(endpoint, message.params, envelope["result"],
                                                  session_id=session_id)
        meta = (message.params or {}).get("_meta")
        answer.progress_token = meta.get("progressToken") if isinstance(meta, dict) else None
    return answer


def release_claim_of_departed_client(request: plain.Request, answer: Answer) -> None:
    """The client of a woken long poll left between the claim and its answer: the claim is
    given back (the bearer is checked again: a client gone is no reason to act for a revoked
    one)."""
    endpoint, refusal = _authorize(request, rate_limited=False)
    if refusal:
        return
    released = mcp_tools.release_undelivered_claim(
        endpoint, answer.headers["Mcp-Session-Id"], json.loads(answer.body))
    if released is not None:
        log.info("mcp long poll client left after its claim; released",
                 extra={"slug": request.slug, "todo_id": released})


def answer_delete(request: plain.Request) -> Answer:
    """End the session; its streams (on any process) are closed by the caller's group send."""
    endpoint, refusal = _authorize(request)
    if refusal:
        return refusal
    session_id = request.header("mcp-session-id")
    if not session_id:
        return _fault(400, "Bad Request: Mcp-Session-Id header is required")
    if not SESSION_ID_RE.match(session_id) or not session_transitions.terminate_session(
            endpoint=endpoint, session_id=session_id):
        return _fault(404, "Not Found: unknown or terminated session")
    log.info("mcp session ended", extra={"endpoint": endpoint.slug, "session": session_id[:8]})
    return Answer(204, terminated_session=session_id)


def open_stream(request: plain.Request, heartbeat: StreamHeartbeat | None = None) -> Answer:
    """Checks for GET; on success counts the stream on the session (attached to this process's
    ``heartbeat`` host, whose lease then keeps it counting as open) and says which to open."""
    endpoint, refusal = _authorize(request)
    if refusal:
        return refusal
    if not accepts(request.header("accept"), "text/event-stream"):
        return _fault(406, "Not Acceptable: Accept must include text/event-stream")
    version = request.header("mcp-protocol-version")
    if version is not None and version not in SUPPORTED_PROTOCOL_VERSIONS:
        return _version_refusal(version)
    session_id = request.header("mcp-session-id")
    if not session_id:
        return _fault(400, "Bad Request: Mcp-Session-Id header is required")
    # Read once: the heartbeat may take a new host id at any moment (``lapsed``), and the
    # attachment and the answer must name the same one.
    host_id = heartbeat.host_id if heartbeat is not None else None
    attached = SESSION_ID_RE.match(session_id) and session_transitions.attach_stream(
        endpoint=endpoint, session_id=session_id, host_id=host_id)
    if attached == "full":
        # Refused rather than closing the oldest: a client that reconnects in a loop must not
        # knock out its own working stream (CONTRACT §12 cap; README "Security model").
        return _fault(409, "Conflict: this session already has the maximum of "
                           f"{settings.SWITCHBOARD_MAX_OPEN_STREAMS} open streams; close one "
                           "or initialize another session")
    if not attached:
        return _fault(404, "Not Found: unknown or terminated session")
    return Answer(200, stream_session=session_id, stream_endpoint_id=endpoint.pk,
                  stream_host=host_id)


def transport_backlog_bytes(send) -> int | None:
    """Bytes this response has handed to the server that the socket has not yet taken: what a
    client that stopped reading leaves piling up in the server's memory. daphne's ``send``
    never pushes back (it is ``functools.partial(Server.handle_reply, protocol)``, and the
    protocol writes straight into its Twisted transport), so the stream asks the transport:
    a Twisted ``FileDescriptor`` keeps unsent bytes in ``dataBuffer`` (from ``offset``) plus
    ``_tempDataLen`` (see twisted.internet.abstract). None when ``send`` is not daphne's
    (test communicators, another server): then only the frame bound applies."""
    protocol = send.args[0] if isinstance(send, functools.partial) and send.args else None
    transport = getattr(getattr(protocol, "channel", None), "transport", None)
    try:
        return len(transport.dataBuffer) - transport.offset + transport._tempDataLen
    except (AttributeError, TypeError):
        return None


def ring_reconnected_stream(endpoint_id: int, session_id: str) -> list:
    """The doorbells a freshly opened stream gets at once (see doorbells.reconnect_frames)."""
    return doorbells.reconnect_frames(endpoint_id=endpoint_id, session_id=session_id)


def close_stream(session_id: str, host_id: str | None = None) -> None:
    session_transitions.detach_stream(session_id=session_id, host_id=host_id)


# -- the ASGI application ------------------------------------------------------------------------


class McpEndpoint:
    """ASGI app for ``/mcp/<slug>``. Not an AsyncHttpConsumer: that class opens a channel-layer
    channel for every request, a Redis round trip a POST never needs; only streams join the
    layer, here, by hand."""

    def __init__(self, *, keepalive_seconds: float | None = None,
                 thread_sensitive: bool = False, buffer_frames: int = STREAM_BUFFER_FRAMES,
                 buffer_bytes: int | None = None,
                 layer_retry_seconds: tuple = (group_reader.RETRY_FIRST_SECONDS,
                                               group_reader.RETRY_MAX_SECONDS)):
        self.keepalive_seconds = keepalive_seconds or settings.SWITCHBOARD_STREAM_KEEPALIVE_SECONDS
        self.layer_retry_seconds = layer_retry_seconds
        self.buffer_frames = buffer_frames
        # Unsent bytes (transport_backlog_bytes) beyond which a frame is dropped, not written.
        self.buffer_bytes = buffer_bytes
        # Requests run their sync handler in the thread pool, not Django's one shared sync
        # thread: they share no state but the database, and one thread would queue every
        # agent's tool call behind the others' database round trips. In-process tests pass
        # True so the handler sees the test's uncommitted transaction on the main thread.
        self.thread_sensitive = thread_sensitive
        self._wrapped = {}
        # This app's (in production: this process's) streams, re-checked and kept counting as
        # open by one heartbeat for all of them.
        self.heartbeat = StreamHeartbeat(interval_seconds=self.keepalive_seconds,
                                         thread_sensitive=thread_sensitive)

    def _sync(self, function):
        # One wrapper per function for the life of the app: building one checks the function
        # and copies its attributes, a cost worth paying once, not on every request. In the
        # thread pool the handlers take the lean hop (plain.in_thread_pool: the same
        # connection hygiene, without asgiref's context plumbing they do not use).
        wrapped = self._wrapped.get(function)
        if wrapped is None:
            wrapped = self._wrapped[function] = plain.sync_hop(
                function, thread_sensitive=self.thread_sensitive)
        return wrapped

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        request = plain.request_from_scope(scope)
        try:
            # Host before anything else, as every route does (plain.AllowedHostsOnly),
            # checked here on the request this call decodes anyway.
            if not plain.host_allowed(request, scope):
                await plain.send_answer(send, plain.host_refusal())
                return
            if request.method not in ("GET", "POST", "DELETE"):
                await plain.send_answer(send, _fault(
                    405, "Method Not Allowed", headers={"Allow": ALLOWED_METHODS}))
                return
            too_large = await plain.read_body(request, receive,
                                                   settings.SWITCHBOARD_MAX_BODY_BYTES)
            if too_large:
                await plain.send_answer(send, _fault(413, "Payload Too Large"))
                return
            if request.method == "POST":
                started = asyncio.get_running_loop().time()
                answer = await self._sync(answer_post)(request)
                if answer.long_poll is None:
                    await plain.send_answer(send, answer)
                else:
                    await self._long_poll(request, answer, started, receive, send)
                for session_id in answer.evicted_sessions:
                    await _close_session_streams(session_id)
            elif request.method == "DELETE":
                answer = await self._sync(answer_delete)(request)
                await plain.send_answer(send, answer)
                if answer.terminated_session:
                    await _close_session_streams(answer.terminated_session)
            else:
                answer = await self._sync(open_stream)(request, self.heartbeat)
                if answer.stream_session is None:
                    await plain.send_answer(send, answer)
                else:
                    await self._stream(answer, receive, send)
        except plain.ClientGone:
            return  # nobody to answer, and nothing was run
        except health.UNAVAILABLE_ERRORS as exc:
            # PostgreSQL unreachable (or failing): nothing was done, so say "retry" (503 +
            # Retry-After, as /hooks does), not 500; no traceback per request while it is down.
            await database_sync_to_async(health.note_database_unavailable)(
                exc, route="mcp", slug=request.slug, method=request.method)
            try:
                await plain.send_answer(send, _fault(
                    503, "Service Unavailable: the database is unreachable; retry",
                    code=mcp_framing.INTERNAL_ERROR, headers=health.unavailable_headers()))
            except Exception:  # the response had already started; nothing more to say
                pass
        except Exception:
            log.exception("mcp request failed", extra={"slug": request.slug,
                                                       "method": request.method})
            try:
                await plain.send_answer(send, _fault(500, "Internal error",
                                                          code=mcp_framing.INTERNAL_ERROR))
            except Exception:  # the response had already started; nothing more to say
                pass

    async def _stream(self, answer: Answer, receive, send):
        session_id, endpoint_id = answer.stream_session, answer.stream_endpoint_id
        layer = get_channel_layer()
        group = session_group(session_id)
        # This stream's own bounded buffer between the channel layer and the client (see
        # STREAM_BUFFER_FRAMES): the layer is drained at once into it, a full one drops.
        buffer = asyncio.Queue(maxsize=self.buffer_frames)
        # The channel currently in the group (None while the layer is unreachable); the
        # reader rejoins and updates it, the finally below leaves with whatever it holds.
        membership = {"channel": None}
        held = self.heartbeat.hold(session_id)
        if answer.stream_host != self.heartbeat.host_id:
            # The host lease lapsed between the attach (recorded on the old host id, which
            # nothing renews any more) and this hold, so ``lapsed`` could not close it: close
            # it now, as it would have. Its client reconnects under the new host id; the
            # finally below detaches the old attachment.
            held.ended.set()
        try:
            # Redis down: serve keep-alives and let the reader keep trying to join.
            membership["channel"] = await group_reader.join_groups(
                layer, [group], {"session": session_id[:8]})
            # The headers and the retry hint at once: the digest below reads every pending
            # row of the endpoint (seconds on a long queue), and a client (or proxy) whose
            # stream shows nothing for that long takes it for dead.
            await send({"type": "http.response.start", "status": 200,
                        "headers": _sse_headers(session_id)})
            # Headers go out with the first body bytes, so send some at once.
            await send({"type": "http.response.body", "more_body": True,
                        "body": mcp_framing.sse_comment("switchboard stream open")
                        + mcp_framing.sse_retry(RETRY_HINT_MS)})
            # Ring THIS stream (not the session's other streams) for work that waited while
            # nobody listened. After group_add, so a todo created meanwhile is not missed by
            # both paths (it may be counted by both: doorbells are at-least-once); queued
            # before the pump starts reading the group, so the digest is the first event the
            # client gets and every live doorbell comes after it.
            if held.ended.is_set():
                # Ending already (a lapsed host, above): the rings belong to the stream its
                # client opens next. Ringing here would spend them (the digest cooldown) on
                # frames this stream never sends.
                frames = []
            else:
                try:
                    frames = await self._sync(ring_reconnected_stream)(endpoint_id, session_id)
                except Exception:
                    log.exception("mcp reconnect rings failed",
                                  extra={"session": session_id[:8]})
                    frames = []
            for params, context in frames:
                offer_frame(buffer, mcp_framing.notification_envelope(
                    CHANNEL_METHOD, params), context)
            await self._pump(session_id, held, layer, group, membership, buffer, receive, send)
        finally:
            self.heartbeat.release(held)
            await group_reader.leave_groups(layer, [group], membership.get("channel"))
            try:
                await self._sync(close_stream)(session_id, answer.stream_host)
            except Exception:
                # The detach did not happen (the database unreachable at that moment), and this
                # process's host lease would count the stream as open for as long as the
                # process lives: doorbells would pick a session nobody listens on. Give the
                # host up instead (its other streams close and their clients reconnect); its
                # lease then runs out and the sweep deletes its attachments and recounts.
                log.exception("mcp stream detach failed; giving up this process's stream host",
                              extra={"session": session_id[:8]})
                if answer.stream_host == self.heartbeat.host_id:
                    self.heartbeat.lapsed("a stream's detach failed")

    async def _long_poll(self, request, answer: Answer, started: float, receive, send):
        """Answer a claim_next that waits (CONTRACT §6). The wait is this coroutine parked in
        the process's wait room: no thread, no database connection. Woken (a todo may be
        ready, or the re-check), it first makes sure the client is still there — a client
        that went away must not be handed a lease — then runs the request again in one
        thread hop (``database_sync_to_async`` refreshes old connections around it).

        When the client accepts text/event-stream the answer is an SSE response opened at
        once, with a keep-alive comment every SWITCHBOARD_LONG_POLL_KEEPALIVE_SECONDS (and
        ``notifications/progress`` when the call carried a progressToken), so proxies and
        clients that cut idle responses keep waiting; otherwise the JSON answer comes at
        the end. At the deadline: the last empty answer, ``{"empty": true}``."""
        loop = asyncio.get_running_loop()
        poll, request_id = answer.long_poll, mcp_framing.request_id_of(request.body)
        deadline = started + poll.wait_seconds
        keepalive_seconds = settings.SWITCHBOARD_LONG_POLL_KEEPALIVE_SECONDS
        streaming = accepts(request.header("accept"), "text/event-stream")
        room = longpoll.room()
        over_cap = room.over_cap(poll.session_id, poll.credential_id)
        if over_cap is not None:
            # Refused before waiting; the first claim found nothing, so nothing was written.
            log.info("mcp long poll refused: at its cap",
                     extra={"slug": request.slug, "session": (poll.session_id or "")[:8]})
            await plain.send_answer(send, _json_answer(200, mcp_framing.result_envelope(
                request_id, mcp_tools.refusal_result("at_capacity", over_cap)),
                {"Mcp-Session-Id": answer.headers["Mcp-Session-Id"]}))
            return
        waiter = room.add(poll.endpoint_id, poll.queues, started_at=started,
                          verified_only=poll.verified_only, at_capacity=poll.at_capacity,
                          session_id=poll.session_id, credential_id=poll.credential_id)
        disconnect = asyncio.ensure_future(receive())
        woken = asyncio.ensure_future(waiter.event.wait())
        try:
            if streaming:
                await send({"type": "http.response.start", "status": 200,
                            "headers": _sse_headers(answer.headers["Mcp-Session-Id"])})
                await send({"type": "http.response.body", "more_body": True,
                            "body": mcp_framing.sse_comment("waiting for a todo")})
            next_beat = loop.time() + keepalive_seconds
            while (now := loop.time()) < deadline:
                done, _ = await asyncio.wait({disconnect, woken},
                                             timeout=min(deadline, next_beat) - now,
                                             return_when=asyncio.FIRST_COMPLETED)
                if disconnect in done:
                    if disconnect.result().get("type") == "http.disconnect":
                        return  # nobody to answer; nothing was claimed for them
                    disconnect = asyncio.ensure_future(receive())
                    continue
                if woken in done:
                    # A disconnect already queued by the server lands in this turn of the loop.
                    await asyncio.sleep(0)
                    if disconnect.done():
                        continue
                    retried = await self._retry_long_poll(request, answer)
                    room.attempted(waiter, claimed=retried.long_poll is None,
                                   at_capacity=bool(retried.long_poll
                                                    and retried.long_poll.at_capacity))
                    woken = asyncio.ensure_future(waiter.event.wait())
                    answer = retried
                    if answer.long_poll is None:
                        break
                    continue
                if loop.time() >= next_beat:
                    next_beat += keepalive_seconds
                    if streaming:
                        await send({"type": "http.response.body", "more_body": True,
                                    "body": self._keepalive_frames(answer, poll, started)})
            if answer.long_poll is None:
                await asyncio.sleep(0)  # a disconnect the server already queued lands here
                if disconnect.done() and disconnect.result().get("type") == "http.disconnect":
                    await self._sync(release_claim_of_departed_client)(request, answer)
                    return
            if not streaming:
                await plain.send_answer(send, answer)
                return
            envelope = json.loads(answer.body)
            if envelope.get("id") is None:  # a refusal built before the id was read
                envelope["id"] = request_id
            await send({"type": "http.response.body", "more_body": False,
                        "body": mcp_framing.sse_event(envelope)})
        finally:
            room.remove(waiter)
            for task in (disconnect, woken):
                if not task.done():
                    task.cancel()

    async def _retry_long_poll(self, request, answer: Answer) -> Answer:
        """The woken request, run again; on a failure (the database gone for a moment) the
        poll keeps waiting with its last answer and the re-check tries again."""
        try:
            return await self._sync(answer_post)(request, woken=True)
        except Exception as exc:
            log.exception("mcp long poll retry failed", extra={"slug": request.slug})
            if isinstance(exc, DatabaseError):
                await database_sync_to_async(health.discard_broken_pooled_connections)()
            return answer

    @staticmethod
    def _keepalive_frames(answer: Answer, poll, started: float) -> bytes:
        frames = mcp_framing.sse_comment("keep-alive")
        if answer.progress_token is not None:
            waited = asyncio.get_running_loop().time() - started
            frames += mcp_framing.sse_event(mcp_framing.notification_envelope(
                "notifications/progress", {
                    "progressToken": answer.progress_token, "progress": round(waited, 3),
                    "total": poll.wait_seconds, "message": "waiting for a todo"}))
        return frames

    async def _pump(self, session_id, held, layer, group, membership, buffer, receive, send):
        # Set by a terminate message (DELETE, eviction) or by the process's heartbeat when the
        # session lost its rights (CONTRACT §12): either way the stream ends.
        terminated = held.ended

        async def on_message(message) -> bool:
            if message.get("type") == TERMINATE_MESSAGE_TYPE:
                terminated.set()
                return True
            if message.get("type") == NOTIFY_MESSAGE_TYPE:
                offer_frame(buffer, message["message"],
                            message.get("context") or {"session": session_id[:8]})
            return False

        # Moves this stream's channel-layer messages into its buffer as they arrive; while
        # the layer is unreachable (at open, or lost later) it keeps rejoining, so doorbells
        # resume when Redis returns.
        reader = asyncio.ensure_future(group_reader.follow_groups(
            layer, [group], membership, on_message, {"session": session_id[:8]},
            retry_seconds=self.layer_retry_seconds))
        disconnect = asyncio.ensure_future(receive())
        next_frame = asyncio.ensure_future(buffer.get())
        ended = asyncio.ensure_future(terminated.wait())
        loop = asyncio.get_running_loop()
        # Keep-alives run on a clock of their own, not only when the stream is idle. They cost
        # no query: the heartbeat re-checks every held session (and renews the lease that keeps
        # them counting as open) once per interval for the whole process.
        keepalive_due = loop.time() + self.keepalive_seconds
        bound = self.buffer_bytes or settings.SWITCHBOARD_STREAM_BUFFER_BYTES
        try:
            while True:
                done, _ = await asyncio.wait({disconnect, next_frame, ended},
                                             timeout=max(0.0, keepalive_due - loop.time()),
                                             return_when=asyncio.FIRST_COMPLETED)
                if disconnect in done:
                    if disconnect.result().get("type") == "http.disconnect":
                        return
                    disconnect = asyncio.ensure_future(receive())
                    continue
                if ended in done:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                if next_frame in done:
                    message, context = next_frame.result()
                    next_frame = asyncio.ensure_future(buffer.get())
                    body = mcp_framing.sse_event(message)
                    # A client that stopped reading: its unsent bytes sit in the server's
                    # memory (daphne's send never waits), so past the bound the frame is
                    # dropped here instead of piling up there (§7).
                    backlog = transport_backlog_bytes(send)
                    if backlog is not None and backlog + len(body) > bound:
                        drop_frame("stream backlog over its bound",
                                   {**context, "unsent_bytes": backlog})
                        continue
                    await send({"type": "http.response.body", "more_body": True, "body": body})
                    if message.get("method") == CHANNEL_METHOD:
                        metrics.DOORBELLS_SENT.inc()
                    continue
                if loop.time() < keepalive_due:
                    continue
                keepalive_due = loop.time() + self.keepalive_seconds
                backlog = transport_backlog_bytes(send)
                if backlog is None or backlog < bound:  # a stalled reader needs no keep-alive
                    await send({"type": "http.response.body", "more_body": True,
                                "body": mcp_framing.sse_comment("keep-alive")})
        finally:
            for task in (reader, disconnect, next_frame, ended):
                if task is not None and not task.done():
                    task.cancel()


def drop_frame(reason: str, context: dict) -> None:
    """A notification this stream will not write: one INFO line (ids only: endpoint slug,
    todo id, short session) and the doorbell drop counter."""
    log.info(f"doorbell dropped: {reason}", extra=context)
    metrics.DOORBELLS_DROPPED.inc()


def _sse_headers(session_id: str) -> list[tuple[bytes, bytes]]:
    """Response headers of an SSE answer: the GET stream and a waiting POST alike."""
    return [
        (b"content-type", b"text/event-stream"),
        (b"cache-control", b"no-cache, no-transform"),
        (b"x-accel-buffering", b"no"),  # nginx: do not buffer the stream
        (b"mcp-session-id", session_id.encode()),
    ]


def offer_frame(buffer: asyncio.Queue, message: dict, context: dict) -> bool:
    """Queue one notification for the client, or drop it (logged) when the buffer is full:
    never wait, so neither the channel layer nor the publisher is slowed by a slow reader."""
    try:
        buffer.put_nowait((message, context))
        return True
    except asyncio.QueueFull:
        drop_frame("stream buffer full", context)
        return False


async def _close_session_streams(session_id: str):
    try:
        await get_channel_layer().group_send(session_group(session_id),
                                             {"type": TERMINATE_MESSAGE_TYPE})
    except Exception as exc:  # the stream notices at its next keep-alive (session terminated)
        log.warning("mcp stream close not sent", extra={"session": session_id[:8],
                                                        "error": type(exc).__name__})
