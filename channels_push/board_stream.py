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
own, judged by the endpoint's owner as read with the batch's rows (so an endpoint vended after
the stream opened is visible to its owner, and one given to another owner leaves the old
owner's stream with the next batch).

Shared per process (issue 17): one ``BoardHub`` is the process's single reader of the board
group. Per committed batch it reads the changed rows ONCE (one query, owners included) and
renders each distinct board view (query string) once, and every stream picks the rows its
viewer may see; every keep-alive interval, and with every batch before any row is sent, it
re-checks every viewer of its streams in two queries (users, Django sessions), and ends the
streams of a viewer logged out, deactivated or whose password changed. 200 open boards cost a
batch what one does.

The board's header (counts per endpoint, queue and state, the throughput chart) rides the same
stream: after a batch the hub reads the glance of the endpoints it touched
(``todos.queries.board_glance``), at most once per GLANCE_INTERVAL, and sends each stream a
``glance`` event with the endpoints its viewer may see. The page re-reads the whole glance on
``sync``, like its rows.

A webhook page's live log (``GroupStreamConsumer``) is the same stream with other content:
the same cap per viewer, re-checks and dependency-down behaviour.
"""

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import parse_qsl

from importlib import import_module

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils.crypto import constant_time_compare

from switchboard import health

from channels_push.bus import group_reader
from channels_push.sessions import holders
from channels_push.bus import publish

log = logging.getLogger("switchboard.board_stream")

# Keep-alive comments: settings.SWITCHBOARD_STREAM_KEEPALIVE_SECONDS (15 s: proxies close an
# idle response after 30-60 s). Each one also re-checks the viewer's Django session and
# is_active (CONTRACT §12), so a logged-out or deactivated operator's stream ends by then.
# Changes are gathered this long before one query renders them all (see todos_changed).
FLUSH_DELAY = timedelta(milliseconds=100)
# The header's counts (``glance`` events) of the endpoints a batch touched are read at most
# this often per process: four queries, a second's lag at worst.
GLANCE_INTERVAL = timedelta(seconds=1)
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
    """Who is watching: what decides which rows their stream may carry."""

    user_id: int
    superuser: bool

    def may_see(self, owner_id) -> bool:
        return self.superuser or owner_id == self.user_id


def find_viewer(user) -> Viewer:
    return Viewer(user_id=user.pk, superuser=user.is_superuser)


def _session_matches(data: dict | None, user) -> bool:
    """The Django session's data still carries ``user`` with their current password hash."""
    from django.contrib.auth import HASH_SESSION_KEY, SESSION_KEY

    if not data:
        return False
    return str(data.get(SESSION_KEY)) == str(user.pk) and constant_time_compare(
        data.get(HASH_SESSION_KEY) or "", user.get_session_auth_hash())


def recheck_viewer(user_id: int, session_key: str | None, check_session: bool) -> Viewer | None:
    """One viewer's re-check (CONTRACT §12): the viewer afresh (superuser flag re-read), or None
    when the stream must close: the user is gone or inactive, or (``check_session``) the Django
    session that opened the stream was logged out, expired, or no longer carries this user
    with their current password hash. ``recheck_viewers`` does the same for many at once."""
    return recheck_viewers([(user_id, session_key, check_session)])[(user_id, session_key,
                                                                       check_session)]


def _load_sessions(session_keys) -> dict:
    """``{session_key: data}`` of the live Django sessions among ``session_keys``: one query
    for a database-backed engine (the default), one load per key for any other."""
    from django.utils import timezone

    store_class = import_module(settings.SESSION_ENGINE).SessionStore
    if not session_keys:
        return {}
    if hasattr(store_class, "get_model_class"):
        rows = (store_class.get_model_class().objects
                .filter(session_key__in=session_keys, expire_date__gt=timezone.now())
                .values_list("session_key", "session_data"))
        return {key: store_class().decode(data) for key, data in rows}
    return {key: store_class(key).load() for key in session_keys}


def recheck_viewers(keys) -> dict:
    """Re-check many viewers at once (the hub's keep-alive): ``keys`` are ``(user_id,
    session_key, check_session)``; returns ``{key: Viewer or None}`` as ``recheck_viewer``
    would, in two queries (the users, their sessions) whatever the number of streams."""
    from django.contrib.auth import get_user_model

    keys = list(dict.fromkeys(keys))
    users = get_user_model().objects.filter(
        pk__in={user_id for user_id, _, _ in keys}, is_active=True).in_bulk()
    sessions = _load_sessions({key for _, key, check in keys if check and key})
    result = {}
    for user_id, session_key, check_session in keys:
        user = users.get(user_id)
        if user is None or (check_session and not _session_matches(
                sessions.get(session_key) if session_key else None, user)):
            result[(user_id, session_key, check_session)] = None
        else:
            result[(user_id, session_key, check_session)] = find_viewer(user)
    return result


def fetch_board_todos(todo_ids) -> list:
    """The todos of a batch as the board renders them, in one query (endpoint and its owner
    id included). Gone or malformed ids are left out."""
    from todos import queries
    from todos.models import Todo

    ids = [int(todo_id) for todo_id in todo_ids if str(todo_id).isdigit()]
    return list(queries.with_board_version(
        Todo.objects.filter(pk__in=ids).select_related("endpoint")
    ).order_by("id"))


def render_rows(todos, filters: dict, next_url: str) -> list[dict]:
    """Per todo its row HTML (None when it no longer matches the filters, so the page drops
    it), version and its endpoint's owner (who may see it). No query."""
    from todos import queries

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
            "owner_id": todo.endpoint.owner_id,
        })
    return rows


