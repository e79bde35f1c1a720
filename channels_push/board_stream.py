"""``/todos/events``: the Todos board's Server-Sent Events stream (CONTRACT §9).

Fed by the channel-layer group ``todos.board`` that ``publish.deliver`` sends every committed
todo change to, in per-process batches (``todos.changed``). Changes an operator may see are
gathered for ``FLUSH_DELAY`` and then become one ``todo`` event per changed todo, carrying its
row as the board renders it (one query per batch); the stream never carries a payload or a
secret.

Resume without loss, by re-sync rather than replay: on every (re)connect the consumer joins the
group FIRST and only then sends ``sync``, on which the page re-fetches its rows. Any change
committed before that fetch is in the snapshot, any change after it arrives on the stream, so a
dropped connection loses nothing. A replay from ``Last-Event-ID`` could not promise that: event
ids are allocated before commit, so a change with a smaller id can commit after a larger one
was already sent. The SSE ``id`` is still set (the row's version, its latest todo event id) so
that the client can discard an older copy of a row that arrives after a newer one.

Visibility is checked per event: superusers see every endpoint, operators only endpoints they
own. An endpoint vended after the stream opened is looked up once and then remembered; every
keep-alive re-reads the viewer (session, is_active, visible endpoints), so an endpoint given
to another owner leaves the old owner's stream within one keep-alive.
"""

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass, field
from datetime import timedelta
from urllib.parse import parse_qsl

from importlib import import_module

from channels.consumer import AsyncConsumer
from channels.db import database_sync_to_async
from channels.exceptions import StopConsumer
from channels.layers import get_channel_layer
from django.conf import settings
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils.crypto import constant_time_compare

from switchboard import health

from . import group_reader, publish

log = logging.getLogger("switchboard.board_stream")

# Keep-alive comments: settings.SWITCHBOARD_STREAM_KEEPALIVE_SECONDS (15 s: proxies close an
# idle response after 30-60 s). Each one also re-checks the viewer's Django session and
# is_active (CONTRACT §12), so a logged-out or deactivated operator's stream ends by then.
# Changes are gathered this long before one query renders them all (see todos_changed).
FLUSH_DELAY = timedelta(milliseconds=100)
# How soon the browser reconnects after a drop (the SSE ``retry`` field).
RECONNECT_DELAY = timedelta(seconds=2)
# Each viewer's streams also listen on a group of their own: a logout asks them to re-check at
# once (``recheck_viewer_streams``), a stop ends them.
VIEWER_GROUP_PREFIX = "todos.viewer."
RECHECK_MESSAGE_TYPE = "board.recheck"
STOP_MESSAGE_TYPE = "board.stop"


# -- wire framing (pure) ------------------------------------------------------------------------


def format_event(event: str, data, *, event_id=None) -> bytes:
    """One SSE event. ``data`` is JSON-encoded; JSON has no raw newlines, so one data line."""
    lines = []
    if event_id is not None:
        lines.append(f"id: {event_id}")
    lines.append(f"event: {event}")
    lines.append("data: " + json.dumps(data, separators=(",", ":")))
    return ("\n".join(lines) + "\n\n").encode()


def format_comment(text: str) -> bytes:
    return b"".join(f": {line}\n".encode() for line in text.splitlines() or [""]) + b"\n"


def format_retry(delay: timedelta) -> bytes:
    return f"retry: {int(delay.total_seconds() * 1000)}\n\n".encode()


# -- database reads (sync; wrapped with database_sync_to_async) --------------------------------


@dataclass
class Viewer:
    """Who is watching, and which endpoints we already know they may or may not see."""

    user_id: int
    superuser: bool
    visible: set = field(default_factory=set)
    hidden: set = field(default_factory=set)


def find_viewer(user) -> Viewer:
    from endpoints import queries as endpoint_queries

    return Viewer(
        user_id=user.pk,
        superuser=user.is_superuser,
        visible=set(endpoint_queries.visible_endpoints(user).values_list("pk", flat=True)),
    )


def recheck_viewer(user_id: int, session_key: str | None, check_session: bool) -> Viewer | None:
    """The keep-alive's re-check (CONTRACT §12): the viewer afresh (superuser flag and visible
    endpoints re-read, so an endpoint given to another owner leaves this stream), or None when
    the stream must close: the user is gone or inactive, or (``check_session``) the Django
    session that opened the stream was logged out, expired, or no longer carries this user
    with their current password hash."""
    from django.contrib.auth import HASH_SESSION_KEY, SESSION_KEY, get_user_model

    user = get_user_model().objects.filter(pk=user_id, is_active=True).first()
    if user is None:
        return None
    if check_session:
        if not session_key:
            return None
        data = import_module(settings.SESSION_ENGINE).SessionStore(session_key).load()
        session_hash = data.get(HASH_SESSION_KEY) or ""
        if str(data.get(SESSION_KEY)) != str(user.pk) or not constant_time_compare(
                session_hash, user.get_session_auth_hash()):
            return None
    return find_viewer(user)


