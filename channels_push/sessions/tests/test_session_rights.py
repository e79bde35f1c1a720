"""Sessions and streams are bound to the rights behind them (CONTRACT §12; issue 12 items 1
and 3, issue 15 items 3 and 5): through the real ASGI application, in-process."""

import asyncio
import json
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from django.db import connection
from django.test.utils import override_settings
from django.utils import timezone

from channels_push.sessions import sweeps
from channels_push.sessions import queries
from channels_push.sessions import transitions as session_transitions
from channels_push.doorbells import rings
from channels_push.models import McpSession
from channels_push.tests.conftest import McpDriver
from channels_push.mcp.tests.test_stream import KEEPALIVE_SECONDS, next_body, open_stream
from endpoints import transitions as endpoint_transitions
from endpoints.models import Credential
from tests.processes import DEADLINE_SECONDS

# The stream tests commit (see channels_push/mcp/tests/test_stream.py); so do these, for one fixture setup.
pytestmark = pytest.mark.django_db(transaction=True)

def test_a_session_answers_only_to_the_credential_that_opened_it(mcp):
    mcp.initialize()
    first = mcp.credential
    # Rotation with grace: both credentials work, but each only with its own sessions.
    second = endpoint_transitions.rotate_credential(mcp.endpoint, grace=timedelta(hours=1))
    mcp.credential = second
    assert mcp.rpc("ping").status == 404
    assert mcp.request("GET", accept="text/event-stream").status == 404
    assert mcp.request("DELETE").status == 404
    assert McpSession.objects.get(pk=mcp.session_id).terminated_at is None
    mcp.credential = first
    assert mcp.rpc("ping").status == 200
    assert McpSession.objects.get(pk=mcp.session_id).credential.digest == \
        Credential.objects.filter(endpoint=mcp.endpoint).order_by("created_at").first().digest


def test_an_inactive_owners_endpoint_answers_401_until_reactivated(mcp):
    mcp.initialize()
    owner = mcp.endpoint.owner
    owner.is_active = False
    owner.save()
    reply = mcp.rpc("ping")
    assert reply.status == 401 and "www-authenticate" in reply.headers
    assert McpDriver(mcp.slug, mcp.credential).rpc("initialize", {
        "protocolVersion": "2025-11-25", "capabilities": {}}).status == 401
    owner.is_active = True
    owner.save()
    assert mcp.rpc("ping").status == 200


def _run_stream_until_closed(mcp, revoke):
    """Open a stream, let one keep-alive pass, ``revoke()``, and return the bodies that arrived
    until the stream ended (None when it did not end within 20 keep-alives)."""
    async def scenario():
        communicator, start, _ = await open_stream(mcp)
        assert start["status"] == 200
        assert (await next_body(communicator))["body"] == b": keep-alive\n\n"
        await database_sync_to_async(revoke)()
        bodies = []
        loop = asyncio.get_running_loop()
        end = loop.time() + KEEPALIVE_SECONDS * 20
        while loop.time() < end:
            message = await next_body(communicator)
            bodies.append(message["body"])
            if not message.get("more_body"):
                await communicator.wait(timeout=DEADLINE_SECONDS)
                return bodies
        await communicator.send_input({"type": "http.disconnect"})
        await communicator.wait(timeout=DEADLINE_SECONDS)
        return None

    return async_to_sync(scenario)()


@pytest.mark.parametrize("revocation", ["expired", "deleted", "endpoint_inactive",
                                        "owner_inactive"])
def test_a_stream_closes_at_its_next_keep_alive_once_its_credential_loses_its_rights(
        mcp, revocation):
    mcp.initialize()
    credential = McpSession.objects.get(pk=mcp.session_id).credential

    def revoke():
        if revocation == "expired":
            Credential.objects.filter(pk=credential.pk).update(expires_at=timezone.now())
        elif revocation == "deleted":
            Credential.objects.filter(pk=credential.pk).delete()
        elif revocation == "endpoint_inactive":
            type(mcp.endpoint).objects.filter(pk=mcp.endpoint.pk).update(active=False)
        else:
            type(mcp.endpoint.owner).objects.filter(pk=mcp.endpoint.owner_id).update(
                is_active=False)

    bodies = _run_stream_until_closed(mcp, revoke)
    assert bodies is not None, "the stream outlived its credential"
    assert len(bodies) <= 2  # at most a keep-alive already on its way, then the end
    session = McpSession.objects.filter(pk=mcp.session_id).first()
    assert session is None or session.terminated_at is not None


