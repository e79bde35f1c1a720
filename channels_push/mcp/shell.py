"""The vended MCP endpoint, ``/mcp/<endpoint_slug>``: MCP Streamable HTTP
(docs/reference.md#sessions-and-streams), as an ASGI shell (``McpEndpoint``) over the plain
sync answers of ``handlers`` and ``stream``, after the checks of ``security``. The transport and
its sessions are switchboard's own, database rows any web process serves, with the SDK's wire
types: docs/decisions/mcp-transport-of-our-own.md says why and how the package is laid out.
"""

import asyncio
import json
import logging
from datetime import timedelta

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import DatabaseError

from channels_push.bus import group_reader
from channels_push.bus.groups import NOTIFY_MESSAGE_TYPE, TERMINATE_MESSAGE_TYPE, session_group
from channels_push.doorbells.doorbells import CHANNEL_METHOD
from switchboard import health
from switchboard.db import pool_check
from switchboard.http import daphne_tuning, plain, sse, stream_pump

from . import framing, handlers, longpoll, stream, tools
from .framing import Answer, fault, json_answer

log = logging.getLogger("switchboard.mcp")

# /mcp/<endpoint_slug>, with an optional trailing slash served as is: never a redirect
# (clients must not follow redirects on POST).
ROUTE_PATTERN = r"^mcp/(?P<slug>[-a-zA-Z0-9_]+)/?$"
ALLOWED_METHODS = "GET, POST, DELETE"


