"""A long-lived stream's membership in channel-layer groups, kept up while Redis comes and goes.

Shared by the MCP notification stream (``mcp.shell``), the board's SSE streams and their hub
(``board``) and the long poll's wait room (``mcp.longpoll``): each must keep serving while the
channel layer is unreachable and rejoin its groups when it returns
(docs/operating.md#when-redis-is-down), instead of failing the request or logging a traceback
per stream every few seconds.
"""

import asyncio
import logging

log = logging.getLogger("switchboard.streams")

# A stream that could not join (or lost) its groups retries after this long, doubling up to
# the cap: Redis coming back must not leave a stream deaf for the rest of its life, and a
# Redis that stays down costs one attempt per cap per stream.
RETRY_FIRST_SECONDS = 0.5
RETRY_MAX_SECONDS = 5.0


async def join_groups(layer, groups, context: dict, *, quiet: bool = False):
    """A new channel in every group of ``groups``, or None when the layer cannot be reached
    (logged unless ``quiet``: a retry loop logs the first failure of a run, not each)."""
    try:
        channel = await layer.new_channel()
        for group in groups:
            await layer.group_add(group, channel)
        return channel
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if not quiet:
            log.warning("stream without channel layer",
                        extra={**context, "error": type(exc).__name__})
        return None


async def leave_groups(layer, groups, channel) -> None:
    if channel is None:
        return
    for group in groups:
        try:
            await layer.group_discard(group, channel)
        except Exception:  # the layer is gone; its group membership expires with it
            return


async def follow_groups(layer, groups, membership: dict, on_message, context: dict, *,
                        retry_seconds=(RETRY_FIRST_SECONDS, RETRY_MAX_SECONDS), on_join=None,
                        on_leave=None):
    """Hand every message of the stream's channel to ``await on_message(message)`` (a True
    return ends the loop). ``membership["channel"]`` is the channel in the groups (None while
    the layer is unreachable); while it is None this rejoins with a capped backoff and, once
    back in, awaits ``on_join()`` (the board re-syncs there, the long poll re-checks). A
    channel lost to the layer is reported to ``on_leave()`` before the rejoining starts. The
    stream itself never waits on the layer: this runs as a task beside it."""
    first, cap = retry_seconds
    delay = first
    failing = False
    while True:
        channel = membership.get("channel")
        if channel is None:
            channel = await join_groups(layer, groups, context, quiet=failing)
            if channel is None:
                failing = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, cap)
                continue
            membership["channel"] = channel
            if failing:
                log.info("stream rejoined its channel layer", extra=context)
            failing = False
            if on_join is not None:
                await on_join()
        try:
            message = await layer.receive(channel)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # layer gone: keep the stream, rejoin when it is back
            log.warning("stream lost its channel layer",
                        extra={**context, "error": type(exc).__name__})
            failing = True
            membership["channel"] = None
            if on_leave is not None:
                await on_leave()
            await leave_groups(layer, groups, channel)
            await asyncio.sleep(delay)
            delay = min(delay * 2, cap)
            continue
        delay = first
        if await on_message(message):
            return
