"""A webhook page's live delivery log (``/todos/webhooks/<slug>/events``) is a board stream:
the same caps, the same re-check of its viewer's right on every keep-alive (signed out,
deactivated, demoted, the webhook given to someone else), and the same behaviour with Redis
down (CONTRACT §12). Driven through the production routing, with Django's session cookie."""

import json

import pytest
from asgiref.sync import sync_to_async
from django.test import override_settings

from channels_push.bus import publish
from channels_push.board.tests.test_stream import WAIT_SECONDS, Stream, run
from channels_push.board.tests.test_board_stream_rights import (
    cookie_for, over_the_cap_the_oldest_closes, read_until_end,
    with_redis_down_it_opens_and_keeps_its_keep_alives)
from ingest import transitions as ingest_transitions
from ingest.models import Webhook
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)

KEEPALIVE_SECONDS = 0.2


@pytest.fixture
def alice(db):
    return UserFactory(username="alice")


@pytest.fixture
def webhook(alice):
    webhook, _ = ingest_transitions.create_webhook(slug="widgets", owner=alice, source="github",
                                                   secret="s3cret-s3cret-s3cret")
    return webhook


def page_stream(cookie, slug="widgets"):
    from switchboard.asgi import application

    return Stream(None, app=application, path=f"/todos/webhooks/{slug}/events",
                  headers=[(b"cookie", cookie)])


def announce(webhook, record_id=1):
    ingest_transitions.announce_record(webhook.pk, record_id, "accepted")


def test_the_page_stream_syncs_then_carries_the_webhooks_deliveries(client, alice, webhook):
    cookie = cookie_for(client, alice)

    async def scenario():
        stream = page_stream(cookie)
        start = await stream.open()
        assert start["status"] == 200
        assert dict(start["headers"])[b"content-type"].startswith(b"text/event-stream")
        await stream.next_event(kind="sync")
        await sync_to_async(announce)(webhook, 7)
        event = await stream.next_event(kind="delivery")
        assert json.loads(event["data"]) == {"id": "7", "outcome": "accepted"}
        await stream.close()
        assert await sync_to_async(publish.wait_for_sends)(WAIT_SECONDS)

    run(scenario)


def test_someone_elses_webhook_page_stream_is_refused(client, webhook):
    cookie = cookie_for(client, UserFactory(username="mallory"))

    async def scenario():
        stream = page_stream(cookie)
        assert (await stream.open())["status"] == 403

    run(scenario)


@override_settings(SWITCHBOARD_MAX_OPEN_STREAMS=2)
def test_a_viewers_page_streams_over_the_cap_close_their_oldest(client, alice, webhook):
    cookie = cookie_for(client, alice)
    over_the_cap_the_oldest_closes(lambda: [page_stream(cookie) for _ in range(3)])


@override_settings(SWITCHBOARD_MAX_OPEN_STREAMS=2)
def test_page_streams_and_board_streams_share_their_viewers_cap(client, alice, webhook):
    cookie = cookie_for(client, alice)
    over_the_cap_the_oldest_closes(lambda: [page_stream(cookie), Stream(alice), page_stream(cookie)])


@override_settings(SWITCHBOARD_STREAM_KEEPALIVE_SECONDS=KEEPALIVE_SECONDS)
@pytest.mark.parametrize("revocation", ["signed_out", "demoted", "given_away"])
def test_the_page_stream_ends_at_its_next_keep_alive_once_its_viewer_loses_the_right(
        client, alice, webhook, revocation):
    from django.contrib.sessions.models import Session

    boss = UserFactory(username="boss", is_superuser=True)
    viewer = boss if revocation == "demoted" else alice

    def revoke():
        if revocation == "signed_out":  # expired, or logged out without the signal
            Session.objects.all().delete()
        elif revocation == "demoted":  # a superuser watching a webhook that is not theirs
            type(boss).objects.filter(pk=boss.pk).update(is_superuser=False)
        else:
            Webhook.objects.filter(pk=webhook.pk).update(owner=UserFactory(username="carol"))

    cookie = cookie_for(client, viewer)

    async def scenario():
        stream = page_stream(cookie)
        assert (await stream.open())["status"] == 200
        await stream.next_event(kind="sync")
        await sync_to_async(revoke)()
        bodies = []
        ended = await read_until_end(stream, bodies=bodies)
        assert ended is not None, "the page stream outlived its viewer's right"

    run(scenario)


@override_settings(SWITCHBOARD_STREAM_KEEPALIVE_SECONDS=KEEPALIVE_SECONDS)
def test_with_redis_down_the_page_stream_opens_and_keeps_its_keep_alives(client, alice, webhook):
    cookie = cookie_for(client, alice)
    with_redis_down_it_opens_and_keeps_its_keep_alives(lambda: page_stream(cookie))


def test_the_hub_rechecks_page_and_board_streams_together(alice, webhook,
                                                          django_assert_num_queries):
    """One database hop per interval for every operator stream of the process: the viewers in
    one query (no Django session to read here), then one webhook lookup per page stream. A
    webhook given away ends its page streams and leaves the board's stream alone."""
    from channels_push.board import hub
    from channels_push.board import stream as board_stream
    from console import webhooks as ingest_views

    def opened(consumer):  # as __call__ leaves it once the stream is admitted
        consumer.scope = {"url_route": {"kwargs": {"slug": webhook.slug}}}
        consumer.session_key, consumer.check_session = None, False
        consumer.viewer = consumer.admit(alice)
        return consumer

    pages = [opened(board_stream.GroupStreamConsumer(ingest_views.delivery_stream_group))
             for _ in range(2)]
    board = opened(board_stream.BoardStreamConsumer())
    with django_assert_num_queries(1 + len(pages)):
        assert [viewer and viewer.user_id for viewer in hub.recheck_streams([*pages, board])] == [
            alice.pk] * 3
    Webhook.objects.filter(pk=webhook.pk).update(owner=UserFactory(username="carol"))
    assert [viewer and viewer.user_id for viewer in hub.recheck_streams([*pages, board])] == [
        None, None, alice.pk]
