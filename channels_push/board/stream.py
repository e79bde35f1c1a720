"""``/todos/events``: the Todos board's Server-Sent Events stream (docs/console.md#the-board-todos),
and a webhook page's live log (``GroupStreamConsumer``), as plain ASGI applications.

Each stream joins its group first and then sends ``sync``, on which the page re-fetches its
rows: resume by re-sync, never replay (docs/decisions/streams-as-plain-asgi.md). Who may see
what is ``rights``; the process's one reader of the board group is ``hub``; the rows are
``rendering``'s, their SSE framing ``switchboard.http.sse``'s.
"""

import asyncio
import logging
from datetime import timedelta
from urllib.parse import parse_qsl

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.urls import reverse

from switchboard import health
from switchboard.http import plain, sse, stream_pump

from channels_push.bus import group_reader
from channels_push.bus import groups as bus_groups

from . import hub, rights

log = logging.getLogger("switchboard.board_stream")

# Keep-alive comments: settings.SWITCHBOARD_STREAM_KEEPALIVE_SECONDS (15 s: proxies close an
# idle response after 30-60 s). Each one also re-checks the viewer's Django session and
# is_active, so a logged-out or deactivated operator's stream ends by then.

# How soon the browser reconnects after a drop (the SSE ``retry`` field).
RECONNECT_DELAY = timedelta(seconds=2)


class _OpenBoards:
    """This process's open board streams per user, oldest first: a user's fifth stream closes
    their oldest (the cap is per process; a browser tab left behind is the usual
    oldest, and refusing the new tab would leave the operator with a dead board)."""

    def __init__(self):
        self._streams = {}

    def add(self, user_id: int, stream, cap: int) -> list:
        streams = self._streams.setdefault(user_id, [])
        streams.append(stream)
        over = streams[:-cap] if len(streams) > cap else []
        del streams[:len(over)]
        return over

    def remove(self, user_id: int, stream) -> None:
        streams = self._streams.get(user_id, [])
        if stream in streams:
            streams.remove(stream)
        if not streams:
            self._streams.pop(user_id, None)


_open_boards = _OpenBoards()


# -- the stream ---------------------------------------------------------------------------------


