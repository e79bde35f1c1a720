"""Sending to one MCP session's notification stream(s), from any process: the piece the
doorbell (which decides who is rung) and the MCP transport (which owns the streams) share.
Both import this module and neither imports the other for it, so there is no import circle.
"""

from channels_push.bus import groups, publish


def notify_session(session_id: str, method: str, params: dict | None = None, *,
                   context: dict | None = None, on_sent=None, on_dropped=None) -> bool:
    """Send a JSON-RPC notification to the session's open stream(s), from any process, without
    waiting (sync callers; the doorbell). Lossy by design: no stream, no delivery; False when
    the send was dropped at once. ``context`` (ids only) rides along for the log line of a
    stream that has to drop it; the full session id never goes into a log. ``on_sent`` /
    ``on_dropped``: how the channel-layer send ended (``publish.send_to_group``)."""
    context = {"session": session_id[:8], "method": method, **(context or {})}
    # The method and its params only: the stream that takes it frames the JSON-RPC envelope.
    return publish.send_to_group(
        groups.session_group(session_id),
        {"type": groups.NOTIFY_MESSAGE_TYPE, "method": method, "params": params,
         "context": context},
        context={**context, "group": groups.SESSION_GROUP_PREFIX + session_id[:8] + "…"},
        on_sent=on_sent, on_dropped=on_dropped)