def render_changes(todo_ids, filters: dict, next_url: str) -> list[dict]:
    """The board's view of these todos now, in one query (see ``render_rows``)."""
    return render_rows(fetch_board_todos(todo_ids), filters, next_url)


class RenderedBatch(dict):
    """``{view key: [row]}``, and ``endpoints``: the endpoints the batch touched (their
    header counts are due: ``BoardHub.queue_glance``)."""

    endpoints = ()


def glance_entries(endpoints, *, now=None) -> list[dict]:
    """The board header's entries for ``endpoints`` (``todos.queries.board_glance``, four
    queries whatever their number), JSON-ready, each with ``owner_id`` for the hub to pick
    from per viewer."""
    from todos import queries

    glance = queries.board_glance([endpoint.pk for endpoint in endpoints], now=now)
    return [{"endpoint": endpoint.slug, "owner_id": endpoint.owner_id, **glance[endpoint.pk]}
            for endpoint in endpoints]


def render_batch(todo_ids, views: dict) -> dict:
    """A committed batch for every board view of a process: ONE query for the rows (and one
    for their holders' client names when an agent holds one), then one render per view.
    ``views``: ``{view key: (filters, next_url, audience)}``, where audience is ``[Viewer]``
    of that view's streams: a row no stream of the view may see is not rendered. Returns a
    ``RenderedBatch``."""
    todos = fetch_board_todos(todo_ids)
    holders.label_todo_holders(todos)
    rendered = RenderedBatch()
    for key, (filters, next_url, audience) in views.items():
        seen = [todo for todo in todos
                if any(viewer.may_see(todo.endpoint.owner_id) for viewer in audience)]
        rendered[key] = render_rows(seen, filters, next_url)
    rendered.endpoints = list({todo.endpoint_id: todo.endpoint for todo in todos}.values())
    return rendered


def recheck_and_render_batch(todo_ids, views: dict, viewer_keys) -> tuple[dict, dict]:
    """A committed batch, after its viewers' re-check, in one database hop: ``views`` as for
    ``render_batch`` but with ``[viewer key]`` as each view's audience. Returns ``({viewer
    key: Viewer or None}, {view key: [row]})``: a viewer who lost the right (None) is no
    audience, and a demoted superuser's audience is what they may see now. Three queries
    (users, Django sessions, rows) whatever the number of streams."""
    viewers = recheck_viewers(viewer_keys)
    audiences = {key: (filters, next_url, [viewers[viewer_key] for viewer_key in keys
                                           if viewers.get(viewer_key) is not None])
                 for key, (filters, next_url, keys) in views.items()}
    return viewers, render_batch(todo_ids, audiences)


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


