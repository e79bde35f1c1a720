"""The MCP notification stream (GET): the checks that open it (``open_stream``), its bounded
frame buffer (``offer_frame``, ``drop_frame``), its detach (``close_stream``), and one
heartbeat per web process for all the streams it holds: one rights check and one lease
renewal per interval, not per stream (docs/decisions/one-stream-lease-per-process.md). The
stream's async loop itself is the shell's (``shell.McpEndpoint._stream``).
"""

import asyncio
import logging
from datetime import timedelta

from channels.db import database_sync_to_async
from django.conf import settings

from channels_push import models
from channels_push.doorbells import doorbells
from channels_push.sessions import queries
from channels_push.sessions import transitions as session_transitions
from switchboard import health, metrics
from switchboard.db import pool_check
from switchboard.http import plain, sse

from . import framing, security
from .framing import Answer, accepts, fault

log = logging.getLogger("switchboard.mcp")

# Reconnect hint sent on every stream: long enough not to hammer a restarting server.
RETRY_HINT = timedelta(seconds=3)
# Frames held for a slow reader; beyond this a new frame is dropped and logged (the queue is
# the ledger: a missed doorbell costs only latency).
STREAM_BUFFER_FRAMES = 100


class HeldStream:
    """One open stream as the heartbeat sees it: ``ended`` is set when it must close."""

    __slots__ = ("session_id", "ended")

    def __init__(self, session_id: str):
        self.session_id = session_id
        self.ended = asyncio.Event()


class StreamHeartbeat:
    """The streams one ``McpEndpoint`` (one per process in production) holds, and the task
    that re-checks and renews them. Runs while at least one stream is held."""

    def __init__(self, *, interval_seconds: float, thread_sensitive: bool = False):
        self.interval_seconds = interval_seconds
        # The StreamHost row its streams are attached to (``attach_stream`` creates it when
        # missing, in the attach's own transaction).
        self.host_id = models.mint_host_id()
        self._thread_sensitive = thread_sensitive
        self._held: dict[str, set[HeldStream]] = {}
        self._task = None

    # -- called by the stream ----------------------------------------------------------------

    def hold(self, session_id: str) -> HeldStream:
        """Count an attached stream in (after ``attach_stream`` named ``host_id``)."""
        held = HeldStream(session_id)
        self._held.setdefault(session_id, set()).add(held)
        loop = asyncio.get_running_loop()
        # A task of another loop (tests run each on a loop of its own) never runs again.
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._run())
        return held

    def release(self, held: HeldStream) -> None:
        streams = self._held.get(held.session_id)
        if streams is not None:
            streams.discard(held)
            if not streams:
                del self._held[held.session_id]

    @property
    def session_ids(self) -> list[str]:
        return list(self._held)

    # -- the heartbeat -----------------------------------------------------------------------

    def _sync(self, function):
        return database_sync_to_async(function, thread_sensitive=self._thread_sensitive)

    async def _run(self):
        """While any stream is held: re-check every interval, renew every lease renewal (and
        once at the start: the row's lease may be as old as the process's previous streams).
        One failure never ends the heartbeat of every stream of the process."""
        loop = asyncio.get_running_loop()
        renewed_at = None
        renew_at = loop.time()
        while self._held:
            try:
                if loop.time() >= renew_at:
                    renew_at = loop.time() + queries.stream_lease_renew().total_seconds()
                    if renewed_at is not None and loop.time() - renewed_at > \
                            queries.stream_lease().total_seconds():
                        self.lapsed("stalled past its lease")
                        renewed_at = None
                    elif await self.renew():
                        renewed_at = loop.time()
                await asyncio.sleep(self.interval_seconds)
                if self._held:
                    await self.recheck()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("mcp stream heartbeat failed", extra={"streams": len(self._held)})

    async def recheck(self) -> None:
        """ONE read for every held session; close the streams of those that lost their rights.
        The database being unreachable is not a revocation: streams keep their keep-alives and
        the next interval checks again."""
        held = self.session_ids
        if not held:
            return
        try:
            allowed = await self._sync(check_sessions)(held)
        except health.UNAVAILABLE_ERRORS as exc:
            log.warning("mcp stream check skipped: database unavailable",
                        extra={"streams": len(held), "error": type(exc).__name__})
            await database_sync_to_async(pool_check.discard_broken_pooled_connections)()
            return
        for session_id in held:
            if session_id not in allowed:
                self.end_session(session_id)

    async def renew(self) -> bool:
        """ONE row write keeps every held stream counting as open. When the row is gone (the
        sweep deleted it with its attachments) every held stream closes. True when renewed."""
        try:
            renewed = await self._sync(renew_host)(self.host_id)
        except health.UNAVAILABLE_ERRORS as exc:
            log.warning("mcp stream lease not renewed: database unavailable",
                        extra={"streams": len(self._held), "error": type(exc).__name__})
            await database_sync_to_async(pool_check.discard_broken_pooled_connections)()
            return False
        if not renewed:
            self.lapsed("host row gone")
        return renewed

    def lapsed(self, reason: str) -> None:
        """The process's lease may have run out and its attachments been swept: close every
        held stream (their clients reconnect and attach afresh) under a new host id."""
        log.warning(f"mcp stream host lease lost ({reason}); closing its streams",
                    extra={"streams": len(self._held)})
        self.host_id = models.mint_host_id()
        for session_id in self.session_ids:
            self.end_session(session_id)

    def end_session(self, session_id: str) -> None:
        for held in self._held.get(session_id, ()):
            held.ended.set()


