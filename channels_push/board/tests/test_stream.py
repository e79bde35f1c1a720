"""/todos/events with the Channels communicator against the real Redis channel layer.

These tests commit (transactional_db): the consumer reads the database from its own thread and
the publish helper fires only after commit, exactly as in production.
"""

import asyncio
import json
import time
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.testing import ApplicationCommunicator
from django.conf import settings
from django.db import transaction

from channels_push.board import hub
from channels_push.board import rendering
from channels_push.board import rights
from channels_push.board import stream as board_stream
from channels_push.bus import groups, publish
from tests.factories import EndpointFactory, UserFactory
from tests.processes import DEADLINE_SECONDS
from todos import transitions
from todos.models import Trust

pytestmark = pytest.mark.django_db(transaction=True)

WAIT_SECONDS = DEADLINE_SECONDS


def parse_events(raw: bytes):
    """SSE frames -> [(field dict)], comments as {"comment": text}."""
    events = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        fields = {}
        for line in block.split("\n"):
            if line.startswith(":"):
                fields["comment"] = line[1:].strip()
            else:
                key, _, value = line.partition(": ")
                fields[key] = value
        events.append(fields)
    return events


class Stream:
    """One open /todos/events response driven through the ASGI interface."""

    def __init__(self, user, query=b"", headers=(), app=None, keepalive=None, flush_delay=None,
                 path="/todos/events"):
        kwargs = {"keepalive_interval": keepalive} if keepalive else {}
        if flush_delay:
            kwargs["flush_delay"] = flush_delay
        app = app or board_stream.BoardStreamConsumer.as_asgi(**kwargs)
        scope = {
            "type": "http", "method": "GET", "path": path, "query_string": query,
            "headers": list(headers), "client": ("127.0.0.1", 1), "server": ("testserver", 80),
        }
        if user is not None:
            scope["user"] = user
        self.communicator = ApplicationCommunicator(app, scope)
        self.pending = []

    async def open(self):
        await self.communicator.send_input({"type": "http.request", "body": b"", "more_body": False})
        self.start = await self.communicator.receive_output(WAIT_SECONDS)
        return self.start

    async def next_event(self, *, kind=None):
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            while self.pending:
                event = self.pending.pop(0)
                if kind is None or event.get("event") == kind or (kind == "comment" and "comment" in event):
                    return event
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no {kind or 'event'} within {WAIT_SECONDS} s"
            message = await self.communicator.receive_output(remaining)
            assert message["type"] == "http.response.body"
            self.pending.extend(parse_events(message["body"]))

    async def expect_no_todo_event(self, timeout=0.5):
        # Drain what is there; nothing about todos may be among it.
        assert not [e for e in self.pending if e.get("event") == "todo"]
        while not await self.communicator.receive_nothing(timeout):
            message = await self.communicator.receive_output(WAIT_SECONDS)
            assert b"event: todo" not in message["body"], message

    async def close(self):
        await self.communicator.send_input({"type": "http.disconnect"})
        await self.communicator.wait(WAIT_SECONDS)


def create(endpoint, title, **kwargs):
    todo, _ = transitions.create_todo(endpoint=endpoint, queue=kwargs.pop("queue", "inbox"),
                                      title=title, actor="test", **kwargs)
    return todo


@pytest.fixture
def alice(db):
    return UserFactory(username="alice")


@pytest.fixture
def bob(db):
    return UserFactory(username="bob")


def run(coro_fn):
    async_to_sync(coro_fn)()


def test_settings_use_the_real_redis_channel_layer():
    assert settings.CHANNEL_LAYERS["default"]["BACKEND"].startswith("channels_redis.")


def test_anonymous_gets_403():
    from django.contrib.auth.models import AnonymousUser

    async def scenario():
        stream = Stream(AnonymousUser())
        start = await stream.open()
        assert start["status"] == 403
        body = await stream.communicator.receive_output(WAIT_SECONDS)
        assert body["more_body"] is False
        await stream.communicator.wait(WAIT_SECONDS)

    run(scenario)


