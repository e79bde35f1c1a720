"""Pausing work end to end (CONTRACT §14, issue 16 §3) on PostgreSQL with the official SDK
client attached to a real daphne process: claim_next, claim, doorbells and sweeps for a queue
pause and an endpoint pause; held leases keep working; resume sends one digest."""

import asyncio
import io
import json
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.utils import timezone

from channels_push.doorbells import sweeps
from channels_push.tests.conftest import make_ready_todo
from endpoints.models import Endpoint
from endpoints import transitions as endpoint_transitions
from tests.factories import UserFactory
from tests.mcp_clients import ChannelListener, sdk_client
from tests.test_doorbell_e2e import wait_stream
from todos.models import Todo

pytestmark = pytest.mark.django_db(transaction=True)


def command(*args) -> dict:
    out = io.StringIO()
    call_command(*args, "--json", stdout=out)
    return json.loads(out.getvalue())


def test_queue_and_endpoint_pause_with_a_running_sdk_client(daphne_server):
    owner = UserFactory(username="pause-owner")
    endpoint, credential = endpoint_transitions.vend_endpoint(slug="pausable", owner=owner)
    listener = ChannelListener()

    async def call(client, tool, arguments=None):
        result = await client.call_tool(tool, arguments or {})
        return result.is_error, result.structured_content

    async def scenario():
        async with sdk_client(daphne_server.url, endpoint.slug, credential,
                              listener=listener) as client:
            await wait_stream(client, endpoint)
            # -- one queue paused -------------------------------------------------------------
            assert await asyncio.to_thread(command, "pause", endpoint.slug, "--queue",
                                           "reviews") == {"endpoint": "pausable",
                                                          "paused": ["reviews"]}
            held = await asyncio.to_thread(make_ready_todo, endpoint, "reviews", "held back",
                                           now=timezone.now() - timedelta(minutes=10))
            control = await asyncio.to_thread(make_ready_todo, endpoint, "inbox", "control")
            # The paused queue's todo rang nobody: the first doorbell is the control's.
            assert (await listener.next()).meta["todo_id"] == str(control.pk)
            assert await call(client, "claim_next", {"queues": ["reviews"]}) == (
                False, {"empty": True, "paused": ["reviews"]})
            refused, answer = await call(client, "claim", {"todo_id": str(held.pk)})
            assert refused and answer["error"]["code"] == "paused"
            # claim_next skips the paused queue and hands out the rest.
            error, answer = await call(client, "claim_next")
            assert not error and answer["todo"]["id"] == str(control.pk)
            assert await call(client, "claim_next") == (False, {"empty": True})
            # The heartbeat sweep holds too: the stream is attached, the todo overdue.
            rung = await asyncio.to_thread(sweeps.ring_due_todos)
            assert rung == 0
            assert (await asyncio.to_thread(Todo.objects.get, pk=held.pk)).ring_attempts == 0
            # -- the whole endpoint paused, with a lease held -----------------------------------
            working = await asyncio.to_thread(make_ready_todo, endpoint, "inbox", "in flight")
            assert (await listener.next()).meta["todo_id"] == str(working.pk)
            error, answer = await call(client, "claim", {"todo_id": str(working.pk)})
            assert not error
            assert await asyncio.to_thread(command, "pause", endpoint.slug) == {
                "endpoint": "pausable", "paused": ["*"]}
            waiting = await asyncio.to_thread(make_ready_todo, endpoint, "inbox", "waits",
                                              now=timezone.now() - timedelta(minutes=10))
            assert await asyncio.to_thread(sweeps.ring_due_todos) == 0  # overdue, but held
            assert await call(client, "claim_next") == (False, {"empty": True, "paused": ["*"]})
            refused, answer = await call(client, "claim", {"todo_id": str(waiting.pk)})
            assert refused and answer["error"]["code"] == "paused"
            # Held leases keep working: the agent can finish what it holds.
            assert not (await call(client, "heartbeat", {"todo_id": str(working.pk)}))[0]
            assert not (await call(client, "complete", {"todo_id": str(working.pk)}))[0]
            assert listener.received.empty()  # nothing rang while paused
            # -- resume: one digest of what waited ----------------------------------------------
            assert await asyncio.to_thread(command, "resume", endpoint.slug) == {
                "endpoint": "pausable", "paused": []}
            digest = await listener.next()
            error, answer = await call(client, "claim_next")
            return digest, answer, held, waiting

    digest, answer, held, waiting = asyncio.run(scenario())
    assert digest.meta == {"kind": "digest", "pending": "2", "queues": "inbox,reviews",
                           "reason": "resumed", "unverified": "0"}
    assert answer["todo"]["id"] == str(held.pk)  # the oldest waiting one
    events = list(Endpoint.objects.get(pk=endpoint.pk).events.order_by("at", "id")
                  .values_list("action", "queue", "actor"))
    assert events == [("pause", "reviews", "manage.py"), ("pause", "*", "manage.py"),
                      ("resume", "*", "manage.py")]
    assert Todo.objects.get(pk=waiting.pk).ring_attempts == 0