def check_sessions(session_ids) -> set:
    return session_transitions.check_stream_sessions(session_ids=session_ids)


def renew_host(host_id: str) -> bool:
    return session_transitions.renew_stream_host(host_id=host_id)


def open_stream(request: plain.Request, heartbeat: StreamHeartbeat | None = None) -> Answer:
    """Checks for GET; on success counts the stream on the session (attached to this process's
    ``heartbeat`` host, whose lease then keeps it counting as open) and says which to open."""
    endpoint, refusal = security.authorize(request)
    if refusal:
        return refusal
    if endpoint.todo_grant is not None:
        # Nothing is ever pushed to a todo token's session (no doorbells): no stream to offer,
        # which the transport lets a server say with 405.
        return fault(405, "Method Not Allowed: a todo token's session has no notification "
                          "stream", headers={"Allow": "POST, DELETE"})
    if not accepts(request.header("accept"), "text/event-stream"):
        return fault(406, "Not Acceptable: Accept must include text/event-stream")
    version = request.header("mcp-protocol-version")
    if version is not None and version not in framing.SUPPORTED_PROTOCOL_VERSIONS:
        return framing.version_refusal(version)
    session_id = request.header("mcp-session-id")
    if not session_id:
        return fault(400, "Bad Request: Mcp-Session-Id header is required")
    # Read once: the heartbeat may take a new host id at any moment (``lapsed``), and the
    # attachment and the answer must name the same one.
    host_id = heartbeat.host_id if heartbeat is not None else None
    attached = security.SESSION_ID_RE.match(session_id) and session_transitions.attach_stream(
        endpoint=endpoint, session_id=session_id, host_id=host_id)
    if attached == "full":
        # Refused rather than closing the oldest: a client that reconnects in a loop must not
        # knock out its own working stream (docs/reference.md#sessions-and-streams).
        return fault(409, "Conflict: this session already has the maximum of "
                          f"{settings.SWITCHBOARD_MAX_OPEN_STREAMS} open streams; close one "
                          "or initialize another session")
    if not attached:
        return fault(404, "Not Found: unknown or terminated session")
    return Answer(200, stream_session=session_id, stream_endpoint_id=endpoint.pk,
                  stream_host=host_id)


def ring_reconnected_stream(endpoint_id: int, session_id: str) -> list:
    """The doorbells a freshly opened stream gets at once (see doorbells.reconnect_frames)."""
    return doorbells.reconnect_frames(endpoint_id=endpoint_id, session_id=session_id)


def close_stream(session_id: str, host_id: str | None = None) -> None:
    session_transitions.detach_stream(session_id=session_id, host_id=host_id)


def drop_frame(reason: str, context: dict) -> None:
    """A notification this stream will not write: one INFO line (ids only: endpoint slug,
    todo id, short session) and the doorbell drop counter."""
    log.info(f"doorbell dropped: {reason}", extra=context)
    metrics.count_doorbell("dropped", reason)


def frame_written(message: dict, context: dict) -> None:
    """A doorbell this stream wrote to its client: its one INFO line and the sent counter."""
    if message.get("method") == doorbells.CHANNEL_METHOD:
        log.info("doorbell rung", extra=context)
        metrics.count_doorbell("sent")


def sse_headers(session_id: str) -> list[tuple[bytes, bytes]]:
    """Response headers of an SSE answer: the GET stream and a waiting POST alike."""
    return sse.response_headers((b"mcp-session-id", session_id.encode()))


def offer_frame(buffer: asyncio.Queue, message: dict, context: dict) -> bool:
    """Queue one notification for the client, or drop it (logged) when the buffer is full:
    never wait, so neither the channel layer nor the publisher is slowed by a slow reader."""
    try:
        buffer.put_nowait((message, context))
        return True
    except asyncio.QueueFull:
        drop_frame("stream buffer full", context)
        return False