# -- the process's one reader of the board group ------------------------------------------------


class BoardHub:
    """The board streams of one process that share a configuration (in production: all of
    them), and the work they share: ONE channel in the board group (kept by
    ``group_reader.follow_groups``, rejoined when Redis returns, every stream told to ``sync``
    then), ONE read and one render per view per committed batch (``render_batch``), and ONE
    re-check of every viewer per keep-alive interval (``recheck_viewers``). A stream is added
    once its response has started and removed when it ends; the hub stops with its last."""

    def __init__(self, key, *, flush_delay: timedelta, recheck_interval: timedelta,
                 layer_retry_seconds):
        self.key = key
        self.flush_delay = flush_delay
        self.recheck_interval = recheck_interval
        self.layer_retry_seconds = layer_retry_seconds
        self.streams = []
        self.membership = {"channel": None}
        self.pending = {}  # todo id -> its latest action, waiting for the next flush
        self.flush_task = None
        self.tasks = []
        self.layer = None
        self.glance_interval = GLANCE_INTERVAL
        self.glance_pending = {}  # endpoint id -> endpoint, header counts due
        self.glance_task = None
        self.glance_sent_at = float("-inf")

    @property
    def joined(self) -> bool:
        return self.membership.get("channel") is not None

    async def add(self, stream) -> None:
        self.streams.append(stream)
        if not self.tasks:
            self.layer = get_channel_layer()
            self.tasks = [
                asyncio.ensure_future(group_reader.follow_groups(
                    self.layer, [publish.BOARD_GROUP], self.membership, self.on_message,
                    {"board_streams": "hub"}, retry_seconds=self.layer_retry_seconds,
                    on_join=self.on_join)),
                asyncio.ensure_future(self.recheck_forever()),
            ]
        elif self.joined:
            # Subscribed already (the hub's channel is in the group): the stream may re-sync.
            await stream.send_sync()

    async def remove(self, stream) -> None:
        if stream in self.streams:
            self.streams.remove(stream)
        if self.streams:
            return
        _hubs.pop(self.key, None)
        for task in [*self.tasks, self.flush_task, self.glance_task]:
            if task is not None and not task.done():
                task.cancel()
        self.tasks, self.flush_task, self.glance_task = [], None, None
        await group_reader.leave_groups(self.layer, [publish.BOARD_GROUP],
                                        self.membership.get("channel"))
        self.membership["channel"] = None

    async def on_join(self):
        # Subscribed first, then told to re-sync: see the module docstring.
        for stream in list(self.streams):
            await stream.send_sync()

    async def on_message(self, message) -> bool:
        if message.get("type") == "todos.changed":
            for change in message.get("changes", ()):
                # Coalesce: a burst of changes (a pool draining a queue) costs the process one
                # query per FLUSH_DELAY, not one per change, and a todo changed twice is
                # rendered once.
                self.pending[str(change["todo_id"])] = change.get("action")
            if self.pending and self.flush_task is None:
                self.flush_task = asyncio.ensure_future(self.flush_after_delay())
        return False

    async def flush_after_delay(self):
        await asyncio.sleep(self.flush_delay.total_seconds())
        batch, self.pending = self.pending, {}
        self.flush_task = None
        streams = [stream for stream in self.streams if not stream.closed]
        views = {}
        for stream in streams:
            view = views.setdefault(stream.view_key, (stream.filters, stream.next_url, []))
            view[2].append(stream.viewer_key)
        if not views:
            return
        try:
            # Every viewer re-checked with the batch, not only at the keep-alive: a row
            # committed after a viewer lost the right (signed out, deactivated, demoted) must
            # never reach them, whichever of the two clocks runs first.
            viewers, rendered = await database_sync_to_async(recheck_and_render_batch)(
                list(batch), views, [stream.viewer_key for stream in streams])
        except Exception as exc:
            # Skipping the rows would leave the pages stale without telling them; ending the
            # responses makes the browsers reconnect and re-sync, where correctness lives.
            log.warning("board streams closed after a failed row render",
                        extra={"todos": len(batch), "streams": len(streams),
                               "error": type(exc).__name__})
            for stream in streams:
                stream.stop.set()
            return
        for stream in streams:
            stream.take_recheck(viewers.get(stream.viewer_key))
            if stream.stop.is_set():
                continue
            try:
                await self._send_rows(stream, rendered.get(stream.view_key, ()), batch)
            except Exception as exc:
                # One stream's failed send is that stream's: it ends (its browser reconnects
                # and re-syncs) and the others still get the batch.
                log.warning("board stream closed after a failed send",
                            extra={"error": type(exc).__name__})
                stream.stop.set()
        self.queue_glance(getattr(rendered, "endpoints", ()))

    @staticmethod
    async def _send_rows(stream, rows, batch):
        for row in rows:
            if stream.closed:
                return  # the client left while we were reading
            if not stream.viewer.may_see(row["owner_id"]):
                continue
            event = {key: value for key, value in row.items() if key != "owner_id"}
            event["action"] = batch.get(row["todo_id"])
            await stream.send_chunk(format_event("todo", event, event_id=row["version"]))

    def queue_glance(self, endpoints) -> None:
        """The header counts of ``endpoints`` are due: sent at once after a quiet spell, else
        with the next GLANCE_INTERVAL tick, for every endpoint touched meanwhile (a pool
        draining a queue costs the header one read a second, not one per batch)."""
        for endpoint in endpoints:
            self.glance_pending[endpoint.pk] = endpoint
        if self.glance_pending and self.glance_task is None:
            self.glance_task = asyncio.ensure_future(self.send_glance_when_due())

    async def send_glance_when_due(self):
        loop = asyncio.get_running_loop()
        wait = self.glance_sent_at + self.glance_interval.total_seconds() - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        endpoints, self.glance_pending = list(self.glance_pending.values()), {}
        self.glance_task = None
        self.glance_sent_at = loop.time()
        streams = [stream for stream in self.streams if not stream.closed]
        if not streams or not endpoints:
            return
        try:
            entries = await database_sync_to_async(glance_entries)(endpoints)
        except Exception as exc:
            # The header only: the rows (where correctness lives) are not affected, and the
            # next change or re-sync brings the counts again.
            log.warning("board header counts skipped after a failed read",
                        extra={"endpoints": len(endpoints), "error": type(exc).__name__})
            return
        for stream in streams:
            try:
                await self._send_glance(stream, entries)
            except Exception as exc:
                log.warning("board stream closed after a failed send",
                            extra={"error": type(exc).__name__})
                stream.stop.set()

    @staticmethod
    async def _send_glance(stream, entries):
        mine = [{key: value for key, value in entry.items() if key != "owner_id"}
                for entry in entries if stream.viewer.may_see(entry["owner_id"])]
        # Not to a stream ending because its viewer lost the right (a batch's re-check).
        if mine and not stream.closed and not stream.stop.is_set():
            await stream.send_chunk(format_event("glance", {"endpoints": mine}))

    async def recheck_forever(self):
        while True:
            await asyncio.sleep(self.recheck_interval.total_seconds())
            try:
                await self.recheck()
            except Exception:
                # Never let one failure end the re-checks of every stream of the process.
                log.exception("board stream re-check failed", extra={"streams": len(self.streams)})

    async def recheck(self) -> None:
        """Every viewer of every stream, in one database hop (CONTRACT §12). The database
        being unreachable is not a logout: streams keep their keep-alives and the next
        interval checks again."""
        streams = [stream for stream in self.streams if not stream.closed]
        if not streams:
            return
        try:
            viewers = await database_sync_to_async(recheck_viewers)(
                [stream.viewer_key for stream in streams])
        except health.UNAVAILABLE_ERRORS as exc:
            log.warning("board stream check skipped: database unavailable",
                        extra={"streams": len(streams), "error": type(exc).__name__})
            return
        for stream in streams:
            stream.take_recheck(viewers.get(stream.viewer_key))