def check_endpoint_visible(user_id: int, endpoint_id) -> bool:
    from endpoints.models import Endpoint

    return Endpoint.objects.filter(pk=endpoint_id, owner_id=user_id).exists()


def render_changes(todo_ids, filters: dict, next_url: str) -> list[dict]:
    """The board's view of these todos now, in one query: per todo its row HTML (None when it
    no longer matches the filters, so the page drops it) and its version. Todos that are gone
    or whose id is malformed are left out."""
    from todos import queries
    from todos.models import Todo

    ids = [int(todo_id) for todo_id in todo_ids if str(todo_id).isdigit()]
    todos = queries.with_board_version(
        Todo.objects.filter(pk__in=ids).select_related("endpoint")
    ).order_by("id")
    rows = []
    for todo in todos:
        html = None
        if queries.matches_board_filters(todo, **filters):
            # No request here, so no CSRF token: board.js fills the page's token in.
            html = render_to_string(
                "todos/_row.html", {"todo": todo, "next_url": next_url, "csrf_token": ""}
            )
        rows.append({
            "todo_id": str(todo.pk),
            "version": todo.version or 0,
            "state": todo.state,
            "html": html,
        })
    return rows


# -- who is watching: a group per user, so a logout reaches that user's streams ---------------


def viewer_group(user_id: int) -> str:
    return f"{VIEWER_GROUP_PREFIX}{user_id}"


def session_tag(session_key: str | None) -> str | None:
    # Streams are told which Django session ended by a digest, never the key itself (it is a
    # bearer for the operator's account and the channel layer is not a place for those).
    return hashlib.sha256(session_key.encode()).hexdigest()[:32] if session_key else None


def end_session_streams(user_id, session_key: str | None) -> None:
    """Close the board streams that Django session ``session_key`` of ``user_id`` opened, on
    every process, now (a logout), instead of at their next keep-alive re-check (which stays
    the guarantee: this send is fire and forget). Without a key, every stream of the user
    re-checks itself at once."""
    if user_id is None:
        return
    tag = session_tag(session_key)
    message = ({"type": STOP_MESSAGE_TYPE, "session": tag} if tag
               else {"type": RECHECK_MESSAGE_TYPE})
    publish.send_to_group(viewer_group(user_id), message, context={"user": user_id})


