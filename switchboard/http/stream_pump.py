"""The stream pump: the one loop that drives every long-lived Server-Sent Events response (the
MCP notification stream and long poll, the board and the webhook page's live log), once the
response has started.

It waits, all at once, on the client leaving, the stream being told to stop, the next frame of
the stream's source and the keep-alive clock, and does what each asks:

* the client left (``"http.disconnect"``): return at once, nothing more is written. Other
  messages on ``receive`` (a request body's stray last chunk) are read past;
* ``stop`` set: end the body (an empty last chunk) and return;
* a frame: hand it to ``on_frame``, which writes it (or drops it); False from it ends the pump
  without ending the body (the caller has its last word to write). A frame never reaches
  ``on_frame`` while a disconnect is already queued: that is looked at first;
* the keep-alive clock, on its own schedule (not only when the stream is idle, so a busy
  stream still shows a proxy it is alive): ``keepalive_frame()``'s bytes (a comment by
  default; empty bytes send nothing). Streams are re-checked by their process's heartbeat or
  hub, for all of them at once, which sets ``stop`` on those that must end;
* the ``deadline`` (loop time) passed: return; the caller writes the last word.

Async and domain-free: the callers bring the frames, what a frame means and when to stop.
"""

import asyncio
import enum
from datetime import timedelta

from . import sse

KEEPALIVE_COMMENT = sse.comment("keep-alive")


class Ending(enum.Enum):
    """Why the pump returned."""

    DISCONNECTED = "the client left"
    STOPPED = "stop was set; the body is ended"
    SOURCE_ENDED = "on_frame said so; the body is not ended"
    DEADLINE = "the deadline passed; the body is not ended"


async def pump_stream(receive, send, *, keepalive_interval: timedelta,
                      stop: asyncio.Event | None = None, next_frame=None, on_frame=None,
                      keepalive_frame=None, deadline: float | None = None) -> Ending:
    """Drive one started SSE response until it ends; returns why (``Ending``).

    ``next_frame``: a callable returning an awaitable of the next frame (a queue's ``get``),
    called again after each frame; ``on_frame(frame)``: async, writes it; returns False to end.
    ``keepalive_frame()``: the bytes of one keep-alive (default ``KEEPALIVE_COMMENT``)."""
    loop = asyncio.get_running_loop()
    interval = keepalive_interval.total_seconds()
    keepalive_due = loop.time() + interval
    disconnect = asyncio.ensure_future(receive())
    stopped = asyncio.ensure_future(stop.wait()) if stop is not None else None
    frame = asyncio.ensure_future(next_frame()) if next_frame is not None else None

    async def departed() -> bool:
        # A disconnect the server already queued lands in this turn of the loop.
        await asyncio.sleep(0)
        return disconnect.done()

    try:
        while True:
            now = loop.time()
            wake_at = keepalive_due if deadline is None else min(keepalive_due, deadline)
            waiting = {task for task in (disconnect, stopped, frame) if task is not None}
            await asyncio.wait(waiting, timeout=max(0.0, wake_at - now),
                               return_when=asyncio.FIRST_COMPLETED)
            if disconnect.done():
                if disconnect.result().get("type") == "http.disconnect":
                    return Ending.DISCONNECTED
                disconnect = asyncio.ensure_future(receive())
                continue
            if stopped is not None and stopped.done():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return Ending.STOPPED
            if frame is not None and frame.done():
                if await departed():
                    continue  # the disconnect first; the frame stays where it is
                # The next frame is asked for once this one is handled: a source that is an
                # event (the long poll's wake-up) is cleared by its handler.
                if not await on_frame(frame.result()):
                    if await departed() and disconnect.result().get("type") == "http.disconnect":
                        return Ending.DISCONNECTED
                    return Ending.SOURCE_ENDED
                frame = asyncio.ensure_future(next_frame())
                continue
            now = loop.time()
            if deadline is not None and now >= deadline:
                return Ending.DEADLINE
            if now < keepalive_due:
                continue
            keepalive_due = now + interval
            body = keepalive_frame() if keepalive_frame is not None else KEEPALIVE_COMMENT
            if body:
                await send({"type": "http.response.body", "body": body, "more_body": True})
    finally:
        for task in (disconnect, stopped, frame):
            if task is not None and not task.done():
                task.cancel()