def test_stream_opens_with_sync_then_sends_new_todos_with_id_and_trust_badge(alice):
    endpoint = EndpointFactory(slug="alices", owner=alice)

    async def scenario():
        stream = Stream(alice)
        start = await stream.open()
        assert start["status"] == 200
        assert (b"content-type", b"text/event-stream") in start["headers"]
        retry = await stream.next_event()
        assert retry == {"retry": "2000"}
        sync = await stream.next_event(kind="sync")
        assert json.loads(sync["data"]) == {"resumed_after": None}

        todo = await sync_to_async(create)(endpoint, "hello <b>world</b>", trust=Trust.SIGNED,
                                           payload={"token": {"$secret": "s1"}})
        event = await stream.next_event(kind="todo")
        data = json.loads(event["data"])
        assert data["todo_id"] == str(todo.pk) and data["action"] == "create"
        assert data["state"] == "pending"
        assert int(event["id"]) == data["version"] > 0
        assert 'trust-signed"' in data["html"] and f'id="todo-{todo.pk}"' in data["html"]
        assert "hello &lt;b&gt;world&lt;/b&gt;" in data["html"]  # escaped
        assert "s1" not in data["html"]  # no payload on the board row

        caller = transitions.Caller.operator(endpoint, "alice")
        await sync_to_async(transitions.claim_todo)(caller, todo.pk)
        claimed = json.loads((await stream.next_event(kind="todo"))["data"])
        assert claimed["action"] == "claim" and claimed["state"] == "claimed"
        assert claimed["version"] > data["version"]
        await stream.close()

    run(scenario)


def test_operator_never_receives_another_operators_todos(alice, bob):
    alices = EndpointFactory(slug="alices", owner=alice)
    bobs = EndpointFactory(slug="bobs", owner=bob)

    async def scenario():
        stream = Stream(alice)
        await stream.open()
        await stream.next_event(kind="sync")
        await sync_to_async(create)(bobs, "bob one")
        mine = await sync_to_async(create)(alices, "alice one")
        event = json.loads((await stream.next_event(kind="todo"))["data"])
        assert event["todo_id"] == str(mine.pk)
        await sync_to_async(create)(bobs, "bob two")
        # Every send has reached Redis before we look for leaks.
        assert await sync_to_async(publish.wait_for_sends)(WAIT_SECONDS)
        await stream.expect_no_todo_event()
        await stream.close()

    run(scenario)


def test_superuser_receives_every_endpoints_todos(alice, bob):
    root = UserFactory(username="root", is_superuser=True)
    alices = EndpointFactory(slug="alices", owner=alice)
    bobs = EndpointFactory(slug="bobs", owner=bob)

    async def scenario():
        stream = Stream(root)
        await stream.open()
        await stream.next_event(kind="sync")
        first = await sync_to_async(create)(bobs, "bob one")
        second = await sync_to_async(create)(alices, "alice one")
        got = {json.loads((await stream.next_event(kind="todo"))["data"])["todo_id"] for _ in range(2)}
        assert got == {str(first.pk), str(second.pk)}
        await stream.close()

    run(scenario)


def test_endpoint_vended_after_the_stream_opened_is_visible_to_its_owner(alice, bob):
    async def scenario():
        stream = Stream(alice)
        await stream.open()
        await stream.next_event(kind="sync")
        bobs = await sync_to_async(EndpointFactory)(slug="bobs-new", owner=bob)
        await sync_to_async(create)(bobs, "bob's")
        alices = await sync_to_async(EndpointFactory)(slug="alices-new", owner=alice)
        todo = await sync_to_async(create)(alices, "alice's")
        event = json.loads((await stream.next_event(kind="todo"))["data"])
        assert event["todo_id"] == str(todo.pk)
        await stream.close()

    run(scenario)


