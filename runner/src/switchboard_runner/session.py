"""One MCP session with its notification stream, held by its own task and reopened with
backoff when it breaks; tool calls from any task; the runner's one-line-per-event log."""

import asyncio
import json
import logging
import time

from mcp import Client
from mcp.client.extension import ClientExtension, NotificationBinding
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError
from pydantic import BaseModel  # installed with the mcp SDK (its own models are pydantic)

log = logging.getLogger("switchboard.runner")

CHANNEL_METHOD = "notifications/claude/channel"
INVALID_PARAMS = -32602  # JSON-RPC: a server without long poll refuses the unknown argument
# A tool call that is not a long poll answers in milliseconds; this only bounds a dead peer.
CALL_TIMEOUT_SECONDS = 30.0
# Reconnect backoff after the session breaks (server restart, network): doubling to the cap.
RECONNECT_FIRST_SECONDS = 0.5
RECONNECT_MAX_SECONDS = 30.0
# The SDK retries a dropped notification stream twice at the server's retry hint (3 s); past
# this with no stream open the session is reopened (checked every STREAM_CHECK_SECONDS).
STREAM_LOST_SECONDS = 10.0
STREAM_CHECK_SECONDS = 2.0
# A log value is cut here (a title, an error): one event stays one readable line.
LOG_VALUE_MAX_CHARS = 120
# Except a ``reason``: the runner's own sentence saying why it stops or waits (bounded where it
# is made: an agent's error line in it is clipped), which cut short would hide the cause.
WHOLE_LOG_FIELDS = frozenset({"reason"})

