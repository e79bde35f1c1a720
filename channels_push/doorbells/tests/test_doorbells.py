"""Doorbells on real streams (in-process ASGI, real PostgreSQL and Redis): the SPEC-0011
scenarios outside presence.

A scenario that asserts a session got *nothing* cannot wait for silence without a sleep, so it
rings a control todo afterwards and checks that the control is the first doorbell the stream
sees.
"""

import asyncio
import json
import logging
import threading
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.routing import URLRouter
from channels.testing import ApplicationCommunicator
from django.db import connection, transaction
from django.urls import re_path
from django.utils import timezone

from tests.factories import credential_for
from channels_push.bus import publish
from channels_push.doorbells import doorbells
from channels_push.doorbells import rings
from channels_push.mcp import shell as mcp_shell
from channels_push.sessions import transitions as session_transitions
from channels_push.models import McpSession
from channels_push.tests.conftest import McpDriver, make_ready_todo
from tests.processes import DEADLINE_SECONDS
from todos.models import Todo

pytestmark = pytest.mark.django_db(transaction=True)

app = URLRouter([re_path(mcp_shell.ROUTE_PATTERN, mcp_shell.McpEndpoint(
    keepalive_seconds=30, thread_sensitive=True))])
FRAME_DEADLINE_SECONDS = DEADLINE_SECONDS