# Hubs of this process by (event loop, channel layer, flush delay, re-check interval): one in
# production; tests run streams with other timings and on loops of their own.
_hubs = {}


def board_hub(*, flush_delay: timedelta, recheck_interval: timedelta,
              layer_retry_seconds) -> BoardHub:
    key = (asyncio.get_running_loop(), id(get_channel_layer()), flush_delay, recheck_interval)
    hub = _hubs.get(key)
    if hub is None:
        hub = _hubs[key] = BoardHub(key, flush_delay=flush_delay,
                                    recheck_interval=recheck_interval,
                                    layer_retry_seconds=layer_retry_seconds)
    return hub


# -- the stream ---------------------------------------------------------------------------------


class BoardStreamConsumer:
    """One long-lived ``/todos/events`` response, as a plain ASGI application (like the MCP
    stream, and for the same reason: it must outlive the channel layer going away). The board
    group is read by the process's ``BoardHub`` for all streams; ``sync`` is sent once the hub
    is subscribed and after every rejoin, so the page re-fetches whatever it missed while the
    stream was deaf. The viewer's own group (logout, re-check) is this stream's, kept by
    ``group_reader.follow_groups``. Keep-alives flow meanwhile; the hub re-checks the viewer
    every keep-alive interval."""

    def __init__(self, keepalive_interval: timedelta | None = None,
                 flush_delay: timedelta = FLUSH_DELAY,
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
            await send_database_unavailable(send)
            return
        if self.viewer is None:
            await self.send_whole(403, b"not yours to watch\n")
            return
        await self.run(receive)

    def admit(self, user) -> Viewer | None:
        """Who watches (None: refused, 403), in one database hop. The board: any signed-in
        operator, each row then filtered by what they may see."""
        from todos import queries

        query_string = self.scope.get("query_string", b"").decode("latin-1")
        self.filters = queries.board_filters_from(dict(parse_qsl(query_string)))
        # Streams of the same query string are the same board view: rendered once per batch.
        self.view_key = query_string
        # Buttons on streamed rows return to the same filtered board.
        self.next_url = reverse("todos-board") + (f"?{query_string}" if query_string else "")
        return find_viewer(user)

    # What a kind of stream adds to the board's (the webhook page's stream overrides these).

    def own_groups(self) -> list:
        """Channel-layer groups this stream reads itself, besides its viewer's group."""
        return []

    async def on_own_join(self):
        """This stream's own groups were joined (again)."""

    async def on_group_message(self, message) -> None:
        """A message of one of ``own_groups``."""

    async def attach(self):
        # Subscribed to the board group through the process's hub, which re-checks its
        # viewers every keep-alive interval and with every batch.
        self.hub = board_hub(flush_delay=self.flush_delay,
                             recheck_interval=self.keepalive_interval,
                             layer_retry_seconds=self.layer_retry_seconds)
        await self.hub.add(self)

    async def detach(self):
        await self.hub.remove(self)

    async def keepalive_check(self) -> bool:
        """Before each keep-alive: False ends the stream. The board's viewers are re-checked
        by their hub, for all of them at once, so nothing here."""
        return True

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
        groups = [viewer_group(self.viewer.user_id), *self.own_groups()]
        membership = {"channel": None}
        context = {"board_user": self.viewer.user_id}
        self.resumed = self.find_header(b"last-event-id")

        async def on_message(message) -> bool:
            kind = message.get("type")
            if kind == RECHECK_MESSAGE_TYPE:
                if not await self.still_allowed():
                    self.stop.set()
            elif kind == STOP_MESSAGE_TYPE:
                if message.get("session") == session_tag(self.session_key):
                    self.stop.set()
            elif not self.stop.is_set():
                await self.on_group_message(message)
            return False

        # Redis unreachable: the stream still opens and keeps its keep-alives while the reader
        # keeps trying to join (CONTRACT §12), never a failed request.
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
        await self.send_chunk(format_event("sync", {"resumed_after": self.resumed}))

    @property
    def viewer_key(self):
        return (self.viewer.user_id, self.session_key, self.check_session)

    def take_recheck(self, viewer) -> None:
        """The hub's re-check of this stream's viewer: the fresh viewer, or None (end)."""
        if viewer is None:
            log.info("board stream closed: viewer signed out or deactivated",
                     extra={"board_user": self.viewer.user_id})
            self.stop.set()
        else:
            self.viewer = viewer

    async def pump(self, receive):
        """Until the client leaves or the stream is stopped: keep-alives on their own clock (no
        query: the hub re-checks every viewer of the process once per interval)."""
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
                if not await self.keepalive_check():
                    await self.end_stream()
                    return
                await self.send_chunk(format_comment("keep-alive"))
        finally:
            for task in (disconnect, stopped):
                if not task.done():
                    task.cancel()

    async def still_allowed(self) -> bool:
        """Re-check the viewer now (a logout without a session key asked for it); False once
        the stream must close. The database being unreachable is not a logout: the stream
        keeps its keep-alives and the hub checks again."""
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

    async def end_stream(self):
        self.closed = True
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})

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