class Refused(Exception):
    """A domain refusal from a tool (``isError`` with ``error.code``); ``data``: the error's
    other members (``usage_recorded``)."""

    def __init__(self, code: str, message: str, data: dict | None = None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.data = code, message, data or {}


class Unreachable(Exception):
    """The call did not get an answer (connection down, session gone, timeout)."""


# -- logging ---------------------------------------------------------------------------------


def escape_unprintable(text: str, keep: str = "") -> str:
    """``text`` with every character a terminal would act on rather than show (controls, a
    right-to-left override U+202E, zero-width and other format characters) written as
    ``\\uXXXX`` (``\\UXXXXXXXX`` beyond the basic plane). Titles and errors come from webhook
    senders: left raw they would reorder or restyle the operator's terminal. ``keep``: characters
    left as they are (``--dry-run`` keeps a prompt's newlines, so its command can be pasted)."""
    return "".join(c if c.isprintable() or c in keep else
                   f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}" for c in text)


def _field(value, whole: bool = False) -> str:
    """A log value: bare when it is one plain word, else JSON-quoted (cut at
    LOG_VALUE_MAX_CHARS unless ``whole``) and escape_unprintable."""
    text = str(value)
    if text and text.isprintable() and not any(c.isspace() or c in '"=' for c in text):
        return text
    if not whole:
        text = text[:LOG_VALUE_MAX_CHARS]
    return escape_unprintable(json.dumps(text, ensure_ascii=False))


def log_event(event: str, *, level: int = logging.INFO, **fields) -> None:
    """One line per event: ``claim todo_id=12 queue=issues title="…"`` (never a token or a
    payload). ``level`` WARNING for what ``watch`` (which logs only warnings) must show too."""
    log.log(level, " ".join([event] + [f"{key}={_field(value, key in WHOLE_LOG_FIELDS)}"
                                       for key, value in fields.items() if value is not None]))



class ChannelParams(BaseModel):
    content: str = ""
    meta: dict[str, str] = {}


class ChannelBell(ClientExtension):
    """Observe ``notifications/claude/channel``. The SDK hands notifications outside the core
    protocol only to a bound extension (its ``message_handler`` never sees them)."""

    identifier = "com.anthropic/claude-channel"

    def __init__(self, on_ring):
        self.on_ring = on_ring

    def notifications(self):
        return [NotificationBinding(method=CHANNEL_METHOD, params_type=ChannelParams,
                                    handler=self._ring)]

    async def _ring(self, params: ChannelParams):
        self.on_ring(params.meta)


class StreamWatch:
    """Counts the session's open notification streams (GET responses) through an HTTP response
    hook. The SDK reopens a dropped stream only twice and then gives up quietly; after a server
    restart longer than that the runner would hear no doorbell again. The owner task reopens
    the whole session when no stream has been open for STREAM_LOST_SECONDS."""

    def __init__(self):
        self.open = 0
        self.quiet_since = time.monotonic()

    async def on_response(self, response):
        if response.request.method != "GET" or response.status_code != 200:
            return
        self.open += 1
        close = response.aclose
        closed = False

        async def aclose():
            nonlocal closed
            try:
                await close()
            finally:
                if not closed:
                    closed = True
                    self.open -= 1
                    if not self.open:
                        self.quiet_since = time.monotonic()

        response.aclose = aclose

    def lost(self) -> bool:
        return not self.open and time.monotonic() - self.quiet_since > STREAM_LOST_SECONDS


class Switchboard:
    """One MCP session, kept open by its own task and reopened with backoff when it breaks.

    The SDK's client lives in anyio task groups that must be exited by the task that entered
    them, so one owner task holds it; callers on other tasks use ``call``. Heartbeats and
    settles are fenced by ``lease_id``, so they work from a reopened session too."""

    def __init__(self, url: str, token: str, on_ring, on_connected=None):
        self.url, self._token, self._on_ring = url, token, on_ring
        # Called after each (re)connection: doorbells sent while disconnected are lost.
        self._on_connected = on_connected
        self._client = None
        self._ready = asyncio.Event()
        self._broken = asyncio.Event()
        self._closing = False
        self._owner = None
        self.first_error = None  # set when the first connection attempt fails
        # Set when the server turned an attempt away (401, 403, 404) before the runner was
        # ever connected: a wrong credential or URL that no retry will mend
        # (wait_first_connection).
        self.turned_away = None  # the HTTP status
        self._turned_away = asyncio.Event()
        self._connected_once = False

    def start(self):
        self._owner = asyncio.create_task(self._hold())

    async def _hold(self):
        delay = RECONNECT_FIRST_SECONDS
        while not self._closing:
            http = create_mcp_http_client(headers={"Authorization": f"Bearer {self._token}"})
            streams = StreamWatch()
            http.event_hooks = {"response": [streams.on_response, self._note_turned_away]}
            try:
                # mode="legacy": the initialize handshake and a session, which is what carries
                # the notification stream (switchboard deliberately speaks only that era).
                async with http, Client(streamable_http_client(self.url, http_client=http),
                                        mode="legacy", extensions=[ChannelBell(self._on_ring)],
                                        read_timeout_seconds=CALL_TIMEOUT_SECONDS) as client:
                    self._client = client
                    self._ready.set()
                    self._connected_once = True
                    delay = RECONNECT_FIRST_SECONDS
                    log_event("connected", url=self.url)
                    if self._on_connected is not None:
                        self._on_connected()
                    while not self._broken.is_set():
                        await wait_first(self._broken.wait(), timeout=STREAM_CHECK_SECONDS)
                        if streams.lost():
                            log_event("stream_lost", reopening="session")
                            break
            except Exception as error:  # noqa: BLE001 — any failure: log, back off, reconnect
                if self.first_error is None and not self._ready.is_set():
                    self.first_error = error
                if self.turned_away and not self._connected_once:
                    self._turned_away.set()
                # A warning: ``watch`` shows it too, so a revoked credential is not a silence.
                log_event("connection_error", level=logging.WARNING, error=_describe(error),
                          **self._turned_away_fields(), retry_in_s=delay)
            finally:
                self._client = None
                self._ready.clear()
                self._broken.clear()
            if self._closing:
                break
            await asyncio.sleep(delay)  # close() cancels it: a stopping runner does not wait
            delay = min(delay * 2, RECONNECT_MAX_SECONDS)

    async def _note_turned_away(self, response):
        # The status of a refused initialize: the SDK raises the JSON-RPC error in its body,
        # which does not carry it. Only before the first connection: a 404 later is a session
        # the server ended, which a reconnect mends.
        if response.status_code in AUTH_HINTS and not self._connected_once:
            self.turned_away = response.status_code

    def _turned_away_fields(self) -> dict:
        if not self.turned_away or self._connected_once:
            return {}
        return {"status": self.turned_away, "check": AUTH_HINTS[self.turned_away]}

    async def wait_first_connection(self, timeout: float) -> bool:
        """For a run that must connect now (``--once``, ``--dry-run``, ``watch``): True once
        connected; False after ``timeout``, or as soon as the server turned the first attempt
        away (``turned_away`` says why), since retrying a wrong credential or URL only delays
        the exit."""
        await wait_first(self._ready.wait(), self._turned_away.wait(), timeout=timeout)
        return self._ready.is_set()

    def first_failure(self) -> dict:
        """Why the first connection attempt failed, as log fields for a run giving up:
        ``error``, and ``status`` with what to ``check`` when the server turned it away."""
        if self.first_error is None:
            return {}
        return {"error": _describe(self.first_error), **self._turned_away_fields()}

    def first_failure_text(self) -> str:
        """``first_failure`` as a sentence for a command's stderr."""
        fields = self.first_failure()
        if "status" in fields:
            return f"HTTP {fields['status']}: {fields['check']} ({fields['error']})"
        return fields.get("error", "no answer")

    async def wait_connected(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def call(self, name: str, arguments: dict, *, timeout: float = CALL_TIMEOUT_SECONDS):
        """The tool's ``structuredContent``; raises Refused (a domain refusal), MCPError with
        ``INVALID_PARAMS`` (a malformed call), or Unreachable."""
        if not await self.wait_connected(timeout):
            raise Unreachable("not connected")
        client = self._client
        try:
            answer = await client.call_tool(name, arguments, read_timeout_seconds=timeout)
        except MCPError as error:
            if error.code == INVALID_PARAMS:
                raise
            self._break(client)  # the session is gone or timed out: open a fresh one
            raise Unreachable(_describe(error)) from error
        except Exception as error:  # noqa: BLE001 — transport faults come in many types
            self._break(client)
            raise Unreachable(_describe(error)) from error
        content = answer.structured_content
        if content is None:
            content = json.loads(answer.content[0].text) if answer.content else {}
        if answer.is_error:
            error = content.get("error") or {}
            raise Refused(error.get("code", "unknown"), error.get("message", ""),
                          {k: v for k, v in error.items() if k not in ("code", "message")})
        return content

    def _break(self, client):
        # A call that failed on a session already replaced says nothing about the new one.
        if client is self._client:
            self._broken.set()

    def reopen(self):
        self._broken.set()

    async def close(self):
        """End the session (its DELETE, when one is open) and the owner task. Without an open
        session the owner is cancelled rather than awaited: in a reconnect backoff (up to 30 s)
        or a connection attempt a server accepts and never answers (the connect timeout)."""
        self._closing = True
        self._broken.set()
        if self._owner is None:
            return
        if not self._ready.is_set():
            self._owner.cancel()
        try:
            await self._owner
        except asyncio.CancelledError:
            if not self._owner.cancelled():
                raise  # close() itself was cancelled


def _describe(error: BaseException) -> str:
    # The SDK reports transport faults from inside task groups: name the fault itself, not
    # "unhandled errors in a TaskGroup".
    # (ExceptionGroup is 3.11+; the runner still runs on 3.10, where the SDK backports it.)
    while getattr(error, "exceptions", None):
        error = error.exceptions[0]
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    if status in AUTH_HINTS:
        return f"HTTP {status}: {AUTH_HINTS[status]}"
    text = str(error) or type(error).__name__
    return f"{type(error).__name__}: {text}"[:200]


# What an operator should check when the server turns the runner away.
AUTH_HINTS = {
    401: "the server refused the credential (check what --token-env or --token-file gives; "
         "it may have been rotated)",
    403: "the credential may not use this endpoint (check --url)",
    404: "no such endpoint at this URL (check --url)",
}


async def wait_first(*awaitables, timeout=None):
    """Wait for the first of ``awaitables`` (coroutines are wrapped and cancelled after)."""
    tasks = [a if isinstance(a, asyncio.Future) else asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task, awaitable in zip(tasks, awaitables):
            if task is not awaitable:
                task.cancel()