def stream_scope(driver):
    headers = driver.headers(accept="text/event-stream", content_type=None)
    return {"type": "http", "http_version": "1.1", "method": "GET", "scheme": "http",
            "path": f"/mcp/{driver.slug}", "raw_path": f"/mcp/{driver.slug}".encode(),
            "query_string": b"", "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}


async def open_stream(driver, application=app):
    communicator = ApplicationCommunicator(application, stream_scope(driver))
    await communicator.send_input({"type": "http.request", "body": b"", "more_body": False})
    start = await communicator.receive_output(timeout=DEADLINE_SECONDS)
    assert start["status"] == 200
    await communicator.receive_output(timeout=DEADLINE_SECONDS)  # the opening comment
    return communicator


async def next_doorbell(communicator, timeout=FRAME_DEADLINE_SECONDS) -> dict:
    """The params of the next notification on the stream (keep-alives skipped)."""
    while True:
        message = await communicator.receive_output(timeout=timeout)
        body = message.get("body", b"")
        if b"data: " in body:
            data = body.decode().split("data: ", 1)[1].strip()
            envelope = json.loads(data)
            assert envelope["method"] == "notifications/claude/channel"
            return envelope["params"]


async def next_ring(communicator, timeout=FRAME_DEADLINE_SECONDS) -> dict:
    """The next todo doorbell, past a reconnect digest: a todo created while the stream opens
    may be counted by the stream's reconnect digest as well as rung (doorbells are
    at-least-once), and which comes first depends on timing."""
    while True:
        params = await next_doorbell(communicator, timeout)
        if not (doorbells.is_digest(params) and params["meta"].get("reason") == "reconnect"):
            return params


async def close(communicator):
    await communicator.send_input({"type": "http.disconnect"})
    await communicator.wait(timeout=DEADLINE_SECONDS)


def ring(endpoint, queue="inbox", **kwargs):
    return database_sync_to_async(make_ready_todo, thread_sensitive=False)(endpoint, queue, **kwargs)


@pytest.fixture
def driver(vend):
    def make(slug="door", **kwargs):
        endpoint, credential = vend(slug, **kwargs)
        d = McpDriver(endpoint.slug, credential)
        d.endpoint = endpoint
        d.initialize()
        return d

    return make


def test_ready_todo_rings_one_identifier_safe_notification_on_the_session(driver):
    d = driver()

    async def scenario():
        stream = await open_stream(d)
        todo = await ring(d.endpoint, "reviews", title="acme/x#1 opened: bug", kind="issues.opened",
                          source="github")
        params = await next_ring(stream)
        assert params["meta"] == {"todo_id": str(todo.pk), "queue": "reviews",
                                  "kind": "issues.opened", "source": "github",
                                  "trust": "signed"}
        assert "acme/x#1 opened: bug" in params["content"]
        control = await ring(d.endpoint, title="control")
        assert (await next_ring(stream))["meta"]["todo_id"] == str(control.pk)  # exactly one
        await close(stream)

    async_to_sync(scenario)()


def test_out_of_scope_todo_and_other_endpoints_get_nothing(driver):
    d = driver("scoped", scope=["reviews"])
    stranger = driver("stranger")

    async def scenario():
        stream = await open_stream(d)
        stranger_stream = await open_stream(stranger)
        await ring(d.endpoint, "inbox", title="outside the grant")
        in_scope = await ring(d.endpoint, "reviews", title="inside")
        assert (await next_ring(stream))["meta"]["todo_id"] == str(in_scope.pk)
        control = await ring(stranger.endpoint, "inbox", title="control")
        assert (await next_ring(stranger_stream))["meta"]["todo_id"] == str(control.pk)
        await close(stream)
        await close(stranger_stream)

    async_to_sync(scenario)()


def test_unverified_and_unattributed_todos_never_ring_operator_todos_do(driver):
    d = driver()

    async def scenario():
        stream = await open_stream(d)
        await ring(d.endpoint, title="unsigned", trust="unverified")
        await ring(d.endpoint, title="nobody's", trust="signed", attributed=False)
        handed = await ring(d.endpoint, title="from my human", trust="operator")
        params = await next_ring(stream)
        assert params["meta"]["todo_id"] == str(handed.pk)
        await close(stream)

    async_to_sync(scenario)()


def test_a_todo_awaiting_approval_rings_only_once_approved(driver):
    from todos import transitions

    d = driver()

    def approve(todo):
        transitions.approve_todo(transitions.Caller.operator(d.endpoint, "alice"), todo.pk)

    async def scenario():
        stream = await open_stream(d)
        gated = await ring(d.endpoint, title="deploy prod", requires_approval=True)
        control = await ring(d.endpoint, title="control")
        assert (await next_ring(stream))["meta"]["todo_id"] == str(control.pk)
        await database_sync_to_async(approve, thread_sensitive=False)(gated)
        assert (await next_ring(stream))["meta"]["todo_id"] == str(gated.pk)
        await close(stream)

    async_to_sync(scenario)()


def test_no_attached_session_drops_silently_and_pull_drains_it_later(vend, caplog):
    endpoint, credential = vend("nobody-home")
    todo = make_ready_todo(endpoint, title="waits")  # rung after commit: no session, no error
    assert doorbells.ring_todo(todo) is None
    assert Todo.objects.get(pk=todo.pk).state == "pending"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    d = McpDriver(endpoint.slug, credential)
    d.initialize()
    claimed = d.call("claim_next")["result"]["structuredContent"]["todo"]
    assert claimed["id"] == str(todo.pk) and claimed["state"] == "claimed"


def test_duplicate_notifications_do_not_double_process(driver):
    d = driver()
    todo = make_ready_todo(d.endpoint, title="twice")
    assert doorbells.ring_todo(todo) and doorbells.ring_todo(todo)  # at-least-once
    first = d.call("claim", {"todo_id": str(todo.pk)})["result"]
    second = d.call("claim", {"todo_id": str(todo.pk)})["result"]
    assert not first["isError"]
    assert second["isError"] and second["structuredContent"]["error"]["code"] == "not_claimable"
    assert Todo.objects.get(pk=todo.pk).attempts == 1


def test_slow_subscriber_is_dropped_not_blocked(driver, caplog):
    """A client that stops reading: the publisher never waits, the stream holds at most its
    buffer and drops (and logs) the rest; the todos stay pullable."""
    d = driver()
    buffer_frames, published = 3, 8
    slow_app = URLRouter([re_path(mcp_shell.ROUTE_PATTERN, mcp_shell.McpEndpoint(
        keepalive_seconds=30, thread_sensitive=True, buffer_frames=buffer_frames))])
    todos = [make_ready_todo(d.endpoint, title=f"t{i}") for i in range(published)]
    # Their creation rang the (streamless) session; let those sends finish before the stream
    # opens, so none of them lands in it late.
    assert publish.wait_for_sends(DEADLINE_SECONDS)
    session_id = d.session_id
    # While the client is stalled on its first frame (the reconnect digest), one more frame
    # may sit in the pump's pending read besides the buffer; everything else must be dropped.
    held_at_most = buffer_frames + 1

    async def scenario():
        released = asyncio.Event()
        frames = []

        async def slow_send(message):
            if b"data: " in message.get("body", b""):
                frames.append(message["body"])
                await released.wait()  # the client reads nothing more until released

        async def until(condition):
            loop = asyncio.get_running_loop()
            deadline = loop.time() + FRAME_DEADLINE_SECONDS
            while not condition():
                assert loop.time() < deadline, "condition not reached before the deadline"
                await asyncio.sleep(0.01)

        inputs = asyncio.Queue()
        await inputs.put({"type": "http.request", "body": b"", "more_body": False})
        task = asyncio.ensure_future(slow_app(stream_scope(d), inputs.get, slow_send))
        # The stream is open (and joined its group) once the client got the reconnect digest.
        await until(lambda: len(frames) == 1)
        assert doorbells.is_digest(json.loads(frames[0].decode().split("data: ", 1)[1])["params"])

        def publish_all():
            sent = [doorbells.send_doorbell(session_id, doorbells.todo_doorbell(t),
                                            {"endpoint": d.slug, "todo_id": str(t.pk)})
                    for t in todos]
            return sent, publish.wait_for_sends(DEADLINE_SECONDS)

        sent, idle = await asyncio.to_thread(publish_all)
        assert all(sent) and idle  # the publisher finished while the client still reads nothing

        def drops():
            return [r for r in caplog.records if r.getMessage() == "doorbell dropped: stream buffer full"]

        # Bounded: with an unbounded buffer nothing would ever be dropped and this times out.
        await until(lambda: len(drops()) >= published - held_at_most)
        assert len(frames) == 1  # still stalled: nothing more went out
        assert {r.endpoint for r in drops()} == {d.slug}
        released.set()
        # Every published doorbell was either delivered or dropped.
        await until(lambda: len(frames) - 1 + len(drops()) == published)
        await inputs.put({"type": "http.disconnect"})
        await asyncio.wait_for(task, DEADLINE_SECONDS)
        return frames, drops()

    caplog.set_level(logging.INFO)
    from switchboard import metrics

    def counted():
        counts = metrics.read_doorbell_counts()
        return counts["sent|"], counts["dropped|stream_buffer_full"]

    sent_before, dropped_before = counted()
    frames, dropped = async_to_sync(scenario)()
    sent_after, dropped_after = counted()
    assert dropped_after - dropped_before == len(dropped)
    assert sent_after - sent_before == len(frames)
    # The digest plus at most what the stream may hold; the rest was dropped and logged.
    assert len(frames) - 1 <= held_at_most
    assert len(dropped) >= published - held_at_most
    assert Todo.objects.filter(endpoint=d.endpoint, state="pending").count() == published


def test_pool_rotates_and_prefers_a_session_with_an_open_stream(vend):
    endpoint, _ = vend("pool")
    todo = make_ready_todo(endpoint)  # before any session: its create doorbell rings nobody
    now = timezone.now()
    a, b, c = (session_transitions.open_session(endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25")
               for _ in range(3))

    def choose(offset):
        chosen = rings.choose_doorbell_session(
            endpoint_id=endpoint.pk, todo_id=todo.pk, now=now + timedelta(seconds=offset))
        return chosen and chosen[0]

    # No stream anywhere: fall back to the attached sessions, taking turns.
    assert {choose(0), choose(1), choose(2)} == {a.pk, b.pk, c.pk}
    session_transitions.attach_stream(endpoint=endpoint, session_id=a.pk)
    session_transitions.attach_stream(endpoint=endpoint, session_id=b.pk)
    picks = [choose(10 + i) for i in range(4)]
    assert set(picks) == {a.pk, b.pk} and picks[0] != picks[1]  # streaming ones, in turn
    session_transitions.terminate_session(endpoint=endpoint, session_id=a.pk)
    session_transitions.terminate_session(endpoint=endpoint, session_id=b.pk)
    session_transitions.terminate_session(endpoint=endpoint, session_id=c.pk)
    assert choose(20) is None  # terminated sessions are not attached


def test_concurrent_publishers_spread_over_the_pool(vend):
    endpoint, _ = vend("busy-pool")
    sessions = [session_transitions.open_session(endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25")
                for _ in range(4)]
    todo = make_ready_todo(endpoint)
    picks, barrier = [], threading.Barrier(8)

    def publisher():
        from django.db import connection

        barrier.wait()
        try:
            for _ in range(5):
                picks.append((rings.choose_doorbell_session(
                    endpoint_id=endpoint.pk, todo_id=todo.pk) or (None,))[0])
        finally:
            connection.close()

    threads = [threading.Thread(target=publisher) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert None not in picks and len(picks) == 40
    counts = {s.pk: picks.count(s.pk) for s in sessions}
    assert min(counts.values()) >= 5, counts  # every session takes turns (fair would be 10)


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL row locks")
def test_a_streaming_session_held_by_another_publisher_is_waited_for_never_traded_for_a_streamless_one(
        vend):
    """Another publisher holds the streaming session's row (mid-statement, as in a burst of
    hand-overs): the doorbell waits for it rather than skipping to the streamless session,
    whose doorbell would be dropped. Deterministic: the row is held by a real transaction
    until the ringing statement either waits on it or has already answered."""
    endpoint, _ = vend("held-row")
    streaming, streamless = (session_transitions.open_session(
        endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25")
        for _ in range(2))
    session_transitions.attach_stream(endpoint=endpoint, session_id=streaming.pk)
    todo = make_ready_todo(endpoint, title="burst")
    McpSession.objects.update(last_doorbell_at=None)
    holding, release, answers = threading.Event(), threading.Event(), []

    def hold_the_streaming_row():
        try:
            with transaction.atomic():
                McpSession.objects.select_for_update().get(pk=streaming.pk)
                holding.set()
                release.wait(30)
        finally:
            connection.close()

    def ring():
        try:
            answers.append(rings.choose_doorbell_session(
                endpoint_id=endpoint.pk, todo_id=todo.pk))
        finally:
            connection.close()

    holder, ringer = threading.Thread(target=hold_the_streaming_row), threading.Thread(target=ring)
    holder.start()
    assert holding.wait(10)
    ringer.start()

    def ringer_waits_on_a_lock():
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                           " AND query LIKE '%%WITH picked AS%%' AND pid <> pg_backend_pid()")
            return cursor.fetchone()[0] > 0

    from tests.processes import poll

    assert poll(lambda: answers or ringer_waits_on_a_lock())
    release.set()
    holder.join(10)
    ringer.join(10)
    assert answers == [(streaming.pk, True)]
    assert McpSession.objects.get(pk=streamless.pk).last_doorbell_at is None


def test_a_doorbell_lost_to_an_unreachable_redis_is_counted_and_logged_once_as_dropped(
        vend, settings, caplog):
    """Redis is down (the channel layer points at a closed port): the doorbell is one INFO line
    "doorbell dropped" with its context, never also "doorbell rung" or a second "publish
    dropped" line, and the /metrics drop counter moves (the sent one does not)."""
    from switchboard import metrics

    endpoint, credential = vend("redis-gone")
    session = session_transitions.open_session(endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25")
    session_transitions.attach_stream(endpoint=endpoint, session_id=session.pk)
    todo = make_ready_todo(endpoint, title="still pullable")
    # Its creation ring, while Redis was still there.
    assert publish.wait_for_sends(DEADLINE_SECONDS)
    settings.CHANNEL_LAYERS = {"default": {
        "BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer",
        "CONFIG": {"hosts": ["redis://127.0.0.1:1/0"]}}}  # nothing listens on port 1

    def series(name, **labels):
        return metrics.REGISTRY.get_sample_value(name, labels) or 0.0

    reason = {"reason": "channel_layer_send_failed"}
    dropped_before = series("switchboard_doorbells_dropped_total", **reason)
    sent_before = series("switchboard_doorbells_sent_total")
    caplog.clear()
    caplog.set_level(logging.INFO)
    assert doorbells.ring_todo(todo) == session.pk
    assert publish.wait_for_sends(DEADLINE_SECONDS)
    lines = [r for r in caplog.records if getattr(r, "todo_id", None) == str(todo.pk)]
    assert [r.getMessage() for r in lines] == ["doorbell dropped: channel layer send failed"]
    [dropped] = lines
    assert dropped.levelno == logging.INFO and dropped.endpoint == endpoint.slug
    assert dropped.error  # the exception's type, never its text
    assert dropped.session == session.pk[:8]  # the session id is an identifier, logged short
    assert credential not in caplog.text
    assert series("switchboard_doorbells_dropped_total", **reason) - dropped_before == 1
    assert series("switchboard_doorbells_sent_total") == sent_before
    assert Todo.objects.get(pk=todo.pk).state == "pending"


def test_a_failing_doorbell_never_fails_the_committing_write(vend, monkeypatch, caplog):
    endpoint, _ = vend("fragile")
    session_transitions.open_session(endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25")

    def broken(**kwargs):
        raise RuntimeError("database hiccup")

    monkeypatch.setattr(rings, "choose_doorbell_session", broken)
    todo = make_ready_todo(endpoint, title="committed anyway")
    assert Todo.objects.get(pk=todo.pk).state == "pending"
    failed = [r for r in caplog.records if r.getMessage() == "publish listener failed"]
    assert failed and failed[0].todo_id == str(todo.pk) and failed[0].endpoint_id == endpoint.pk


# -- a stream outlives a Redis outage (review C) -------------------------------------------------


@pytest.mark.skipif(__import__("shutil").which("redis-server") is None,
                    reason="needs redis-server")
@pytest.mark.parametrize("redis_down_at_open", [True, False],
                         ids=["down-at-open", "lost-while-open"])
def test_stream_rejoins_its_group_when_redis_returns(vend, settings, redis_down_at_open):
    """A stream that opened while Redis was down, or lost it later, rings again once Redis is
    back: it retries joining its group instead of staying deaf until the client reconnects.
    A private redis-server on a spare port (never the shared one) is stopped and started."""
    import subprocess

    from channels.layers import channel_layers

    from tests.test_doorbell_e2e import OwnRedis, poll

    redis = OwnRedis()
    redis.start()
    settings.CHANNEL_LAYERS = {"default": {
        "BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer",
        "CONFIG": {"hosts": [redis.url], "prefix": "sbrejoin"}}}
    channel_layers.backends.clear()
    quick = URLRouter([re_path(mcp_shell.ROUTE_PATTERN, mcp_shell.McpEndpoint(
        keepalive_seconds=30, thread_sensitive=True, layer_retry_seconds=(0.05, 0.2)))])
    endpoint, credential = vend("deaf")
    d = McpDriver(endpoint.slug, credential)
    d.initialize()

    def subscribed():
        out = subprocess.run(["redis-cli", "-p", str(redis.port), "PUBSUB", "CHANNELS", "*"],
                             capture_output=True, text=True).stdout
        return "mcp.session" in out

    try:
        if redis_down_at_open:
            redis.stop()

        async def scenario():
            stream = await asyncio.wait_for(open_stream(d, quick), DEADLINE_SECONDS)
            if not redis_down_at_open:
                assert await asyncio.to_thread(poll, subscribed)
                await asyncio.to_thread(redis.stop)
            await asyncio.to_thread(redis.start)
            # Joined again (a poll on the private Redis, not a sleep); then ring.
            assert await asyncio.to_thread(poll, subscribed)
            todo = await ring(endpoint, title="after redis came back")
            params = await next_ring(stream)
            await close(stream)
            return todo, params

        todo, params = async_to_sync(scenario)()
        assert params["meta"]["todo_id"] == str(todo.pk)
    finally:
        redis.stop()
        channel_layers.backends.clear()


def fail_claimed(endpoint, todo_id):
    """Claim and fail ``todo_id`` as an agent would: a waiting retry (failed, retry_at set)."""
    from todos import transitions as todo_transitions

    caller = todo_transitions.Caller.agent(endpoint, "worker")
    claimed = todo_transitions.claim_todo(caller, todo_id)
    return todo_transitions.fail_todo(caller, todo_id, lease_id=claimed.lease_id, error="boom")


@pytest.mark.parametrize("becomes_ready", ["retry", "requeue"])
def test_a_todo_that_becomes_ready_again_rings(driver, becomes_ready):
    """§7's other triggers: a retry promoted by the sweep, and an operator's requeue."""
    from todos import sweeps as todo_sweeps
    from todos import transitions as todo_transitions

    d = driver()

    def ready_again(todo):
        failed = fail_claimed(d.endpoint, todo.pk)
        if becomes_ready == "retry":
            assert todo_sweeps.promote_due_retries(
                now=failed.retry_at + timedelta(seconds=1)) == 1
        else:
            todo_transitions.requeue_todo(
                todo_transitions.Caller.operator(d.endpoint, "alice"), todo.pk)

    async def scenario():
        stream = await open_stream(d)
        todo = await ring(d.endpoint, title="flaky")
        assert (await next_ring(stream))["meta"]["todo_id"] == str(todo.pk)
        await database_sync_to_async(ready_again, thread_sensitive=False)(todo)
        params = await next_ring(stream)
        await close(stream)
        return todo, params

    todo, params = async_to_sync(scenario)()
    assert params["meta"]["todo_id"] == str(todo.pk)
    assert Todo.objects.get(pk=todo.pk).state == "pending"
