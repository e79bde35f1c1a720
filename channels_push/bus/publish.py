"""The one after-commit publish helper: every todo change leaves the request through here.

``publish_on_commit`` registers the announcement with ``transaction.on_commit`` so a row that
rolls back is never announced (Zulip's rule). After commit, in-process listeners run at once
(cheap, synchronous), and the channel-layer send is handed to an event loop without waiting for
it: the web server's own loop when we run inside it, else one background loop per process. A
transition therefore never waits on Redis, and a Redis that is down or slow costs a log line,
not a request: the durable queue is the record and every consumer can re-read it.

The hand-off is bounded (``MAX_PENDING_SENDS``); beyond it a send is dropped and logged rather
than queued without limit.
"""

import asyncio
import atexit
import collections
import logging
import os
import threading

from channels.layers import get_channel_layer
from django.db import transaction

from . import groups

log = logging.getLogger("switchboard.publish")

# Changes after which a todo is ready for an agent, exactly as a new one: the doorbell's triggers
# (docs/reference.md#doorbells), when the change left it pending and not scheduled.
READY_ACTIONS = frozenset({"create", "retry", "requeue", "promote", "lease_lapsed", "release",
                           "due", "run_now", "approve"})
# Sends in flight per process before we start dropping. A healthy Redis drains thousands per
# second; this only bites when the layer hangs, and then memory stays bounded.
MAX_PENDING_SENDS = 10_000
# Board changes are gathered this long per process before one send carries them all
# (_BoardBatch), and at most this many go in one channel-layer message.
BOARD_BATCH_WINDOW = 0.05
BOARD_BATCH_MAX = 500
# How long an exiting process (a command) waits for its in-flight sends, which would otherwise
# die with the loop's daemon thread; bounded, so a hung Redis hangs no command.
EXIT_WAIT_SECONDS = 5.0

# In-process listeners (called after commit with each change). The doorbell and tests hook in
# here; a listener that raises is logged and does not stop the others.
_listeners = []


def add_listener(listener):
    _listeners.append(listener)


def remove_listener(listener):
    _listeners.remove(listener)


# Endpoint changes the push layer reacts to, after commit: presence turned in, paused work
# resumed. ``endpoints.transitions`` announces them here, so the endpoint app never imports the
# doorbell (STYLE "Lessons": presence is the endpoint's state; the push layer reacts to it).
_endpoint_listeners = []


def add_endpoint_listener(listener):
    _endpoint_listeners.append(listener)


def remove_endpoint_listener(listener):
    _endpoint_listeners.remove(listener)


def publish_endpoint_on_commit(endpoint, action: str, *, reason: str, now, **detail) -> None:
    """Announce ``action`` (``presence_in``, ``resumed``, ``budget_raised``) on ``endpoint``
    once the surrounding transaction commits. ``reason`` names why (a digest reason); ``now``
    is the operation's clock read; ``detail``: what the listener needs to know besides (the
    budgets before a raise)."""
    change = {**detail, "action": action, "endpoint_id": endpoint.pk, "reason": reason, "at": now}
    transaction.on_commit(lambda: _deliver_endpoint_change(endpoint, change))


def _call_listeners(listeners, subject, change: dict, *, failure: str, context: dict) -> None:
    """Call each listener with ``(subject, change)``; one that raises is logged (``failure``,
    ids in ``context``) and does not stop the others."""
    for listener in list(listeners):
        try:
            listener(subject, change)
        except Exception:
            log.exception(failure, extra=context)


def _deliver_endpoint_change(endpoint, change: dict) -> None:
    _call_listeners(_endpoint_listeners, endpoint, change, failure="endpoint listener failed",
                    context={"endpoint": endpoint.slug, "action": change["action"]})


def todo_change(todo, action: str) -> dict:
    """What a change looks like on the wire to the board: identifiers and state, no payload."""
    return {
        "action": action,
        "todo_id": str(todo.pk),
        "endpoint_id": todo.endpoint_id,
        "queue": todo.queue,
        "state": todo.state,
        # Lets a long poll that skips unverified todos leave their wake-ups to other waiters.
        "trust": todo.trust,
        # Pending but not ready until its not_before: no doorbell, no long-poll wake-up.
        "scheduled": todo.not_before is not None,
    }


def publish_on_commit(todo, action: str) -> None:
    """Announce ``action`` on ``todo`` once the surrounding transaction commits (at once when
    there is none)."""
    change = todo_change(todo, action)
    transaction.on_commit(lambda: deliver(todo, change))


