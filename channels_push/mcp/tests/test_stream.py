"""The GET notification stream: flushed at once, keep-alives, doorbell frames from the channel
layer group, stream counting, and DELETE closing it."""

import asyncio
import json

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.routing import URLRouter
from channels.testing import ApplicationCommunicator
from django.urls import re_path

from channels_push.bus import groups
from channels_push.mcp import shell as mcp_shell
from channels_push.mcp import stream as mcp_stream
from channels_push.sessions import notify as session_notify
from channels_push.models import McpSession
from tests.processes import DEADLINE_SECONDS

# Streams run the consumer's DB calls between awaits, where channels closes "obsolete"
# connections; inside a rolled-back test transaction that would close the test's own
# connection, so these tests commit (and flush afterwards) instead.
pytestmark = pytest.mark.django_db(transaction=True)

KEEPALIVE_SECONDS = 0.2
app = URLRouter([re_path(mcp_shell.ROUTE_PATTERN, mcp_shell.McpEndpoint(
    keepalive_seconds=KEEPALIVE_SECONDS, thread_sensitive=True))])


def stream_scope(driver, **overrides):
    headers = driver.headers(**{"accept": "text/event-stream", "content_type": None, **overrides})
    return {"type": "http", "http_version": "1.1", "method": "GET", "scheme": "http",
            "path": f"/mcp/{driver.slug}", "raw_path": f"/mcp/{driver.slug}".encode(),
            "query_string": b"", "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}


async def open_stream(driver):
    communicator = ApplicationCommunicator(app, stream_scope(driver))
    await communicator.send_input({"type": "http.request", "body": b"", "more_body": False})
    start = await communicator.receive_output(timeout=DEADLINE_SECONDS)
    first = await communicator.receive_output(timeout=DEADLINE_SECONDS)
    return communicator, start, first


async def next_body(communicator, timeout=DEADLINE_SECONDS):
    message = await communicator.receive_output(timeout=timeout)
    assert message["type"] == "http.response.body"
    return message


def open_streams(session_id):
    return McpSession.objects.get(pk=session_id).open_streams


async def wait_for_open_streams(session_id, expected,
                                deadline_seconds=DEADLINE_SECONDS):
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_seconds
    while True:
        count = await database_sync_to_async(open_streams)(session_id)
        if count == expected or loop.time() > end:
            return count
        await asyncio.sleep(0.02)


def test_stream_flushes_headers_with_a_comment_and_retry_then_counts_itself(mcp):
    mcp.initialize()

    async def scenario():
        communicator, start, first = await open_stream(mcp)
        assert start["status"] == 200
        headers = dict(start["headers"])
        assert headers[b"content-type"] == b"text/event-stream"
        assert headers[b"mcp-session-id"] == mcp.session_id.encode()
        assert first["more_body"] is True
        assert first["body"].startswith(b": ")
        assert b"\nretry: 3000\n" in b"\n" + first["body"]
        assert await database_sync_to_async(open_streams)(mcp.session_id) == 1
        await communicator.send_input({"type": "http.disconnect"})
        await communicator.wait(timeout=DEADLINE_SECONDS)

    async_to_sync(scenario)()
    assert open_streams(mcp.session_id) == 0


def test_stream_sends_keep_alive_comments(mcp):
    mcp.initialize()

    async def scenario():
        communicator, _, _ = await open_stream(mcp)
        keepalive = await next_body(communicator, timeout=KEEPALIVE_SECONDS * 20)
        assert keepalive["body"] == b": keep-alive\n\n"
        await communicator.send_input({"type": "http.disconnect"})
        await communicator.wait(timeout=DEADLINE_SECONDS)

    async_to_sync(scenario)()


def test_group_message_becomes_an_sse_data_frame(mcp):
    mcp.initialize()
    params = {"content": "acme/repo#12 opened", "meta": {"todo_id": "7", "queue": "inbox"}}

    async def scenario():
        communicator, _, _ = await open_stream(mcp)
        # Any process may ring the session: this is what the doorbell will send.
        await get_channel_layer().group_send(
            groups.session_group(mcp.session_id),
            {"type": groups.NOTIFY_MESSAGE_TYPE, "method": "notifications/claude/channel",
             "params": params},
        )
        frame = b""
        while b"data: " not in frame:  # keep-alives may come first
            frame = (await next_body(communicator))["body"]
        lines = frame.decode().strip().split("\n")
        assert lines[0] == "event: message"
        message = json.loads(lines[1][len("data: "):])
        assert message == {"jsonrpc": "2.0", "method": "notifications/claude/channel",
                           "params": params}
        await communicator.send_input({"type": "http.disconnect"})
        await communicator.wait(timeout=DEADLINE_SECONDS)

    async_to_sync(scenario)()


def test_delete_closes_the_open_stream(mcp):
    mcp.initialize()

    async def scenario():
        communicator, _, _ = await open_stream(mcp)
        delete = ApplicationCommunicator(app, {
            **stream_scope(mcp), "method": "DELETE"})
        await delete.send_input({"type": "http.request", "body": b""})
        assert (await delete.receive_output(timeout=DEADLINE_SECONDS))["status"] == 204
        while True:
            message = await next_body(communicator)
            if not message.get("more_body"):
                break
        await communicator.wait(timeout=DEADLINE_SECONDS)
        assert await wait_for_open_streams(mcp.session_id, 0) == 0

    async_to_sync(scenario)()
    assert McpSession.objects.get(pk=mcp.session_id).terminated_at is not None


def test_stream_needs_event_stream_accept_and_a_session(mcp):
    mcp.initialize()

    async def status_of(**overrides):
        communicator = ApplicationCommunicator(app, stream_scope(mcp, **overrides))
        await communicator.send_input({"type": "http.request", "body": b""})
        return (await communicator.receive_output(timeout=DEADLINE_SECONDS))["status"]

    async def scenario():
        assert await status_of(accept="application/json") == 406
        assert await status_of(mcp_session_id=None) == 400
        assert await status_of(mcp_session_id="nope") == 404
        assert await status_of(authorization=None) == 401

    async_to_sync(scenario)()
    assert open_streams(mcp.session_id) == 0


def test_notify_session_helper_reaches_the_stream(mcp):
    """The sync helper the doorbell (issue 5) calls from request or worker code."""
    mcp.initialize()

    async def scenario():
        communicator, _, _ = await open_stream(mcp)
        await database_sync_to_async(session_notify.notify_session, thread_sensitive=False)(
            mcp.session_id, "notifications/claude/channel", {"content": "x", "meta": {}})
        frame = b""
        while b"data: " not in frame:
            frame = (await next_body(communicator))["body"]
        assert b'"method":"notifications/claude/channel"' in frame
        await communicator.send_input({"type": "http.disconnect"})
        await communicator.wait(timeout=DEADLINE_SECONDS)

    async_to_sync(scenario)()


def test_a_stream_whose_detach_failed_gives_up_its_process_host(mcp, monkeypatch):
    """A detach that fails (the database unreachable as the stream ends) must not leave the
    stream counted as open for the life of the process: the process gives up its host, whose
    lease then runs out, so the sweep deletes the attachment and recounts."""
    from django.db import OperationalError

    mcp.initialize()
    endpoint = mcp_shell.McpEndpoint(keepalive_seconds=KEEPALIVE_SECONDS,
                                         thread_sensitive=True)
    own_app = URLRouter([re_path(mcp_shell.ROUTE_PATTERN, endpoint)])

    def unreachable(*args, **kwargs):
        raise OperationalError("the database is unreachable")

    async def scenario():
        communicator = ApplicationCommunicator(own_app, stream_scope(mcp))
        await communicator.send_input({"type": "http.request", "body": b"", "more_body": False})
        assert (await communicator.receive_output(timeout=DEADLINE_SECONDS))["status"] == 200
        await communicator.receive_output(timeout=DEADLINE_SECONDS)
        host_before = endpoint.heartbeat.host_id
        monkeypatch.setattr(mcp_stream, "close_stream", unreachable)
        await communicator.send_input({"type": "http.disconnect"})
        await communicator.wait(timeout=DEADLINE_SECONDS)
        return host_before

    host_before = async_to_sync(scenario)()
    assert endpoint.heartbeat.host_id != host_before


def test_a_stream_attached_under_a_host_id_that_lapsed_before_it_was_held_closes(mcp, monkeypatch):
    """The process's host lease can lapse between a stream's attach (recorded on the host id of
    that moment) and the moment the stream is held, where ``lapsed`` cannot see it to close it.
    Left open, it would count as open only until the old host's row, which nothing renews any
    more, is swept: a live stream doorbells then skip. It closes at once instead, with its
    attachment, and without spending the reconnect digest: the stream its client opens next,
    under the new host id, gets it."""
    from channels_push.sessions import transitions as session_transitions
    from channels_push.models import StreamAttachment
    from channels_push.tests.conftest import make_ready_todo
    from channels_push.doorbells.tests.test_doorbells import close, next_doorbell
    from channels_push.doorbells.tests.test_doorbells import open_stream as open_doorbell_stream

    mcp.initialize()
    make_ready_todo(mcp.endpoint)
    endpoint = mcp_shell.McpEndpoint(keepalive_seconds=KEEPALIVE_SECONDS,
                                         thread_sensitive=True)
    own_app = URLRouter([re_path(mcp_shell.ROUTE_PATTERN, endpoint)])
    attach = session_transitions.attach_stream
    lapses = [True]  # the first attach only

    def attach_then_lapse(**kwargs):
        attached = attach(**kwargs)
        if lapses and lapses.pop():
            endpoint.heartbeat.lapsed("the lease ran out while a stream attached")
            # Another stream attaching meanwhile creates the new host's row, which the
            # heartbeat then renews: nothing else would close this stream.
            session_transitions.register_stream_host(host_id=endpoint.heartbeat.host_id)
        return attached

    monkeypatch.setattr(session_transitions, "attach_stream", attach_then_lapse)

    async def scenario():
        communicator = ApplicationCommunicator(own_app, stream_scope(mcp))
        await communicator.send_input({"type": "http.request", "body": b"", "more_body": False})
        assert (await communicator.receive_output(timeout=DEADLINE_SECONDS))["status"] == 200
        loop = asyncio.get_running_loop()
        deadline = loop.time() + KEEPALIVE_SECONDS * 10
        while (body := await next_body(communicator)).get("more_body"):  # the opening comment
            assert b"data: " not in body["body"], "a doorbell on the stream that is closing"
            assert loop.time() < deadline, "the stream stayed open"
        await communicator.wait(timeout=DEADLINE_SECONDS)
        assert await wait_for_open_streams(mcp.session_id, 0) == 0
        assert not await database_sync_to_async(
            StreamAttachment.objects.filter(session_id=mcp.session_id).exists)()
        # The client reconnects under the new host id: the reconnect digest is its.
        stream = await open_doorbell_stream(mcp, application=own_app)
        # Keep-alives between.
        digest = await asyncio.wait_for(next_doorbell(stream), timeout=DEADLINE_SECONDS)
        assert (digest["meta"]["kind"], digest["meta"]["reason"]) == ("digest", "reconnect")
        await close(stream)

    async_to_sync(scenario)()
