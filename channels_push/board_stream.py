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
own. An endpoint vended after the stream opened is looked up once and then remembered.
"""

import asyncio
import json
import logging
from dataclasses import dataclass, field
from datetime import timedelta
from urllib.parse import parse_qsl

from channels.consumer import AsyncConsumer
from channels.db import database_sync_to_async
from channels.exceptions import StopConsumer
from django.template.loader import render_to_string
from django.urls import reverse

from . import publish

log = logging.getLogger("switchboard.board_stream")

# Proxies and load balancers close an idle response after 30-60 s; a comment every 15 s keeps
# the board's stream open through them and lets the server notice a vanished client.
KEEPALIVE_INTERVAL = timedelta(seconds=15)
# Changes are gathered this long before one query renders them all (see todos_changed).
FLUSH_DELAY = timedelta(milliseconds=100)
# How soon the browser reconnects after a drop (the SSE ``retry`` field).
RECONNECT_DELAY = timedelta(seconds=2)


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


# -- the consumer ------------------------------------------------------------------------------


class BoardStreamConsumer(AsyncConsumer):
    """A long-lived HTTP response. Not ``AsyncHttpConsumer``: that one stops after ``handle``
    returns, and looping inside ``handle`` would starve the channel-layer messages."""

    def __init__(self, keepalive_interval: timedelta = KEEPALIVE_INTERVAL,
                 flush_delay: timedelta = FLUSH_DELAY):
        self.keepalive_interval = keepalive_interval
        self.flush_delay = flush_delay
        self.pending = {}  # todo id -> its latest action, waiting for the next flush
        self.flush_task = None
        self.keepalive_task = None
        self.closed = False

    async def http_request(self, message):
        if message.get("more_body"):
            return  # a GET has no body worth waiting for; wait for the last chunk
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.send_whole(403, b"sign in to watch the board\n")
            raise StopConsumer()
        from todos import queries

        query_string = self.scope.get("query_string", b"").decode("latin-1")
        self.filters = queries.board_filters_from(dict(parse_qsl(query_string)))
        # Buttons on streamed rows return to the same filtered board.
        self.next_url = reverse("todos-board") + (f"?{query_string}" if query_string else "")
        self.viewer = await database_sync_to_async(find_viewer)(user)

        await self.send({
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache, no-store"),
                (b"x-accel-buffering", b"no"),  # nginx: do not buffer the stream
            ],
        })
        # Subscribe before telling the page to re-sync: see the module docstring.
        await self.channel_layer.group_add(publish.BOARD_GROUP, self.channel_name)
        resumed = self.find_header(b"last-event-id")
        await self.send_chunk(
            format_retry(RECONNECT_DELAY)
            + format_event("sync", {"resumed_after": resumed})
        )
        self.keepalive_task = asyncio.ensure_future(self.keep_alive())

    async def todos_changed(self, message):
        """A batch of committed changes from one process (``publish._BoardBatch``)."""
        if not hasattr(self, "viewer"):
            return  # a message raced the request: the coming sync covers it
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
            # StopConsumer only works from a handler, so ask ours through our own channel.
            log.warning("board stream closed after a failed row render",
                        extra={"todos": len(batch), "error": type(exc).__name__})
            await self.channel_layer.send(self.channel_name, {"type": "board.stop"})

    async def board_stop(self, message):
        await self.end_stream()
        raise StopConsumer()

    async def http_disconnect(self, message):
        await self.leave()
        raise StopConsumer()

    async def leave(self):
        self.closed = True
        for task in (getattr(self, "keepalive_task", None), getattr(self, "flush_task", None)):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        if hasattr(self, "viewer"):
            await self.channel_layer.group_discard(publish.BOARD_GROUP, self.channel_name)

    async def end_stream(self):
        await self.leave()
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

    async def keep_alive(self):
        while not self.closed:
            await asyncio.sleep(self.keepalive_interval.total_seconds())
            await self.send_chunk(format_comment("keep-alive"))

    def find_header(self, name: bytes):
        for key, value in self.scope.get("headers", []):
            if key.lower() == name:
                return value.decode("latin-1")
        return None

    async def send_chunk(self, body: bytes):
        await self.send({"type": "http.response.body", "body": body, "more_body": True})

    async def send_whole(self, status: int, body: bytes):
        await self.send({
            "type": "http.response.start", "status": status,
            "headers": [(b"content-type", b"text/plain; charset=utf-8")],
        })
        await self.send({"type": "http.response.body", "body": body, "more_body": False})


class GroupStreamConsumer(AsyncConsumer):
    """A board page's live stream of one channel-layer group (a webhook page's deliveries,
    CONTRACT §14): ``authorize(user, url_kwargs)`` — a sync function the routing file passes
    in, run in one database hop — names the group the signed-in user may watch, or None (403).
    Then, as for the Todos board: join the group FIRST, send ``sync`` (the page re-fetches),
    and forward each ``stream.event`` message as an SSE event of its ``event`` name; keep-alive
    comments in between. The messages carry ids and outcomes, never a body."""

    def __init__(self, authorize, keepalive_interval: timedelta = KEEPALIVE_INTERVAL):
        self.authorize = authorize
        self.keepalive_interval = keepalive_interval
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
        while not self.closed:
            await asyncio.sleep(self.keepalive_interval.total_seconds())
            await self.send_chunk(format_comment("keep-alive"))

    async def send_chunk(self, body: bytes):
        await self.send({"type": "http.response.body", "body": body, "more_body": True})