def deliver(todo, change: dict) -> None:
    _call_listeners(_listeners, todo, change, failure="publish listener failed", context={
        "todo_id": change["todo_id"], "endpoint_id": change["endpoint_id"],
        "action": change["action"]})
    _board_batch.add(change)


class _BoardBatch:
    """Board changes leave in batches: one ``"todos.changed"`` group message per
    ``BOARD_BATCH_WINDOW`` per process instead of one channel-layer send per transition.

    The board coalesces for 100 ms on its side anyway, so the window costs a viewer nothing
    visible, while a per-change send was the largest single cost of a transition on a busy
    worker (a cross-thread wake-up plus a Redis round trip; bench/PROFILES.md). Doorbells do
    not come through here: they are sent at once (``send_to_group``).
    Bounded like every send: past ``MAX_PENDING_SENDS`` waiting changes, one is dropped and
    logged (only when the layer has hung for a whole window's worth of them).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._changes = []
        self._scheduled = False

    def add(self, change: dict) -> None:
        if get_channel_layer() is None:
            return
        with self._lock:
            if len(self._changes) >= MAX_PENDING_SENDS:
                log.warning("publish dropped: too many board changes waiting",
                            extra={"todo_id": change["todo_id"]})
                return
            self._changes.append(change)
            if self._scheduled:
                return
            self._scheduled = True
        _sender.submit_later(BOARD_BATCH_WINDOW, self._send, {"group": groups.BOARD_GROUP})

    async def _send(self):
        with self._lock:
            changes, self._changes = self._changes, []
            self._scheduled = False
        layer = get_channel_layer()
        for start in range(0, len(changes), BOARD_BATCH_MAX):
            await layer.group_send(groups.BOARD_GROUP, {
                "type": groups.BOARD_CHANGES_TYPE,
                "changes": changes[start:start + BOARD_BATCH_MAX]})


_board_batch = _BoardBatch()


# -- fire-and-forget channel-layer sends ---------------------------------------------------------


class _Sender:
    """Runs channel-layer coroutines on an event loop without blocking the caller.

    Producers append to a queue and wake the loop only when the queue was empty, so a burst of
    transitions costs one cross-thread wake-up, not one per message (run_coroutine_threadsafe
    per message cost a large share of a claim's CPU; bench/PROFILES.md). The loop sends the
    batch in order, so a board sees a todo's changes in the order they committed.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._server_loop = None
        self._own_loop = None
        self._queue = collections.deque()
        self._pending = 0
        self._draining = False

    def bind_server_loop(self, loop):
        """Inside daphne, send from the server's loop: the in-memory layer's queues live there."""
        self._server_loop = loop

    def _loop(self):
        if self._server_loop is not None and not self._server_loop.is_closed():
            return self._server_loop
        with self._lock:
            if self._own_loop is None:
                self._own_loop = asyncio.new_event_loop()
                threading.Thread(
                    target=self._own_loop.run_forever, name="switchboard-publish", daemon=True
                ).start()
            return self._own_loop

    def submit(self, make_coroutine, context: dict, *, on_sent=None, on_dropped=None) -> bool:
        """Queue one send. ``on_sent()`` / ``on_dropped(reason, error)`` (both optional) are
        told how it ended (on the sending loop; at once when it is refused here), in place of
        the generic "publish dropped" line:
        a caller that accounts for its own sends (the doorbell) logs and counts each exactly
        once, and only once the outcome is known."""
        with self._lock:
            full = self._pending >= MAX_PENDING_SENDS
            if not full:
                self._pending += 1
                self._queue.append((make_coroutine, context, on_sent, on_dropped))
                wake = not self._draining
                self._draining = True
        if full:
            _report_drop(on_dropped, "too many sends in flight", None, context)
            return False
        if wake:
            loop = self._loop()
            loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))
        return True

    def submit_later(self, delay: float, make_coroutine, context: dict) -> None:
        """Like ``submit``, but the send joins the queue after ``delay`` seconds. Counted as
        in flight from now, so ``wait_idle`` (and exit) waits for it."""
        with self._lock:
            self._pending += 1
        loop = self._loop()

        def enqueue():
            with self._lock:
                self._queue.append((make_coroutine, context, None, None))
                wake = not self._draining
                self._draining = True
            if wake:
                loop.create_task(self._drain())

        loop.call_soon_threadsafe(loop.call_later, delay, enqueue)

    async def _drain(self):
        while True:
            with self._lock:
                if not self._queue:
                    self._draining = False
                    return
                batch = list(self._queue)
                self._queue.clear()
            for make_coroutine, context, on_sent, on_dropped in batch:
                try:
                    await make_coroutine()
                except Exception as exc:
                    _report_drop(on_dropped, "channel layer send failed", exc, context)
                else:
                    if on_sent is not None:
                        _call_safely(on_sent, context)
                finally:
                    with self._lock:
                        self._pending -= 1
                        self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """For tests and shutdown: wait until every submitted send has finished."""
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout=timeout)


    def has_server_loop(self) -> bool:
        return self._server_loop is not None and not self._server_loop.is_closed()


