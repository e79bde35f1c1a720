"""The board stream lives only as long as the right to read it (CONTRACT §12; issue 12 item 2,
issue 15 items 3 and 5): logout, deactivation and a changed owner end or narrow it, a viewer's
streams are capped, and Redis down keeps it alive."""

import json
import time
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.test import override_settings

from channels_push.bus import publish
from channels_push.board.tests.test_stream import WAIT_SECONDS, Stream, create, run
from endpoints.models import Endpoint
from tests.factories import EndpointFactory, UserFactory
from tests.servers import free_port

pytestmark = pytest.mark.django_db(transaction=True)

KEEPALIVE_SECONDS = 0.2


@pytest.fixture
def alice(db):
    return UserFactory(username="alice")


def cookie_for(client, user) -> bytes:
    client.force_login(user)
    return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}".encode()


async def read_until_end(stream, deadline_seconds=WAIT_SECONDS, bodies=None):
    """Every body chunk until the response ends; None when it did not end in time (the
    chunks read meanwhile are in ``bodies`` when given)."""
    bodies = [] if bodies is None else bodies
    end = time.monotonic() + deadline_seconds
    while time.monotonic() < end:
        try:
            message = await stream.communicator.receive_output(end - time.monotonic())
        except TimeoutError:
            return None
        bodies.append(message.get("body", b""))
        if not message.get("more_body", False):
            return bodies
    return None


def test_a_logged_out_board_stream_ends_and_receives_no_further_row(alice, client):
    from switchboard.asgi import application

    endpoint = EndpointFactory(slug="alices", owner=alice)
    cookie = cookie_for(client, alice)

    async def scenario():
        stream = Stream(None, app=application, headers=[(b"cookie", cookie)])
        assert (await stream.open())["status"] == 200
        await stream.next_event(kind="sync")
        todo = await sync_to_async(create)(endpoint, "before logout")
        assert json.loads((await stream.next_event(kind="todo"))["data"])["todo_id"] == str(todo.pk)
        await sync_to_async(client.logout)()
        await sync_to_async(create)(endpoint, "after logout")
        rest = await read_until_end(stream)
        assert rest is not None, "the stream outlived its logout"
        assert not any(b"event: todo" in body for body in rest)
        await stream.communicator.wait(WAIT_SECONDS)
        # This loop is the publisher's "server loop" (switchboard.asgi bound it): let its
        # sends finish before the loop closes, or later tests' sends would wait on it.
        assert await sync_to_async(publish.wait_for_sends)(WAIT_SECONDS)

    run(scenario)


REVOCATIONS = ["session_deleted", "deactivated", "password_changed"]


def revoke(user, revocation):
    from django.contrib.sessions.models import Session

    if revocation == "session_deleted":  # expired, or logged out without the signal
        Session.objects.all().delete()
    elif revocation == "deactivated":
        type(user).objects.filter(pk=user.pk).update(is_active=False)
    else:
        user.set_password("a-new-password-123")
        user.save()


def revoked_viewer_sees_no_row(user, client, revocation, *, with_a_todo=True):
    """Open the board as ``user``, take their right away, commit a todo they owned: the
    stream must end and carry no row of it."""
    from switchboard.asgi import application

    endpoint = EndpointFactory(slug="alices", owner=user)
    cookie = cookie_for(client, user)

    async def scenario():
        stream = Stream(None, app=application, headers=[(b"cookie", cookie)])
        assert (await stream.open())["status"] == 200
        await stream.next_event(kind="sync")
        await sync_to_async(revoke)(user, revocation)
        if with_a_todo:
            await sync_to_async(create)(endpoint, "after the revocation")
        bodies = []
        ended = await read_until_end(stream, bodies=bodies)
        assert not any(b"event: todo" in body for body in bodies), "a row after the right ended"
        assert ended is not None, "the stream outlived its viewer's rights"
        assert await sync_to_async(publish.wait_for_sends)(WAIT_SECONDS)  # see above

    run(scenario)


@override_settings(SWITCHBOARD_STREAM_KEEPALIVE_SECONDS=KEEPALIVE_SECONDS)
@pytest.mark.parametrize("revocation", REVOCATIONS)
def test_the_board_stream_closes_at_its_next_keep_alive_once_its_viewer_loses_the_right(
        alice, client, revocation):
    revoked_viewer_sees_no_row(alice, client, revocation, with_a_todo=False)