class BoardStreamConsumer:
    """One long-lived ``/todos/events`` response, as a plain ASGI application (like the MCP
    stream, and for the same reason: it must outlive the channel layer going away). The board
    group is read by the process's ``hub.BoardHub`` for all streams; ``sync`` is sent once the hub
    is subscribed and after every rejoin, so the page re-fetches whatever it missed while the
    stream was deaf. The viewer's own group (logout, re-check) is this stream's, kept by
    ``group_reader.follow_groups``. Keep-alives flow meanwhile; the hub re-checks the viewer
    every keep-alive interval."""

    def __init__(self, keepalive_interval: timedelta | None = None,
                 flush_delay: timedelta = hub.FLUSH_DELAY,
                 layer_retry_seconds=(group_reader.RETRY_FIRST_SECONDS,
                                      group_reader.RETRY_MAX_SECONDS)):
        self.keepalive_interval = keepalive_interval or timedelta(
            seconds=settings.SWITCHBOARD_STREAM_KEEPALIVE_SECONDS)
        self.flush_delay = flush_delay
        self.layer_retry_seconds = layer_retry_seconds
        self.closed = False
        self.resumed = None
        self.stop = None  # an asyncio.Event once the stream runs: set to end it

    @classmethod
    def as_asgi(cls, **kwargs):
        async def app(scope, receive, send):
            await cls(**kwargs)(scope, receive, send)
        return app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        self.scope, self.send = scope, send
        while True:  # a GET has no body worth reading; wait for its last chunk
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            if not message.get("more_body"):
                break
        user = scope.get("user")
        if user is None or not user.is_authenticated:
            await self.send_whole(403, b"sign in to watch the board\n")
            return
        session = scope.get("session")
        # Streams built without Django's session (tests that pass a user) re-check the user
        # only; switchboard.asgi always wraps this app in the session middleware.
        self.check_session = session is not None
        self.session_key = getattr(session, "session_key", None) if session is not None else None
        try:
            self.viewer = await database_sync_to_async(self.admit)(user)
        except health.UNAVAILABLE_ERRORS as exc:
            await database_sync_to_async(health.note_database_unavailable)(
                exc, route="board_stream")
            await plain.send_answer(send, plain.database_unavailable_answer())
            return
        if self.viewer is None:
            await self.send_whole(403, b"not yours to watch\n")
            return
        await self.run(receive)

    def admit(self, user) -> rights.Viewer | None:
        """Who watches (None: refused, 403), in one database hop. The board: any signed-in
        operator, each row then filtered by what they may see."""
        from todos import queries

        query_string = self.scope.get("query_string", b"").decode("latin-1")
        self.filters = queries.board_filters_from(dict(parse_qsl(query_string)))
        # Streams of the same query string are the same board view: rendered once per batch.
        self.view_key = query_string
        # Buttons on streamed rows return to the same filtered board.
        self.next_url = reverse("todos-board") + (f"?{query_string}" if query_string else "")
        return rights.find_viewer(user)

    # What a kind of stream adds to the board's (the webhook page's stream overrides these).

    # Whether the stream carries the board's rows and header: its hub then reads the board
    # group for it and re-checks its viewer with every batch too.
    shows_board = True

    def may_still_watch(self, viewer) -> rights.Viewer | None:
        """Sync, in the re-check's database hop: the fresh ``viewer`` (None: signed out or
        deactivated) this stream may go on with, else None (it ends). The board: any
        signed-in operator, every row then filtered by what they may see."""
        return viewer

    @property
    def context(self) -> dict:
        """Ids for this stream's log lines."""
        return {"board_user": self.viewer.user_id}

    def own_groups(self) -> list:
        """Channel-layer groups this stream reads itself, besides its viewer's group."""
        return []

    async def on_own_join(self):
        """This stream's own groups were joined (again)."""

    async def on_group_message(self, message) -> None:
        """A message of one of ``own_groups``."""

    async def attach(self):
        # Into the process's hub, which re-checks every viewer of its streams once per
        # keep-alive interval (and, for the board's, with every batch), and feeds the board's
        # streams the board group.
        self.hub = hub.board_hub(flush_delay=self.flush_delay,
                                 recheck_interval=self.keepalive_interval,
                                 layer_retry_seconds=self.layer_retry_seconds)
        await self.hub.add(self)

    async def detach(self):
        await self.hub.remove(self)

    async def run(self, receive):
        self.stop = asyncio.Event()
        for older in _open_boards.add(self.viewer.user_id, self,
                                      settings.SWITCHBOARD_MAX_OPEN_STREAMS):
            older.stop.set()
        await self.send({
            "type": "http.response.start",
            "status": 200,
            "headers": sse.response_headers(),
        })
        await self.send_chunk(sse.retry(RECONNECT_DELAY))
        layer = get_channel_layer()
        groups = [bus_groups.viewer_group(self.viewer.user_id), *self.own_groups()]
        membership = {"channel": None}
        context = self.context
        self.resumed = self.find_header(b"last-event-id")

        async def on_message(message) -> bool:
            kind = message.get("type")
            if kind == bus_groups.RECHECK_MESSAGE_TYPE:
                if not await self.still_allowed():
                    self.stop.set()
            elif kind == bus_groups.STOP_MESSAGE_TYPE:
                if message.get("session") == rights.session_tag(self.session_key):
                    self.stop.set()
            elif not self.stop.is_set():
                await self.on_group_message(message)
            return False

        # Redis unreachable: the stream still opens and keeps its keep-alives while the reader
        # keeps trying to join (docs/operating.md#when-redis-is-down), never a failed request.
        reader = asyncio.ensure_future(group_reader.follow_groups(
            layer, groups, membership, on_message, context,
            retry_seconds=self.layer_retry_seconds, on_join=self.on_own_join))
        try:
            await self.attach()
            await self.pump(receive)
        finally:
            self.closed = True
            if not reader.done():
                reader.cancel()
            _open_boards.remove(self.viewer.user_id, self)
            await self.detach()
            await group_reader.leave_groups(layer, groups, membership.get("channel"))

    async def send_sync(self):
        await self.send_chunk(sse.event("sync", {"resumed_after": self.resumed}))

    @property
    def viewer_key(self):
        return (self.viewer.user_id, self.session_key, self.check_session)

    def take_recheck(self, viewer) -> None:
        """The hub's re-check of this stream's viewer: the fresh viewer, or None (end)."""
        if viewer is None:
            log.info("board stream closed: its viewer lost the right to watch",
                     extra=self.context)
            self.stop.set()
        else:
            self.viewer = viewer

    async def pump(self, receive):
        """Until the client leaves or the stream is stopped: keep-alives on their own clock (no
        query: the hub re-checks every viewer of the process once per interval)."""
        await stream_pump.pump_stream(receive, self.send_unless_closed,
                                      keepalive_interval=self.keepalive_interval, stop=self.stop)

    async def still_allowed(self) -> bool:
        """Re-check the viewer now (a logout without a session key asked for it), as the hub
        does every interval; False once the stream must close. The database being unreachable
        is not a logout: the stream keeps its keep-alives and the hub checks again."""
        try:
            viewer = await database_sync_to_async(self.recheck_now)()
        except health.UNAVAILABLE_ERRORS as exc:
            log.warning("board stream check skipped: database unavailable",
                        extra={**self.context, "error": type(exc).__name__})
            return True
        if viewer is None:
            log.info("board stream closed: its viewer lost the right to watch",
                     extra=self.context)
            return False
        self.viewer = viewer
        return True

    def recheck_now(self) -> rights.Viewer | None:
        return self.may_still_watch(rights.recheck_viewer(
            self.viewer.user_id, self.session_key, self.check_session))

    def find_header(self, name: bytes):
        for key, value in self.scope.get("headers", []):
            if key.lower() == name:
                return value.decode("latin-1")
        return None

    async def send_chunk(self, body: bytes):
        await self.send_unless_closed({"type": "http.response.body", "body": body,
                                       "more_body": True})

    async def send_unless_closed(self, message):
        """Every body chunk of the stream, from the pump, the hub and the group reader alike:
        nothing after the last one (marked closed before it is sent, so a writer that runs
        while it is being sent writes nothing)."""
        if self.closed:
            return
        if not message.get("more_body"):
            self.closed = True
        await self.send(message)

    async def send_whole(self, status: int, body: bytes):
        await self.send({
            "type": "http.response.start", "status": status,
            "headers": [(b"content-type", b"text/plain; charset=utf-8")],
        })
        await self.send({"type": "http.response.body", "body": body, "more_body": False})