def test_filtered_stream_drops_rows_that_leave_the_filter(alice):
    endpoint = EndpointFactory(slug="alices", owner=alice)

    async def scenario():
        stream = Stream(alice, query=b"state=pending&queue=inbox")
        await stream.open()
        await stream.next_event(kind="sync")
        todo = await sync_to_async(create)(endpoint, "pending one")
        assert json.loads((await stream.next_event(kind="todo"))["data"])["html"]
        await sync_to_async(transitions.claim_todo)(transitions.Caller.operator(endpoint, "alice"), todo.pk)
        gone = json.loads((await stream.next_event(kind="todo"))["data"])
        assert gone["todo_id"] == str(todo.pk) and gone["html"] is None
        # The streamed row's buttons come back to the filtered board.
        await stream.close()

    run(scenario)


def test_keep_alive_comments_flow_while_idle(alice):
    async def scenario():
        stream = Stream(alice, keepalive=timedelta(milliseconds=50))
        await stream.open()
        await stream.next_event(kind="sync")
        assert (await stream.next_event(kind="comment"))["comment"] == "keep-alive"
        assert (await stream.next_event(kind="comment"))["comment"] == "keep-alive"
        await stream.close()

    run(scenario)


def test_reconnect_resyncs_so_a_change_made_while_disconnected_is_not_lost(alice, client):
    """The stream is subscribed before it says ``sync``; the page then re-fetches its rows. A
    todo created while no stream was open is in that re-fetch."""
    endpoint = EndpointFactory(slug="alices", owner=alice)
    client.force_login(alice)

    async def scenario():
        stream = Stream(alice)
        await stream.open()
        await stream.next_event(kind="sync")
        first = await sync_to_async(create)(endpoint, "before the drop")
        event = await stream.next_event(kind="todo")
        await stream.close()

        missed = await sync_to_async(create)(endpoint, "while disconnected")

        again = Stream(alice, headers=[(b"last-event-id", event["id"].encode())])
        await again.open()
        sync = json.loads((await again.next_event(kind="sync"))["data"])
        assert sync == {"resumed_after": event["id"]}
        rows = (await sync_to_async(client.get)("/todos/rows")).content.decode()
        assert f'id="todo-{missed.pk}"' in rows and f'id="todo-{first.pk}"' in rows
        # and the resumed stream carries what happens next
        later = await sync_to_async(create)(endpoint, "after the reconnect")
        # Publishing is fire-and-forget, so the missed todo's own announcement may still reach
        # the new stream first; the page ignores it (same version). Wait for the later one.
        seen = []
        while str(later.pk) not in seen:
            seen.append(json.loads((await again.next_event(kind="todo"))["data"])["todo_id"])
        assert set(seen) <= {str(missed.pk), str(later.pk)}
        await again.close()

    run(scenario)


def test_disconnect_leaves_the_group(alice):
    endpoint = EndpointFactory(slug="alices", owner=alice)

    async def scenario():
        stream = Stream(alice)
        await stream.open()
        await stream.next_event(kind="sync")
        await stream.close()  # returns only when the consumer has stopped
        # publishing after the consumer left must not fail or block
        await sync_to_async(create)(endpoint, "nobody listening")

    run(scenario)


def test_full_asgi_application_authenticates_by_session_cookie(alice, client):
    """Through switchboard.asgi: AuthMiddlewareStack reads the Django session cookie."""
    from switchboard.asgi import application

    endpoint = EndpointFactory(slug="alices", owner=alice)
    client.force_login(alice)
    cookie = f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"

    async def scenario():
        anonymous = Stream(None, app=application)
        assert (await anonymous.open())["status"] == 403
        stream = Stream(None, app=application, headers=[(b"cookie", cookie.encode())])
        assert (await stream.open())["status"] == 200
        await stream.next_event(kind="sync")
        todo = await sync_to_async(create)(endpoint, "via the real router")
        assert json.loads((await stream.next_event(kind="todo"))["data"])["todo_id"] == str(todo.pk)
        await stream.close()

    run(scenario)