# A keep-alive (and so the hub's periodic re-check) that cannot come within the test: what is
# tested is the batch's own re-check, whatever the load and the timing of the two clocks.
@override_settings(SWITCHBOARD_STREAM_KEEPALIVE_SECONDS=600)
@pytest.mark.parametrize("revocation", REVOCATIONS)
def test_a_batch_re_checks_its_viewers_before_sending_a_row(alice, client, revocation):
    revoked_viewer_sees_no_row(alice, client, revocation)


def test_an_endpoint_given_to_another_owner_leaves_the_old_owners_stream(alice):
    bob = UserFactory(username="bob")
    endpoint = EndpointFactory(slug="moving", owner=alice)

    async def scenario():
        stream = Stream(alice, keepalive=timedelta(seconds=KEEPALIVE_SECONDS))
        await stream.open()
        await stream.next_event(kind="sync")
        await sync_to_async(Endpoint.objects.filter(pk=endpoint.pk).update)(owner=bob)
        await stream.next_event(kind="comment")  # a keep-alive re-read the visible set
        await stream.next_event(kind="comment")
        await sync_to_async(create)(endpoint, "bob's now")
        seen = []
        while sum(1 for e in seen if "comment" in e) < 5:  # well past the flush delay
            seen.append(await stream.next_event())
        assert not [e for e in seen if e.get("event") == "todo"]
        await stream.close()

    run(scenario)


def over_the_cap_the_oldest_closes(make_streams):
    """With a cap of 2 (``SWITCHBOARD_MAX_OPEN_STREAMS``), the third of ``make_streams()``
    (one viewer's streams, opened in order) closes the first; the others stay open."""
    async def scenario():
        streams = make_streams()
        for stream in streams:
            assert (await stream.open())["status"] == 200
            await stream.next_event(kind="sync")
        assert await read_until_end(streams[0]) is not None  # the oldest was closed
        for stream in streams[1:]:
            assert await stream.communicator.receive_nothing(0.3)  # still open
            await stream.close()

    run(scenario)


@override_settings(SWITCHBOARD_MAX_OPEN_STREAMS=2)
def test_a_viewers_stream_over_the_cap_closes_their_oldest(alice):
    over_the_cap_the_oldest_closes(lambda: [Stream(alice) for _ in range(3)])


def with_redis_down_it_opens_and_keeps_its_keep_alives(make_stream):
    """The channel layer at a port where nothing listens: ``make_stream()`` still opens (200)
    and keeps its keep-alives, and sends no ``sync`` (it is not subscribed)."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    layers = {"default": {"BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer",
                          "CONFIG": {"hosts": [dead], "prefix": "dead"}}}

    async def scenario():
        stream = make_stream()
        start = await stream.open()
        assert start["status"] == 200, start
        assert (await stream.next_event(kind="comment"))["comment"] == "keep-alive"
        assert (await stream.next_event(kind="comment"))["comment"] == "keep-alive"
        assert not [e for e in stream.pending if e.get("event") == "sync"]
        await stream.close()

    with override_settings(CHANNEL_LAYERS=layers):
        run(scenario)


def test_with_redis_down_the_board_stream_opens_and_keeps_its_keep_alives(alice):
    with_redis_down_it_opens_and_keeps_its_keep_alives(
        lambda: Stream(alice, keepalive=timedelta(seconds=KEEPALIVE_SECONDS)))


def test_the_shared_recheck_ends_only_the_streams_of_the_viewer_who_lost_the_right(alice):
    """Issue 17: one re-check per keep-alive interval covers every board stream of the process;
    a deactivated operator's streams end, the others' stay open."""
    bob = UserFactory(username="bob")
    interval = timedelta(seconds=KEEPALIVE_SECONDS)

    async def scenario():
        alices = [Stream(alice, keepalive=interval) for _ in range(2)]
        bobs = [Stream(bob, keepalive=interval) for _ in range(2)]
        for stream in alices + bobs:
            assert (await stream.open())["status"] == 200
        await sync_to_async(type(bob).objects.filter(pk=bob.pk).update)(is_active=False)
        for stream in bobs:
            assert await read_until_end(stream) is not None, "a deactivated viewer's stream"
        for stream in alices:
            seen = [await stream.next_event(kind="comment") for _ in range(3)]  # re-checked
            assert len(seen) == 3
            await stream.close()

    run(scenario)