class GroupStreamConsumer(BoardStreamConsumer):
    """A board page's live stream of one channel-layer group (a webhook page's deliveries,
    CONTRACT §14): a board stream in all but its content, so it shares the board's cap per
    viewer, its re-checks and its behaviour with a dependency down. ``authorize(user,
    url_kwargs)`` — a sync function the routing file passes in — names the group the user may
    watch, or None (403). As for the Todos board: join the group FIRST, then send ``sync`` (the
    page re-fetches; again after every rejoin), and forward each ``stream.event`` message as an
    SSE event of its ``event`` name. Every keep-alive re-checks the viewer with their current
    rights (signed out, deactivated, demoted, the webhook given to another owner: the stream
    ends). The messages carry ids and outcomes, never a body."""

    def __init__(self, authorize, **kwargs):
        super().__init__(**kwargs)
        self.authorize = authorize
        self.group = None

    def admit(self, user) -> Viewer | None:
        self.group = self.authorize(user, self.url_kwargs)
        return find_viewer(user) if self.group is not None else None

    @property
    def url_kwargs(self) -> dict:
        return self.scope.get("url_route", {}).get("kwargs", {})

    def own_groups(self) -> list:
        return [self.group]

    async def on_own_join(self):
        await self.send_sync()

    async def on_group_message(self, message) -> None:
        if message.get("type") == "stream.event":
            await self.send_chunk(format_event(message["event"], message.get("data", {})))

    async def attach(self):
        pass

    async def detach(self):
        pass

    async def keepalive_check(self) -> bool:
        return await self.still_allowed()

    async def still_allowed(self) -> bool:
        """The viewer re-checked (``recheck_viewer``) and, read afresh, still allowed this
        group; the database being unreachable is not a revocation (as for the board)."""
        try:
            allowed = await database_sync_to_async(self.may_still_watch)()
        except health.UNAVAILABLE_ERRORS as exc:
            log.warning("board stream check skipped: database unavailable",
                        extra={"board_user": self.viewer.user_id, "error": type(exc).__name__})
            return True
        if not allowed:
            log.info("board stream closed: viewer lost the right to watch",
                     extra={"board_user": self.viewer.user_id, "group": self.group})
        return allowed

    def may_still_watch(self) -> bool:
        from django.contrib.auth import get_user_model

        if recheck_viewer(self.viewer.user_id, self.session_key, self.check_session) is None:
            return False
        # The user as they are now: a superuser demoted since the stream opened is judged as
        # the operator they have become.
        user = get_user_model().objects.filter(pk=self.viewer.user_id).first()
        return user is not None and self.authorize(user, self.url_kwargs) == self.group


def group_stream_application(authorize):
    """A webhook page's stream as routed in switchboard/asgi.py: session-authenticated and
    guarded against the database being down, like ``application()``."""
    from channels.auth import AuthMiddlewareStack

    return with_database_guard(AuthMiddlewareStack(
        GroupStreamConsumer.as_asgi(authorize=authorize)))
