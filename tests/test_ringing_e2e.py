"""Who is rung, seen by official SDK clients on a real daphne process (CONTRACT §7, §8; issue
13 items 10, 11, 13): a clock_in digest wakes one worker per waiting todo and counts what
claim_next would hand (unverified todos included, and said so); a todo whose lease lapsed
rings again."""

import asyncio
from contextlib import AsyncExitStack
from datetime import timedelta

import pytest
from django.utils import timezone

from channels_push.models import McpSession
from channels_push.tests.conftest import make_ready_todo, make_ready_todos_at_once
from endpoints import transitions as endpoint_transitions
from tests.factories import UserFactory
from tests.mcp_clients import ChannelListener, sdk_client
from tests.processes import DEADLINE_SECONDS, poll
from todos import sweeps as todo_sweeps

pytestmark = pytest.mark.django_db(transaction=True)


def vend(slug):
    return endpoint_transitions.vend_endpoint(slug=slug, owner=UserFactory(username=f"o-{slug}"))


def streams_open(endpoint, count):
    return McpSession.objects.filter(endpoint=endpoint, open_streams__gt=0).count() == count


async def connect(stack, url, endpoint, credential, listener):
    client = await stack.enter_async_context(sdk_client(url, endpoint.slug, credential,
                                                        listener=listener))
    await client.call_tool("list_todos", {"limit": 1})  # the SDK opens its GET stream
    return client


def test_clock_in_digest_wakes_one_worker_per_waiting_todo_and_counts_unverified(daphne_server):
    endpoint, credential = vend("pool-of-three")
    listeners = [ChannelListener() for _ in range(3)]

    async def scenario():
        async with AsyncExitStack() as stack:
            clients = [await connect(stack, daphne_server.url, endpoint, credential, listener)
                       for listener in listeners]
            assert await asyncio.to_thread(poll, lambda: streams_open(endpoint, 3))
            out = await clients[0].call_tool("clock_out", {})
            assert out.structured_content == {"presence": "out"}
            await asyncio.to_thread(make_ready_todo, endpoint, "inbox", "signed work")
            await asyncio.to_thread(make_ready_todo, endpoint, "inbox", "from anyone",
                                    trust="unverified")
            back = await clients[0].call_tool("clock_in", {})
            assert back.structured_content == {"presence": "in"}
            # Two todos wait: two of the three workers get the digest. Then one new todo rings
            # the pool's least recently rung session: the one the digest passed by.
            control = await asyncio.to_thread(make_ready_todo, endpoint, "inbox", "control")
            firsts = [await listener.next() for listener in listeners]
            drained = [await client.call_tool("claim_next", {}) for client in clients]
            return firsts, drained, control

    firsts, drained, control = asyncio.run(scenario())
    digests = [params for params in firsts if params.meta.get("kind") == "digest"]
    assert len(digests) == 2
    for digest in digests:
        assert digest.meta == {"kind": "digest", "pending": "2", "queues": "inbox",
                               "reason": "clock_in", "unverified": "1"}
        assert "1 unverified" in digest.content
    [doorbell] = [params for params in firsts if "todo_id" in params.meta]
    assert doorbell.meta["todo_id"] == str(control.pk)
    # What the digest counted is what claim_next hands out (the unverified one too).
    assert sorted(bool(r.structured_content.get("todo")) for r in drained) == [True, True, True]


def test_a_lapsed_lease_rings_the_sdk_client_again(daphne_server):
    endpoint, credential = vend("lapses")
    listener = ChannelListener()

    async def scenario():
        async with AsyncExitStack() as stack:
            client = await connect(stack, daphne_server.url, endpoint, credential, listener)
            assert await asyncio.to_thread(poll, lambda: streams_open(endpoint, 1))
            todo = await asyncio.to_thread(make_ready_todo, endpoint, "inbox", "flaky")
            assert (await listener.next()).meta["todo_id"] == str(todo.pk)
            claimed = await client.call_tool("claim", {"todo_id": str(todo.pk),
                                                       "lease_ttl_seconds": 1})
            assert not claimed.is_error
            moved = await asyncio.to_thread(todo_sweeps.expire_lapsed_leases,
                                            now=timezone.now() + timedelta(seconds=2))
            assert moved == 1
            again = await listener.next()
            reclaimed = await client.call_tool("claim", {"todo_id": again.meta["todo_id"]})
            return todo, again, reclaimed

    todo, again, reclaimed = asyncio.run(scenario())
    assert again.meta["todo_id"] == str(todo.pk)
    assert not reclaimed.is_error and reclaimed.structured_content["todo"]["attempts"] == 2


BURST = 40


def test_a_burst_of_hand_overs_rings_the_streaming_session_every_time(daphne_server):
    """One session streams, another of the same endpoint and scope is attached without a
    stream. Concurrent publishers must not skip the streaming session because another publisher
    holds its row for a moment: every doorbell of the burst is rung on the stream, none is
    handed to the streamless session (where it would be dropped)."""
    from channels_push.bus import publish
    from channels_push.sessions import transitions as session_transitions
    from tests.factories import credential_for

    endpoint, credential = vend("burst")
    listener = ChannelListener()
    streamless = session_transitions.open_session(
        endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25")

    def hand_over_burst():
        made = make_ready_todos_at_once(endpoint, BURST, trust="operator")
        assert publish.wait_for_sends(DEADLINE_SECONDS)
        return [todo.pk for todo in made]

    async def scenario():
        async with AsyncExitStack() as stack:
            await connect(stack, daphne_server.url, endpoint, credential, listener)
            assert await asyncio.to_thread(poll, lambda: streams_open(endpoint, 1))
            made = await asyncio.to_thread(hand_over_burst)
            heard = set()
            try:
                while len(heard & set(map(str, made))) < len(made):
                    heard.add((await listener.next(timeout=DEADLINE_SECONDS)).meta.get("todo_id"))
            except asyncio.TimeoutError:
                pass  # fewer than all: the assertion below says how many
            return made, heard

    made, heard = asyncio.run(scenario())
    rung = len(set(map(str, made)) & heard)
    assert rung == BURST, f"{rung} of {BURST} doorbells reached the stream"
    assert McpSession.objects.get(pk=streamless.pk).last_doorbell_at is None