def _call_safely(callback, context: dict, *args) -> None:
    # A caller's bookkeeping must neither stop the drain loop nor lose the other sends.
    try:
        callback(*args)
    except Exception:
        log.exception("publish callback failed", extra=context)


def _report_drop(on_dropped, reason: str, exc, context: dict) -> None:
    """A send that did not leave: the caller's ``on_dropped`` accounts for it, else the one
    generic warning line."""
    error = type(exc).__name__ if exc is not None else None
    if on_dropped is not None:
        _call_safely(on_dropped, context, reason, error)
    elif error is None:
        log.warning(f"publish dropped: {reason}", extra=context)
    else:
        log.warning("publish dropped", extra={**context, "error": error})


_sender = _Sender()
bind_server_loop = _sender.bind_server_loop
wait_for_sends = _sender.wait_idle


def _forget_parent_sends():
    # A forked child (Celery's prefork) has the parent's state but not its loop thread, so a batch
    # scheduled there would block every later one: re-initialised in place, locks included.
    _sender.__init__()
    _board_batch.__init__()
    _nudges.__init__()


os.register_at_fork(after_in_child=_forget_parent_sends)


def _flush_at_exit():
    # Daemon threads still run while atexit handlers do, so the background loop can finish.
    if not wait_for_sends(EXIT_WAIT_SECONDS):
        log.warning("publish: exiting with sends still in flight",
                    extra={"pending": _sender._pending})


atexit.register(_flush_at_exit)


def can_reach_streams() -> bool:
    """Whether a send from this process can reach a notification stream at all. The in-memory
    layer's groups live inside one process: only the web server (which binds its loop) holds
    the streams, so a command or worker sending into its own private in-memory layer reaches
    nobody, and must not record a ring it cannot deliver."""
    from channels.layers import InMemoryChannelLayer

    layer = get_channel_layer()
    if layer is None:
        return False
    return not isinstance(layer, InMemoryChannelLayer) or _sender.has_server_loop()


def send_to_group(group: str, message: dict, *, context: dict, on_sent=None,
                  on_dropped=None) -> bool:
    """Send ``message`` to a channel-layer group, fire-and-forget. ``context`` (ids only, never
    a secret) goes into the log line if the send is dropped; ``on_sent`` / ``on_dropped``: see
    ``_Sender.submit``. False when it was dropped at once."""
    layer = get_channel_layer()
    context = {"group": group, **context}
    if layer is None:
        _report_drop(on_dropped, "no channel layer", None, context)
        return False
    return _sender.submit(lambda: layer.group_send(group, message), context,
                          on_sent=on_sent, on_dropped=on_dropped)



class _Nudges:
    """"Something changed here" messages for a page that re-fetches on any of them (a
    webhook's delivery log): per group, at most one send per ``BOARD_BATCH_WINDOW`` per
    process, carrying the latest message, so a burst of deliveries costs one channel-layer
    send, not one each (the hook is the hot path)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._latest = {}

    def add(self, group: str, message: dict, context: dict) -> None:
        if get_channel_layer() is None:
            return
        with self._lock:
            scheduled = group in self._latest
            self._latest[group] = message
            if scheduled:
                return
        _sender.submit_later(BOARD_BATCH_WINDOW, lambda: self._send(group),
                             {"group": group, **context})

    async def _send(self, group: str):
        with self._lock:
            message = self._latest.pop(group, None)
        if message is not None:
            await get_channel_layer().group_send(group, message)


_nudges = _Nudges()


def nudge_group_on_commit(group: str, message: dict, *, context: dict) -> None:
    """Send ``message`` to ``group`` once the surrounding transaction commits (at once when
    there is none), coalesced with other nudges of the group (``_Nudges``): never announce a
    row that may roll back."""
    transaction.on_commit(lambda: _nudges.add(group, message, context))