class McpEndpoint:
    """ASGI app for ``/mcp/<slug>``. Not an AsyncHttpConsumer: that class opens a channel-layer
    channel for every request, a Redis round trip a POST never needs; only streams join the
    layer, here, by hand."""

    def __init__(self, *, keepalive_seconds: float | None = None,
                 thread_sensitive: bool = False, buffer_frames: int = stream.STREAM_BUFFER_FRAMES,
                 buffer_bytes: int | None = None,
                 layer_retry_seconds: tuple = (group_reader.RETRY_FIRST_SECONDS,
                                               group_reader.RETRY_MAX_SECONDS)):
        # Also the heartbeat's interval, so how soon a revoked stream closes.
        self.keepalive_seconds = keepalive_seconds or settings.SWITCHBOARD_STREAM_KEEPALIVE_SECONDS
        self.layer_retry_seconds = layer_retry_seconds
        self.buffer_frames = buffer_frames
        # Unsent bytes (transport_backlog_bytes) beyond which a frame is dropped, not written.
        self.buffer_bytes = buffer_bytes
        # The thread pool, not Django's one sync thread, which would queue every tool call behind
        # the others' round trips; in-process tests pass True to see their own transaction.
        self.thread_sensitive = thread_sensitive
        self._wrapped = {}
        # This app's (in production: this process's) streams, re-checked and kept counting as
        # open by one heartbeat for all of them.
        self.heartbeat = stream.StreamHeartbeat(interval_seconds=self.keepalive_seconds,
                                         thread_sensitive=thread_sensitive)

    def _sync(self, function):
        # One wrapper per function for the app's life (building one costs); in the thread pool
        # the lean hop, plain.in_thread_pool.
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
                await plain.send_answer(send, fault(
                    405, "Method Not Allowed", headers={"Allow": ALLOWED_METHODS}))
                return
            too_large = await plain.read_body(request, receive,
                                                   settings.SWITCHBOARD_MAX_BODY_BYTES)
            if too_large:
                await plain.send_answer(send, fault(413, "Payload Too Large"))
                return
            if request.method == "POST":
                started = asyncio.get_running_loop().time()
                answer = await self._sync(handlers.answer_post)(request)
                if answer.long_poll is None:
                    await plain.send_answer(send, answer)
                else:
                    await self._long_poll(request, answer, started, receive, send)
                for session_id in answer.evicted_sessions:
                    await _close_session_streams(session_id)
            elif request.method == "DELETE":
                answer = await self._sync(handlers.answer_delete)(request)
                await plain.send_answer(send, answer)
                if answer.terminated_session:
                    await _close_session_streams(answer.terminated_session)
            else:
                answer = await self._sync(stream.open_stream)(request, self.heartbeat)
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
                await plain.send_answer(send, plain.database_unavailable_answer(
                    payload=framing.error_envelope(
                        None, framing.INTERNAL_ERROR,
                        f"Service Unavailable: {plain.DATABASE_UNAVAILABLE_MESSAGE}")))
            except Exception:  # the response had already started; nothing more to say
                pass
        except Exception:
            log.exception("mcp request failed", extra={"slug": request.slug,
                                                       "method": request.method})
            try:
                await plain.send_answer(send, fault(500, "Internal error",
                                                         code=framing.INTERNAL_ERROR))
            except Exception:  # the response had already started; nothing more to say
                pass

    async def _stream(self, answer: Answer, receive, send):
        session_id, endpoint_id = answer.stream_session, answer.stream_endpoint_id
        layer = get_channel_layer()
        group = session_group(session_id)
        # This stream's own bounded buffer between the channel layer and the client (see
        # stream.STREAM_BUFFER_FRAMES): the layer is drained at once into it, a full one drops.
        buffer = asyncio.Queue(maxsize=self.buffer_frames)
        # The channel currently in the group (None while the layer is unreachable); the
        # reader rejoins and updates it, the finally below leaves with whatever it holds.
        membership = {"channel": None}
        held = self.heartbeat.hold(session_id)
        if answer.stream_host != self.heartbeat.host_id:
            # The host lease lapsed between the attach and this hold: close it as ``lapsed``
            # would have; its client reconnects under the new host id.
            held.ended.set()
        try:
            # Redis down: serve keep-alives and let the reader keep trying to join.
            membership["channel"] = await group_reader.join_groups(
                layer, [group], {"session": session_id[:8]})
            # The headers and the retry hint at once: the digest below reads every pending
            # row of the endpoint (seconds on a long queue), and a client (or proxy) whose
            # stream shows nothing for that long takes it for dead.
            await send({"type": "http.response.start", "status": 200,
                        "headers": stream.sse_headers(session_id)})
            # Headers go out with the first body bytes, so send some at once.
            await send({"type": "http.response.body", "more_body": True,
                        "body": sse.comment("switchboard stream open")
                        + sse.retry(stream.RETRY_HINT)})
            # Ring THIS stream for work that waited. After group_add, so nothing falls between
            # (a todo may be counted twice: at-least-once), and before the pump reads the group,
            # so the digest comes first.
            if held.ended.is_set():
                # Ending already: the rings (and the digest cooldown) belong to the stream its
                # client opens next.
                frames = []
            else:
                try:
                    frames = await self._sync(stream.ring_reconnected_stream)(
                        endpoint_id, session_id)
                except Exception:
                    log.exception("mcp reconnect rings failed",
                                  extra={"session": session_id[:8]})
                    frames = []
            for params, context in frames:
                stream.offer_frame(buffer, framing.notification_envelope(
                    CHANNEL_METHOD, params), context)
            await self._pump(session_id, held, layer, group, membership, buffer, receive, send)
        finally:
            self.heartbeat.release(held)
            await group_reader.leave_groups(layer, [group], membership.get("channel"))
            try:
                await self._sync(stream.close_stream)(session_id, answer.stream_host)
            except Exception:
                # Undetached, the stream would count as open while the process lives: give the
                # host up (its streams reconnect) and let the sweep recount.
                log.exception("mcp stream detach failed; giving up this process's stream host",
                              extra={"session": session_id[:8]})
                if answer.stream_host == self.heartbeat.host_id:
                    self.heartbeat.lapsed("a stream's detach failed")

    async def _long_poll(self, request, answer: Answer, started: float, receive, send):
        """Answer a claim_next that waits (docs/reference.md#long-poll). The wait is this
        coroutine parked in the process's wait room: no thread, no database connection. Woken
        (a todo may be ready, or the re-check), it first makes sure the client is still there
        — a client that went away must not be handed a lease — then runs the request again in
        one thread hop (``database_sync_to_async`` refreshes old connections around it).

        When the client accepts text/event-stream the answer is an SSE response opened at
        once, with a keep-alive comment every SWITCHBOARD_LONG_POLL_KEEPALIVE_SECONDS (and
        ``notifications/progress`` when the call carried a progressToken), so proxies and
        clients that cut idle responses keep waiting; otherwise the JSON answer comes at
        the end. At the deadline: the last empty answer, ``{"empty": true}``."""
        poll, request_id = answer.long_poll, framing.request_id_of(request.body)
        deadline = started + poll.wait_seconds
        keepalive_seconds = settings.SWITCHBOARD_LONG_POLL_KEEPALIVE_SECONDS
        streaming = framing.accepts(request.header("accept"), "text/event-stream")
        room = longpoll.room()
        over_cap = room.over_cap(poll.session_id, poll.credential_id)
        if over_cap is not None:
            # Refused before waiting; the first claim found nothing, so nothing was written.
            log.info("mcp long poll refused: at its cap",
                     extra={"slug": request.slug, "session": (poll.session_id or "")[:8]})
            await plain.send_answer(send, json_answer(200, framing.result_envelope(
                request_id, tools.refusal_result("at_capacity", over_cap)),
                {"Mcp-Session-Id": answer.headers["Mcp-Session-Id"]}))
            return
        waiter = room.add(poll.endpoint_id, poll.queues, started_at=started,
                          verified_only=poll.verified_only, at_capacity=poll.at_capacity,
                          session_id=poll.session_id, credential_id=poll.credential_id)
        waited = {"answer": answer}  # the latest answer, each wake-up's retry replaces it

        async def retry_when_woken(_) -> bool:
            # Only for a client still there (the pump looks at a queued disconnect first): a
            # client that went away must not be handed a lease.
            retried = await self._retry_long_poll(request, waited["answer"])
            room.attempted(waiter, claimed=retried.long_poll is None,
                           at_capacity=bool(retried.long_poll and retried.long_poll.at_capacity))
            waited["answer"] = retried
            return retried.long_poll is not None  # False: claimed (or refused), answer now

        def keepalive_frame() -> bytes:
            return self._keepalive_frames(waited["answer"], poll, started) if streaming else b""

        try:
            if streaming:
                await send({"type": "http.response.start", "status": 200,
                            "headers": stream.sse_headers(answer.headers["Mcp-Session-Id"])})
                await send({"type": "http.response.body", "more_body": True,
                            "body": sse.comment("waiting for a todo")})
            ending = await stream_pump.pump_stream(
                receive, send, keepalive_interval=timedelta(seconds=keepalive_seconds),
                next_frame=waiter.event.wait, on_frame=retry_when_woken,
                keepalive_frame=keepalive_frame, deadline=deadline)
            answer = waited["answer"]
            if ending is stream_pump.Ending.DISCONNECTED:
                if answer.long_poll is None:  # claimed for a client that left meanwhile
                    await self._sync(handlers.release_claim_of_departed_client)(request, answer)
                return  # nobody to answer
            if not streaming:
                await plain.send_answer(send, answer)
                return
            envelope = json.loads(answer.body)
            if envelope.get("id") is None:  # a refusal built before the id was read
                envelope["id"] = request_id
            await send({"type": "http.response.body", "more_body": False,
                        "body": sse.event("message", envelope)})
        finally:
            room.remove(waiter)

    async def _retry_long_poll(self, request, answer: Answer) -> Answer:
        """The woken request, run again; on a failure (the database gone for a moment) the
        poll keeps waiting with its last answer and the re-check tries again."""
        try:
            return await self._sync(handlers.answer_post)(request, woken=True)
        except Exception as exc:
            log.exception("mcp long poll retry failed", extra={"slug": request.slug})
            if isinstance(exc, DatabaseError):
                await database_sync_to_async(pool_check.discard_broken_pooled_connections)()
            return answer

    @staticmethod
    def _keepalive_frames(answer: Answer, poll, started: float) -> bytes:
        frames = sse.comment("keep-alive")
        if answer.progress_token is not None:
            waited = asyncio.get_running_loop().time() - started
            frames += sse.event("message", framing.notification_envelope(
                "notifications/progress", {
                    "progressToken": answer.progress_token, "progress": round(waited, 3),
                    "total": poll.wait_seconds, "message": "waiting for a todo"}))
        return frames

    async def _pump(self, session_id, held, layer, group, membership, buffer, receive, send):
        # Set by a terminate message (DELETE, eviction) or by the process's heartbeat when the
        # session lost its rights: either way the stream ends.
        terminated = held.ended

        async def on_message(message) -> bool:
            if message.get("type") == TERMINATE_MESSAGE_TYPE:
                terminated.set()
                return True
            if message.get("type") == NOTIFY_MESSAGE_TYPE and message.get("method"):
                # The sender names the method and its params; the JSON-RPC envelope is this
                # layer's (sessions.notify sits below the MCP server and frames nothing).
                envelope = framing.notification_envelope(message["method"], message.get("params"))
                stream.offer_frame(buffer, envelope,
                                   message.get("context") or {"session": session_id[:8]})
            return False

        # Rejoins while the channel layer is unreachable, so doorbells resume when Redis does.
        reader = asyncio.ensure_future(group_reader.follow_groups(
            layer, [group], membership, on_message, {"session": session_id[:8]},
            retry_seconds=self.layer_retry_seconds))
        bound = self.buffer_bytes or settings.SWITCHBOARD_STREAM_BUFFER_BYTES

        async def write_frame(frame) -> bool:
            message, context = frame
            body = sse.event("message", message)
            # daphne's send never waits, so a client that stopped reading has its frames
            # dropped here past the bound rather than piled up in the server's memory.
            backlog = daphne_tuning.transport_backlog_bytes(send)
            if backlog is not None and backlog + len(body) > bound:
                stream.drop_frame("stream backlog over its bound",
                                  {**context, "unsent_bytes": backlog})
                return True
            await send({"type": "http.response.body", "more_body": True, "body": body})
            stream.frame_written(message, context)
            return True

        def keepalive_frame() -> bytes:
            backlog = daphne_tuning.transport_backlog_bytes(send)
            # A stalled reader needs no keep-alive.
            return stream_pump.KEEPALIVE_COMMENT if backlog is None or backlog < bound else b""

        # Keep-alives cost no query: the heartbeat re-checks every held session (and renews the
        # lease that keeps them counting as open) once per interval for the whole process.
        try:
            await stream_pump.pump_stream(
                receive, send, keepalive_interval=timedelta(seconds=self.keepalive_seconds),
                stop=terminated, next_frame=buffer.get, on_frame=write_frame,
                keepalive_frame=keepalive_frame)
        finally:
            if not reader.done():
                reader.cancel()


async def _close_session_streams(session_id: str):
    try:
        await get_channel_layer().group_send(session_group(session_id),
                                             {"type": TERMINATE_MESSAGE_TYPE})
    except Exception as exc:  # the stream notices at its next keep-alive (session terminated)
        log.warning("mcp stream close not sent", extra={"session": session_id[:8],
                                                        "error": type(exc).__name__})