def test_a_revoked_session_is_never_chosen_for_a_doorbell(mcp):
    from channels_push.tests.conftest import make_ready_todo

    mcp.initialize()
    todo = make_ready_todo(mcp.endpoint)
    # Attached by every measure: a stream open under a live lease, and a request just now.
    McpSession.objects.filter(pk=mcp.session_id).update(
        open_streams=1, stream_lease_until=timezone.now() + timedelta(minutes=5))
    assert queries.has_attached_session(mcp.endpoint.pk, timezone.now())
    Credential.objects.filter(endpoint=mcp.endpoint).update(expires_at=timezone.now())
    assert rings.choose_doorbell_session(endpoint_id=mcp.endpoint.pk, todo_id=todo.pk) is None
    assert not queries.has_attached_session(mcp.endpoint.pk, timezone.now())


def _row_version(session_id):
    # PostgreSQL gives every UPDATE of a row a new tuple (new xmin and ctid), so an unchanged
    # pair proves nothing wrote the row, whichever connection or thread ran the stream.
    with connection.cursor() as cursor:
        cursor.execute("SELECT xmin::text, ctid::text FROM channels_push_mcpsession WHERE id = %s",
                       [session_id])
        return cursor.fetchone()


@pytest.mark.skipif("connection.vendor != 'postgresql'")
def test_idle_stream_keep_alives_write_nothing_to_the_database(mcp):
    mcp.initialize()

    async def scenario():
        communicator, _, _ = await open_stream(mcp)
        before = await database_sync_to_async(_row_version)(mcp.session_id)
        for _ in range(5):
            assert (await next_body(communicator))["body"] == b": keep-alive\n\n"
        after = await database_sync_to_async(_row_version)(mcp.session_id)
        await communicator.send_input({"type": "http.disconnect"})
        await communicator.wait(timeout=DEADLINE_SECONDS)
        return before, after

    before, after = async_to_sync(scenario)()
    assert before == after


def test_a_keep_alive_re_check_writes_only_when_it_ends_the_session(mcp):
    mcp.initialize()
    before = _row_version(mcp.session_id) if connection.vendor == "postgresql" else None
    assert mcp.session_id in session_transitions.check_stream_sessions(
        session_ids=[mcp.session_id])
    if before is not None:
        assert _row_version(mcp.session_id) == before
    Credential.objects.filter(endpoint=mcp.endpoint).update(expires_at=timezone.now())
    assert not session_transitions.check_stream_sessions(session_ids=[mcp.session_id])
    assert McpSession.objects.get(pk=mcp.session_id).terminated_at is not None


def test_300_initializes_on_one_credential_leave_at_most_32_live_sessions(mcp):
    for _ in range(300):
        mcp.initialize()
    live = McpSession.objects.filter(endpoint=mcp.endpoint, terminated_at__isnull=True)
    assert live.count() == 32
    assert live.filter(pk=mcp.session_id).exists()  # the newest is kept
    assert mcp.rpc("ping").status == 200


def test_eviction_spares_sessions_with_an_open_stream(mcp):
    mcp.initialize()
    streaming = mcp.session_id
    McpSession.objects.filter(pk=streaming).update(
        open_streams=1, last_seen_at=timezone.now() - timedelta(minutes=30))
    with override_settings(SWITCHBOARD_MAX_SESSIONS_PER_CREDENTIAL=3):
        for _ in range(5):
            mcp.initialize()
    live = set(McpSession.objects.filter(terminated_at__isnull=True).values_list("pk", flat=True))
    assert len(live) == 3 and streaming in live and mcp.session_id in live


@override_settings(SWITCHBOARD_MAX_OPEN_STREAMS=2)
def test_the_stream_over_the_per_session_cap_is_refused_with_409(mcp):
    mcp.initialize()

    async def scenario():
        first, start1, _ = await open_stream(mcp)
        second, start2, _ = await open_stream(mcp)
        third, start3, body3 = await open_stream(mcp)
        await third.wait(timeout=DEADLINE_SECONDS)
        for communicator in (first, second):
            await communicator.send_input({"type": "http.disconnect"})
            await communicator.wait(timeout=DEADLINE_SECONDS)
        return start1["status"], start2["status"], start3["status"], body3["body"]

    first, second, third, body = async_to_sync(scenario)()
    assert (first, second) == (200, 200)
    assert third == 409
    assert "maximum of 2 open streams" in json.loads(body)["error"]["message"]
    assert McpSession.objects.get(pk=mcp.session_id).open_streams == 0


def test_the_session_sweep_ends_sessions_whose_credential_lost_its_rights(mcp):
    mcp.initialize()
    revoked = mcp.session_id
    other = endpoint_transitions.rotate_credential(mcp.endpoint, grace=timedelta(0))
    kept = McpDriver(mcp.slug, other)
    kept.initialize()
    sweeps.expire_idle_sessions(now=timezone.now() + timedelta(seconds=1))
    assert McpSession.objects.get(pk=revoked).terminated_at is not None
    assert McpSession.objects.get(pk=kept.session_id).terminated_at is None
