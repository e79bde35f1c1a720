"""The process's one reader of the board group, and its one re-checker of every operator
stream's viewer (``BoardHub``).

Shared per process: one ``BoardHub`` is the process's single reader of the board
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

A webhook page's stream (``stream.GroupStreamConsumer``) joins the same hub for the re-checks
only: it reads its own group, and neither rows nor the header go to it.
"""

import asyncio
import logging
from datetime import timedelta

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer

from switchboard import health
from switchboard.http import sse

from channels_push.bus import group_reader, groups

from . import rendering, rights

log = logging.getLogger("switchboard.board_stream")

# Changes are gathered this long before one query renders them all (see todos_changed).
FLUSH_DELAY = timedelta(milliseconds=100)
# The header's counts (``glance`` events) of the endpoints a batch touched are read at most
# this often per process: four queries, a second's lag at worst.
GLANCE_INTERVAL = timedelta(seconds=1)


# -- the process's one reader of the board group ------------------------------------------------


class BoardHub:
    """The operator streams of one process that share a configuration (in production: all of
    them), and the work they share: ONE channel in the board group for the board's streams
    (kept by ``group_reader.follow_groups``, rejoined when Redis returns, every board stream
    told to ``sync`` then), ONE read and one render per view per committed batch
    (``rendering.render_batch``), and ONE re-check of every viewer of every stream per
    keep-alive interval (``recheck_streams``). A stream is added once its response has started
    and removed when it ends; the hub stops with its last."""

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
        self.follow_task = None
        self.recheck_task = None
        self.layer = None
        self.glance_interval = GLANCE_INTERVAL
        self.glance_pending = {}  # endpoint id -> endpoint, header counts due
        self.glance_task = None
        self.glance_sent_at = float("-inf")

    @property
    def joined(self) -> bool:
        return self.membership.get("channel") is not None

    def board_streams(self) -> list:
        """The open streams that carry the board's rows and header."""
        return [stream for stream in self.streams if stream.shows_board and not stream.closed]

    async def add(self, stream) -> None:
        self.streams.append(stream)
        if self.recheck_task is None:
            self.recheck_task = asyncio.ensure_future(self.recheck_forever())
        if not stream.shows_board:
            return
        if self.follow_task is None:
            self.layer = get_channel_layer()
            self.follow_task = asyncio.ensure_future(group_reader.follow_groups(
                self.layer, [groups.BOARD_GROUP], self.membership, self.on_message,
                {"board_streams": "hub"}, retry_seconds=self.layer_retry_seconds,
                on_join=self.on_join))
        elif self.joined:
            # Subscribed already (the hub's channel is in the group): the stream may re-sync.
            await stream.send_sync()

    async def remove(self, stream) -> None:
        if stream in self.streams:
            self.streams.remove(stream)
        if self.streams:
            return
        _hubs.pop(self.key, None)
        for task in [self.follow_task, self.recheck_task, self.flush_task, self.glance_task]:
            if task is not None and not task.done():
                task.cancel()
        self.follow_task = self.recheck_task = self.flush_task = self.glance_task = None
        if self.layer is not None:
            await group_reader.leave_groups(self.layer, [groups.BOARD_GROUP],
                                            self.membership.get("channel"))
        self.membership["channel"] = None

    async def on_join(self):
        # Subscribed first, then told to re-sync: see the module docstring.
        for stream in self.board_streams():
            await stream.send_sync()

    async def on_message(self, message) -> bool:
        if message.get("type") == groups.BOARD_CHANGES_TYPE:
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
        streams = self.board_streams()
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
            viewers, rendered = await database_sync_to_async(rendering.recheck_and_render_batch)(
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
            await stream.send_chunk(sse.event("todo", event, event_id=row["version"]))

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
        streams = self.board_streams()
        if not streams or not endpoints:
            return
        try:
            entries = await database_sync_to_async(rendering.glance_entries)(endpoints)
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
            await stream.send_chunk(sse.event("glance", {"endpoints": mine}))

    async def recheck_forever(self):
        while True:
            await asyncio.sleep(self.recheck_interval.total_seconds())
            try:
                await self.recheck()
            except Exception:
                # Never let one failure end the re-checks of every stream of the process.
                log.exception("board stream re-check failed", extra={"streams": len(self.streams)})

    async def recheck(self) -> None:
        """Every viewer of every stream, in one database hop
        (docs/security.md#who-may-read-who-may-act). The database being unreachable is not a
        logout: streams keep their keep-alives and the next interval checks again."""
        streams = [stream for stream in self.streams if not stream.closed]
        if not streams:
            return
        try:
            viewers = await database_sync_to_async(recheck_streams)(streams)
        except health.UNAVAILABLE_ERRORS as exc:
            log.warning("board stream check skipped: database unavailable",
                        extra={"streams": len(streams), "error": type(exc).__name__})
            return
        for stream, viewer in zip(streams, viewers):
            stream.take_recheck(viewer)


def recheck_streams(streams) -> list:
    """Each stream's viewer re-checked (``rights.recheck_viewers``: two queries for all of
    them) and then by what the stream itself requires (``may_still_watch``: a webhook page
    asks whether its webhook is still the viewer's), in one database hop. The fresh viewer or
    None (the stream ends), in the order of ``streams``."""
    viewers = rights.recheck_viewers([stream.viewer_key for stream in streams])
    return [stream.may_still_watch(viewers.get(stream.viewer_key)) for stream in streams]


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