def with_database_guard(app):
    """``app`` (the board stream behind Django's session and auth middleware, which read the
    database before the stream starts) answering 503 + Retry-After instead of failing when the
    database is unreachable."""
    async def guarded(scope, receive, send):
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await app(scope, receive, tracking_send)
        except health.UNAVAILABLE_ERRORS as exc:
            await database_sync_to_async(health.note_database_unavailable)(
                exc, route="board_stream")
            if not started:
                await plain.send_answer(send, plain.database_unavailable_answer())
    return guarded


def application():
    """``/todos/events`` as routed in switchboard/asgi.py: session-authenticated like the board
    itself."""
    from channels.auth import AuthMiddlewareStack

    return with_database_guard(AuthMiddlewareStack(BoardStreamConsumer.as_asgi()))


class GroupStreamConsumer(BoardStreamConsumer):
    """A board page's live stream of one channel-layer group (a webhook page's deliveries,
    docs/console.md#a-webhook-todoswebhooksslug): a board stream in all but its content, so it
    shares the board's cap per viewer, its hub's re-checks and its behaviour with a dependency
    down. ``authorize(user, url_kwargs)`` — a sync function the routing file passes in — names
    the group the user may watch, or None (403). As for the Todos board: join the group FIRST,
    then send ``sync`` (the page re-fetches; again after every rejoin), and forward each
    ``"stream.event"`` message as an SSE event of its ``event`` name. Every keep-alive interval
    the hub re-checks the viewer with their current rights (signed out, deactivated, demoted,
    the webhook given to another owner: the stream ends). The messages carry ids and outcomes,
    never a body."""

    shows_board = False

    def __init__(self, authorize, **kwargs):
        super().__init__(**kwargs)
        self.authorize = authorize
        self.group = None

    def admit(self, user) -> rights.Viewer | None:
        self.group = self.authorize(user, self.url_kwargs)
        return rights.find_viewer(user) if self.group is not None else None

    def may_still_watch(self, viewer) -> rights.Viewer | None:
        # The user as the re-check read them: a superuser demoted since the stream opened is
        # judged as the operator they have become.
        if viewer is None or self.authorize(viewer.user, self.url_kwargs) != self.group:
            return None
        return viewer

    @property
    def context(self) -> dict:
        return {"board_user": self.viewer.user_id, "group": self.group}

    @property
    def url_kwargs(self) -> dict:
        return self.scope.get("url_route", {}).get("kwargs", {})

    def own_groups(self) -> list:
        return [self.group]

    async def on_own_join(self):
        await self.send_sync()

    async def on_group_message(self, message) -> None:
        if message.get("type") == "stream.event":
            await self.send_chunk(sse.event(message["event"], message.get("data", {})))


def group_stream_application(authorize):
    """A webhook page's stream as routed in switchboard/asgi.py: session-authenticated and
    guarded against the database being down, like ``application()``."""
    from channels.auth import AuthMiddlewareStack

    return with_database_guard(AuthMiddlewareStack(
        GroupStreamConsumer.as_asgi(authorize=authorize)))