def test_a_failed_render_ends_the_stream_so_the_browser_reconnects_and_resyncs(alice, monkeypatch):
    """Fault injection (the database going away mid-stream): not a mock of the database, the
    real query never runs; the stream must end rather than silently skip the rows."""
    from django.db import OperationalError

    endpoint = EndpointFactory(slug="alices", owner=alice)

    def database_gone(*args, **kwargs):
        raise OperationalError("server closed the connection unexpectedly")

    async def scenario():
        stream = Stream(alice)
        await stream.open()
        await stream.next_event(kind="sync")
        monkeypatch.setattr(rendering, "fetch_board_todos", database_gone)
        await sync_to_async(create)(endpoint, "cannot be shown")
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            message = await stream.communicator.receive_output(deadline - time.monotonic())
            if not message.get("more_body", False):
                break
            assert b"event: todo" not in message["body"]
        await stream.communicator.wait(WAIT_SECONDS)

    run(scenario)


def failing_todo_sends(app):
    """``app`` behind a client connection that breaks as the first todo row is written to it (a
    peer that reset the connection): the server's ``send`` raises. Everything else (the
    response start, ``sync``, the end of the response) goes through, so the test sees the
    stream end."""
    async def wrapped(scope, receive, send):
        async def send_or_fail(message):
            if b"event: todo" in message.get("body", b""):
                raise ConnectionResetError("the client's connection was reset")
            await send(message)

        await app(scope, receive, send_or_fail)
    return wrapped


async def next_todo_id(stream, name):
    try:
        return json.loads((await stream.next_event(kind="todo"))["data"])["todo_id"]
    except TimeoutError:
        pytest.fail(f"the stream {name} the broken one never got the batch")


async def expect_end_without_todo_events(stream):
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        message = await stream.communicator.receive_output(deadline - time.monotonic())
        assert b"event: todo" not in message.get("body", b"")
        if not message.get("more_body", False):
            break
    await stream.communicator.wait(WAIT_SECONDS)


def test_a_failed_send_ends_only_that_stream_and_the_others_still_get_the_batch(alice):
    """The hub sends one batch to every stream of the process in turn: a stream whose
    connection fails mid-send is stopped (its browser reconnects and re-syncs), and the streams
    after it in the hub still get the batch, and the next one."""
    endpoint = EndpointFactory(slug="alices", owner=alice)
    broken_app = failing_todo_sends(board_stream.BoardStreamConsumer.as_asgi())

    async def scenario():
        # Added to the hub in this order: the broken stream sits between two healthy ones.
        before, broken, after = Stream(alice), Stream(alice, app=broken_app), Stream(alice)
        for stream in (before, broken, after):
            assert (await stream.open())["status"] == 200
            await stream.next_event(kind="sync")
        todo = await sync_to_async(create)(endpoint, "to everyone still listening")
        for name, stream in (("before", before), ("after", after)):
            assert await next_todo_id(stream, name) == str(todo.pk)
        await expect_end_without_todo_events(broken)
        # The hub goes on with the two healthy streams.
        later = await sync_to_async(create)(endpoint, "the next batch")
        for name, stream in (("before", before), ("after", after)):
            assert await next_todo_id(stream, name) == str(later.pk)
            await stream.close()

    run(scenario)