class _OpenBoards:
    """This process's open board streams per user, oldest first: a user's fifth stream closes
    their oldest (CONTRACT §12 cap, per process; a browser tab left behind is the usual
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
    stream, and for the same reason: it must outlive the channel layer going away). Membership
    in the board group and the viewer's own group is kept by ``group_reader.follow_groups``,
    which rejoins when Redis returns; ``sync`` is sent after every (re)join, so the page
    re-fetches whatever it missed while the stream was deaf. Keep-alives flow meanwhile, and
    each one re-checks the viewer (``recheck_viewer``)."""

    def __init__(self, keepalive_interval: timedelta | None = None,
                 flush_delay: timedelta = FLUSH_DELAY,
                 layer_retry_seconds=(group_reader.RETRY_FIRST_SECONDS,
                                      group_reader.RETRY_MAX_SECONDS)):
        self.keepalive_interval = keepalive_interval or timedelta(
            seconds=settings.SWITCHBOARD_STREAM_KEEPALIVE_SECONDS)
        self.flush_delay = flush_delay
        self.layer_retry_seconds = layer_retry_seconds
        self.pending = {}  # todo id -> its latest action, waiting for the next flush
        self.flush_task = None
        self.closed = False
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
        from todos import queries

        query_string = scope.get("query_string", b"").decode("latin-1")
        self.filters = queries.board_filters_from(dict(parse_qsl(query_string)))
        # Buttons on streamed rows return to the same filtered board.
        self.next_url = reverse("todos-board") + (f"?{query_string}" if query_string else "")
        session = scope.get("session")
        # Streams built without Django's session (tests that pass a user) re-check the user
        # only; switchboard.asgi always wraps this app in the session middleware.
        self.check_session = session is not None
        self.session_key = getattr(session, "session_key", None) if session is not None else None
        try:
            self.viewer = await database_sync_to_async(find_viewer)(user)
        except health.UNAVAILABLE_ERRORS as exc:
            await database_sync_to_async(health.note_database_unavailable)(
                exc, route="board_stream")
            await send_database_unavailable(send)
            return
        await self.run(receive)

    async def run(self, receive):
        self.stop = asyncio.Event()
        for older in _open_boards.add(self.viewer.user_id, self,
                                      settings.SWITCHBOARD_MAX_OPEN_STREAMS):
            older.stop.set()
        await self.send({
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache, no-store"),
                (b"x-accel-buffering", b"no"),  # nginx: do not buffer the stream
            ],
        })
        await self.send_chunk(format_retry(RECONNECT_DELAY))
        layer = get_channel_layer()
        groups = [publish.BOARD_GROUP, viewer_group(self.viewer.user_id)]
        membership = {"channel": None}
        context = {"board_user": self.viewer.user_id}
        resumed = self.find_header(b"last-event-id")

        async def on_join():
            # Subscribed first, then told to re-sync: see the module docstring.
            await self.send_chunk(format_event("sync", {"resumed_after": resumed}))

        async def on_message(message) -> bool:
            kind = message.get("type")
            if kind == "todos.changed":
                await self.todos_changed(message)
            elif kind == RECHECK_MESSAGE_TYPE:
                if not await self.still_allowed():
                    self.stop.set()
            elif kind == STOP_MESSAGE_TYPE:
                if message.get("session") == session_tag(self.session_key):
                    self.stop.set()
            return False

        reader = asyncio.ensure_future(group_reader.follow_groups(
            layer, groups, membership, on_message, context,
            retry_seconds=self.layer_retry_seconds, on_join=on_join))
        try:
            await self.pump(receive)
        finally:
            self.closed = True
            for task in (reader, self.flush_task):
                if task is not None and not task.done():
                    task.cancel()
            _open_boards.remove(self.viewer.user_id, self)
            await group_reader.leave_groups(layer, groups, membership.get("channel"))

    async def pump(self, receive):
        """Until the client leaves or the stream is stopped: keep-alives on their own clock,
        each re-checking the viewer."""
        loop = asyncio.get_running_loop()
        interval = self.keepalive_interval.total_seconds()
        keepalive_due = loop.time() + interval
        disconnect = asyncio.ensure_future(receive())
        stopped = asyncio.ensure_future(self.stop.wait())
        try:
            while True:
                done, _ = await asyncio.wait({disconnect, stopped},
                                             timeout=max(0.0, keepalive_due - loop.time()),
                                             return_when=asyncio.FIRST_COMPLETED)
                if disconnect in done:
                    if disconnect.result().get("type") == "http.disconnect":
                        return
                    disconnect = asyncio.ensure_future(receive())
                    continue
                if stopped in done:
                    await self.end_stream()
                    return
                if loop.time() < keepalive_due:
                    continue
                keepalive_due = loop.time() + interval
                if not await self.still_allowed():
                    await self.end_stream()
                    return
                await self.send_chunk(format_comment("keep-alive"))
        finally:
            for task in (disconnect, stopped):
                if not task.done():
                    task.cancel()

    async def still_allowed(self) -> bool:
        """Re-check the viewer; False once the stream must close. The database being
        unreachable is not a logout: the stream keeps its keep-alives and checks again."""
        try:
            viewer = await database_sync_to_async(recheck_viewer)(
                self.viewer.user_id, self.session_key, self.check_session)
        except health.UNAVAILABLE_ERRORS as exc:
            log.warning("board stream check skipped: database unavailable",
                        extra={"board_user": self.viewer.user_id, "error": type(exc).__name__})
            return True
        if viewer is None:
            log.info("board stream closed: viewer signed out or deactivated",
                     extra={"board_user": self.viewer.user_id})
            return False
        self.viewer = viewer
        return True

    async def todos_changed(self, message):
        """A batch of committed changes from one process (``publish._BoardBatch``)."""
        for change in message.get("changes", ()):
            if not await self.may_see(change.get("endpoint_id")):
                continue
            # Coalesce: a burst of changes (a pool draining a queue) costs this board one query
            # per FLUSH_DELAY, not one per change, and a todo changed twice is rendered once.
            self.pending[str(change["todo_id"])] = change.get("action")
        if self.pending and self.flush_task is None:
            self.flush_task = asyncio.ensure_future(self.flush_after_delay())

    async def flush_after_delay(self):
        await asyncio.sleep(self.flush_delay.total_seconds())
        batch, self.pending = self.pending, {}
        self.flush_task = None
        try:
            rows = await database_sync_to_async(render_changes)(
                list(batch), self.filters, self.next_url
            )
            for row in rows:
                if self.closed:
                    return  # the client left while we were reading
                row["action"] = batch.get(row["todo_id"])
                await self.send_chunk(format_event("todo", row, event_id=row["version"]))
        except Exception as exc:
            # Skipping the rows would leave the page stale without telling it; ending the
            # response makes the browser reconnect and re-sync, where correctness lives anyway.
            log.warning("board stream closed after a failed row render",
                        extra={"todos": len(batch), "error": type(exc).__name__})
            self.stop.set()

    async def end_stream(self):
        self.closed = True
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def may_see(self, endpoint_id) -> bool:
        viewer = self.viewer
        if viewer.superuser or endpoint_id in viewer.visible:
            return True
        if endpoint_id in viewer.hidden:
            return False
        # An endpoint vended after the stream opened: ask once, remember the answer.
        seen = await database_sync_to_async(check_endpoint_visible)(viewer.user_id, endpoint_id)
        (viewer.visible if seen else viewer.hidden).add(endpoint_id)
        return seen

    def find_header(self, name: bytes):
        for key, value in self.scope.get("headers", []):
            if key.lower() == name:
                return value.decode("latin-1")
        return None

    async def send_chunk(self, body: bytes):
        if not self.closed:
            await self.send({"type": "http.response.body", "body": body, "more_body": True})

    async def send_whole(self, status: int, body: bytes):
        await self.send({
            "type": "http.response.start", "status": status,
            "headers": [(b"content-type", b"text/plain; charset=utf-8")],
        })
        await self.send({"type": "http.response.body", "body": body, "more_body": False})


