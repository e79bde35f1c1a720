"""Server-Sent Events framing: the bytes of one event, comment or retry hint. Pure functions,
one implementation for every stream (the MCP notification stream and long poll, the board and
the webhook page's live log).

A frame is a block of ``field: value`` lines ended by a blank line. The only line terminators
are CR, LF and CRLF, so no value may carry one: event data is compact JSON, whose strings
escape their newlines, and a comment of several lines becomes several comment lines in one
block (the text is kept, nothing else can be smuggled in as a field).
"""

import json
from datetime import timedelta


def event(name: str, data, *, event_id=None) -> bytes:
    """One event of type ``name`` carrying ``data`` as JSON, on one ``data:`` line."""
    lines = []
    if event_id is not None:
        lines.append(f"id: {event_id}")
    lines.append(f"event: {name}")
    lines.append("data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False))
    return ("\n".join(lines) + "\n\n").encode()


def comment(text: str = "") -> bytes:
    """A comment: ignored by clients, keeps proxies and idle timers from cutting the stream.
    One ``:`` line per line of ``text``."""
    return b"".join(f": {line}\n".encode() for line in text.splitlines() or [""]) + b"\n"


def retry(delay: timedelta) -> bytes:
    """The reconnection delay a client waits after the stream drops."""
    return f"retry: {int(delay.total_seconds() * 1000)}\n\n".encode()


def response_headers(*extra: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    """The response headers of every SSE answer, then ``extra``. The content type is the bare
    ``text/event-stream`` (an event stream is UTF-8 by definition, and some MCP clients compare
    the type exactly); nothing on the way may keep, transform or buffer the stream."""
    return [
        (b"content-type", b"text/event-stream"),
        (b"cache-control", b"no-cache, no-store, no-transform"),
        (b"x-accel-buffering", b"no"),  # nginx: do not buffer the stream
        *extra,
    ]