def test_a_failed_render_ends_every_board_stream_of_the_hub(alice, bob, monkeypatch):
    """One render serves every stream of the process: when it fails, no stream can be given
    the batch, so every one of them ends (each browser reconnects and re-syncs), whatever its
    viewer or view."""
    from django.db import OperationalError

    endpoint = EndpointFactory(slug="alices", owner=alice)
    EndpointFactory(slug="bobs", owner=bob)

    def database_gone(*args, **kwargs):
        raise OperationalError("server closed the connection unexpectedly")

    async def scenario():
        streams = [Stream(alice), Stream(alice, query=b"queue=inbox"), Stream(bob)]
        for stream in streams:
            assert (await stream.open())["status"] == 200
            await stream.next_event(kind="sync")
        monkeypatch.setattr(rendering, "render_batch", database_gone)
        await sync_to_async(create)(endpoint, "cannot be shown")
        for stream in streams:
            await expect_end_without_todo_events(stream)

    run(scenario)


def test_a_burst_of_changes_to_one_todo_is_rendered_once(alice):
    endpoint = EndpointFactory(slug="alices", owner=alice)
    caller = transitions.Caller.operator(endpoint, "alice")

    def burst():
        todo = create(endpoint, "busy")
        transitions.claim_todo(caller, todo.pk)
        transitions.heartbeat_todo(caller, todo.pk)
        transitions.complete_todo(caller, todo.pk)
        return todo

    async def scenario():
        stream = Stream(alice, flush_delay=timedelta(seconds=1))
        await stream.open()
        await stream.next_event(kind="sync")
        todo = await sync_to_async(burst)()
        event = json.loads((await stream.next_event(kind="todo"))["data"])
        assert event["todo_id"] == str(todo.pk)
        assert event["state"] == "done" and event["action"] == "complete"
        await stream.expect_no_todo_event()
        await stream.close()

    run(scenario)


def test_a_batch_of_rows_renders_in_one_query(alice, django_assert_num_queries):
    endpoint = EndpointFactory(slug="alices", owner=alice)
    todos = [create(endpoint, f"t{n}", queue="inbox" if n % 2 else "reviews") for n in range(10)]
    with django_assert_num_queries(1):
        rows = rendering.render_changes([str(t.pk) for t in todos] + ["junk"],
                                           {"endpoint_slug": None, "queue": "inbox", "state": None},
                                           "/todos/?queue=inbox")
    assert [row["todo_id"] for row in rows] == [str(t.pk) for t in todos]
    assert [row["html"] is not None for row in rows] == [n % 2 == 1 for n in range(10)]
    assert all(row["version"] > 0 for row in rows)


def test_a_burst_of_commits_reaches_the_board_group_in_one_batched_message(alice):
    """Board changes leave a process in batches (publish._BoardBatch): twenty claims committed
    together are one channel-layer message, not twenty, and every change is in it."""
    from channels.layers import get_channel_layer

    endpoint = EndpointFactory(slug="alices", owner=alice)
    todos = [create(endpoint, f"t{i}") for i in range(20)]
    assert publish.wait_for_sends(WAIT_SECONDS)

    def claim_all_in_one_commit():
        caller = transitions.Caller.operator(endpoint, "alice")
        with transaction.atomic():
            for todo in todos:
                transitions.claim_todo(caller, todo.pk)
        assert publish.wait_for_sends(WAIT_SECONDS)

    async def scenario():
        layer = get_channel_layer()
        channel = await layer.new_channel()
        await layer.group_add(groups.BOARD_GROUP, channel)
        try:
            await sync_to_async(claim_all_in_one_commit)()
            # The first message may take a loaded machine a while to read; any further one was
            # sent already (wait_for_sends), so a short silence after it means there is none.
            messages = [await asyncio.wait_for(layer.receive(channel), WAIT_SECONDS)]
            while True:
                try:
                    messages.append(await asyncio.wait_for(layer.receive(channel), 0.5))
                except asyncio.TimeoutError:
                    return messages
        finally:
            await layer.group_discard(groups.BOARD_GROUP, channel)

    messages = async_to_sync(scenario)()
    assert [m["type"] for m in messages] == ["todos.changed"]
    changes = messages[0]["changes"]
    assert [c["todo_id"] for c in changes] == [str(t.pk) for t in todos]
    assert {c["action"] for c in changes} == {"claim"} and {c["state"] for c in changes} == {"claimed"}