async def send_database_unavailable(send):
    body = json.dumps({"error": {"code": "unavailable",
                                 "message": "the database is unreachable; retry"}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in health.unavailable_headers().items()]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


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
                await send_database_unavailable(send)
    return guarded


def application():
    """``/todos/events`` as routed in switchboard/asgi.py: session-authenticated like the board
    itself."""
    from channels.auth import AuthMiddlewareStack

    return with_database_guard(AuthMiddlewareStack(BoardStreamConsumer.as_asgi()))


class GroupStreamConsumer(AsyncConsumer):
    """A board page's live stream of one channel-layer group (a webhook page's deliveries,
    CONTRACT §14): ``authorize(user, url_kwargs)`` — a sync function the routing file passes
    in, run in one database hop — names the group the signed-in user may watch, or None (403).
    Then, as for the Todos board: join the group FIRST, send ``sync`` (the page re-fetches),
    and forward each ``stream.event`` message as an SSE event of its ``event`` name; keep-alive
    comments in between. The messages carry ids and outcomes, never a body."""

    def __init__(self, authorize, keepalive_interval: timedelta | None = None):
        self.authorize = authorize
        self.keepalive_interval = keepalive_interval or timedelta(
            seconds=settings.SWITCHBOARD_STREAM_KEEPALIVE_SECONDS)
        self.group = None
        self.keepalive_task = None
        self.closed = False

    async def http_request(self, message):
        if message.get("more_body"):
            return
        user = self.scope.get("user")
        group = None
        if user is not None and user.is_authenticated:
            kwargs = self.scope.get("url_route", {}).get("kwargs", {})
            group = await database_sync_to_async(self.authorize)(user, kwargs)
        if group is None:
            await self.send({"type": "http.response.start", "status": 403,
                             "headers": [(b"content-type", b"text/plain; charset=utf-8")]})
            await self.send({"type": "http.response.body", "body": b"not yours to watch\n"})
            raise StopConsumer()
        await self.send({
            "type": "http.response.start", "status": 200,
            "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache, no-store"), (b"x-accel-buffering", b"no")],
        })
        await self.channel_layer.group_add(group, self.channel_name)
        self.group = group
        await self.send_chunk(format_retry(RECONNECT_DELAY) + format_event("sync", {}))
        self.keepalive_task = asyncio.ensure_future(self.keep_alive())

    async def stream_event(self, message):
        if self.group is not None and not self.closed:
            await self.send_chunk(format_event(message["event"], message.get("data", {})))

    async def http_disconnect(self, message):
        self.closed = True
        if self.keepalive_task is not None:
            self.keepalive_task.cancel()
        if self.group is not None:
            await self.channel_layer.group_discard(self.group, self.channel_name)
        raise StopConsumer()

    async def keep_alive(self):
        """A keep-alive comment, after the same re-check as the Todos board's (CONTRACT §12):
        a logged-out or deactivated operator, or one who no longer owns the webhook, has
        their stream ended."""
        user = self.scope["user"]
        session = self.scope.get("session")
        kwargs = self.scope.get("url_route", {}).get("kwargs", {})
        while not self.closed:
            await asyncio.sleep(self.keepalive_interval.total_seconds())
            if not await database_sync_to_async(self.may_still_watch)(
                    user, getattr(session, "session_key", None), session is not None, kwargs):
                self.closed = True
                await self.send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            await self.send_chunk(format_comment("keep-alive"))

    def may_still_watch(self, user, session_key, check_session, kwargs) -> bool:
        return (recheck_viewer(user.pk, session_key, check_session) is not None
                and self.authorize(user, kwargs) == self.group)

    async def send_chunk(self, body: bytes):
        await self.send({"type": "http.response.body", "body": body, "more_body": True})