def test_a_forked_child_does_not_inherit_a_board_batch_it_can_never_send():
    """Celery's prefork children are forked: a batch the parent had scheduled (its timer on a
    loop thread the child does not have) must not leave the child's batcher stuck."""
    import os

    with publish._board_batch._lock:
        publish._board_batch._scheduled = True
        publish._board_batch._changes.append({"todo_id": "1"})
    try:
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status only
            batch = publish._board_batch
            os._exit(0 if (batch._scheduled, batch._changes, publish._sender._pending)
                     == (False, [], 0) else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        with publish._board_batch._lock:
            publish._board_batch._scheduled = False
            publish._board_batch._changes.clear()


def test_many_board_streams_share_one_read_and_one_render_per_view_per_batch(
        alice, bob, monkeypatch):
    """Issue 17: every board stream of a process is fed by its one hub. A committed batch is
    read once (owners included) and rendered once per view, whatever the number of streams;
    each stream still gets only the rows its viewer may see."""
    root = UserFactory(username="root", is_superuser=True)
    alices = EndpointFactory(slug="alices", owner=alice)
    bobs = EndpointFactory(slug="bobs", owner=bob)
    reads, renders = [], []
    fetch, render = rendering.fetch_board_todos, rendering.render_rows
    monkeypatch.setattr(rendering, "fetch_board_todos",
                        lambda ids: reads.append(sorted(ids)) or fetch(ids))
    monkeypatch.setattr(rendering, "render_rows",
                        lambda todos, filters, url: renders.append(url) or render(todos, filters, url))

    def two_todos():
        with transaction.atomic():
            return create(alices, "alice's"), create(bobs, "bob's")

    async def scenario():
        streams = {"root": [Stream(root) for _ in range(3)],
                   "alice": [Stream(alice) for _ in range(2)],  # 4 in all: the cap
                   "alice-filtered": [Stream(alice, query=b"queue=inbox") for _ in range(2)],
                   "bob": [Stream(bob) for _ in range(3)]}
        for group in streams.values():
            for stream in group:
                await stream.open()
                await stream.next_event(kind="sync")
        mine, his = await sync_to_async(two_todos)()
        seen = {}
        for name, group in streams.items():
            for stream in group:
                for _ in range(2 if name == "root" else 1):
                    event = await stream.next_event(kind="todo")
                    seen.setdefault(name, set()).add(json.loads(event["data"])["todo_id"])
        assert seen == {"root": {str(mine.pk), str(his.pk)}, "alice": {str(mine.pk)},
                        "alice-filtered": {str(mine.pk)}, "bob": {str(his.pk)}}
        for group in streams.values():
            for stream in group:
                await stream.expect_no_todo_event(timeout=0.2)
                await stream.close()

    run(scenario)
    assert len(reads) == 1 and len(reads[0]) == 2  # one read for ten streams
    assert len(renders) == len(set(renders)) == 2  # one render per view (query string)


def test_a_batch_renders_in_one_query_for_every_view(alice, bob, django_assert_num_queries):
    root = UserFactory(username="root", is_superuser=True)
    todos = [create(EndpointFactory(slug=f"e{n}", owner=alice if n % 2 else bob), f"t{n}")
             for n in range(6)]
    viewers = [rights.find_viewer(user) for user in (root, alice, bob)]
    views = {f"v{n}": ({"endpoint_slug": None, "queue": None, "state": None}, f"/todos/?v={n}",
                       viewers[n:n + 1]) for n in range(3)}
    with django_assert_num_queries(1):
        rendered = rendering.render_batch([str(t.pk) for t in todos], views)
    assert [len(rendered[f"v{n}"]) for n in range(3)] == [6, 3, 3]
    assert {row["owner_id"] for row in rendered["v1"]} == {alice.pk}
    # The header's counts of the six endpoints touched: open counts, then in one snapshot
    # (BEGIN, SET TRANSACTION … COMMIT) the fold row, the tallies and the unfolded events.
    with django_assert_num_queries(7):
        glance = rendering.glance_entries(rendered.endpoints)
    assert sorted(entry["endpoint"] for entry in glance) == [f"e{n}" for n in range(6)]
    assert {entry["owner_id"] for entry in glance} == {alice.pk, bob.pk}
    assert all(entry["queues"]["inbox"]["pending"] == 1 for entry in glance)


def test_many_viewers_are_rechecked_in_two_queries(alice, bob, django_assert_num_queries):
    from django.contrib.auth import get_user_model
    from django.test import Client

    keys = []
    for user in (alice, bob):
        client = Client()
        client.force_login(user)
        keys.append((user.pk, client.cookies[settings.SESSION_COOKIE_NAME].value, True))
        keys.append((user.pk, None, False))
    keys.append((alice.pk, "no-such-session", True))
    get_user_model().objects.filter(pk=bob.pk).update(is_active=False)
    with django_assert_num_queries(2):
        viewers = rights.recheck_viewers(keys)
    assert [viewers[key] is not None for key in keys] == [True, True, False, False, False]
    assert viewers[keys[0]].user_id == alice.pk


def test_a_batch_brings_each_viewer_the_header_counts_of_the_endpoints_they_may_see(alice, bob):
    alices = EndpointFactory(slug="alices", owner=alice)
    bobs = EndpointFactory(slug="bobs", owner=bob)

    def two_todos():
        with transaction.atomic():
            return create(alices, "alice's", queue="deploys"), create(bobs, "bob's")

    async def scenario():
        streams = {"alice": Stream(alice), "bob": Stream(bob)}
        for stream in streams.values():
            await stream.open()
            await stream.next_event(kind="sync")
        await sync_to_async(two_todos)()
        seen = {}
        for name, stream in streams.items():
            glance = json.loads((await stream.next_event(kind="glance"))["data"])
            seen[name] = {entry["endpoint"]: entry for entry in glance["endpoints"]}
            await stream.close()
        box["seen"] = seen

    box = {}
    run(scenario)
    seen = box["seen"]
    assert set(seen["alice"]) == {"alices"} and set(seen["bob"]) == {"bobs"}
    alices_glance = seen["alice"]["alices"]
    assert alices_glance["queues"]["deploys"]["pending"] == 1
    assert "owner_id" not in alices_glance
    assert sum(alices_glance["series"]["minute"]["created"].values()) == 1


def test_the_header_is_read_once_per_interval_however_many_batches(alice, monkeypatch):
    """A pool draining a queue commits batch after batch: the rows go out with every batch,
    the header's counts (four queries) at most once per GLANCE_INTERVAL."""
    endpoint = EndpointFactory(slug="alices", owner=alice)
    monkeypatch.setattr(hub, "GLANCE_INTERVAL", timedelta(minutes=10))
    reads = []
    entries = rendering.glance_entries
    monkeypatch.setattr(rendering, "glance_entries",
                        lambda endpoints: reads.append(len(endpoints)) or entries(endpoints))

    async def scenario():
        stream = Stream(alice)
        await stream.open()
        await stream.next_event(kind="sync")
        seen = []
        for n in range(3):  # three commits, three batches
            await sync_to_async(create)(endpoint, f"t{n}")
            while not seen or seen[-1].get("event") != "todo":
                seen.append(await stream.next_event())
        while [event.get("event") for event in seen].count("glance") < 1:
            seen.append(await stream.next_event())
        (glance,) = [json.loads(event["data"]) for event in seen if event.get("event") == "glance"]
        assert glance["endpoints"][0]["queues"]["inbox"]["pending"] >= 1
        await stream.close()

    run(scenario)
    assert reads == [1]  # the first batch's; the next two wait for the interval
