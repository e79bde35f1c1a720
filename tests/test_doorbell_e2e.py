"""Doorbells end to end (CONTRACT §7): a signed webhook POSTed to a real daphne process rings
the official SDK client attached to the endpoint, which claims the todo by ``meta.todo_id``;
across two web processes over Redis; and with Redis stopped and started again."""

import asyncio
import hashlib
import hmac
import json
import shutil
import socket
import subprocess
import time
import uuid

import httpx
import pytest

from channels_push.models import McpSession
from endpoints import transitions as endpoint_transitions
from ingest import transitions as ingest_transitions
from tests.factories import UserFactory
from tests.mcp_clients import ChannelListener, sdk_client
from tests.processes import DEADLINE_SECONDS, poll
from todos.models import Todo

pytestmark = pytest.mark.django_db(transaction=True)

SECRET = "e2e-webhook-secret-0123456789"
BODY_MARKER = "body-marker-never-logged"


def setup_route(slug):
    owner = UserFactory(username=f"owner-{slug}")
    endpoint, credential = endpoint_transitions.vend_endpoint(slug=slug, owner=owner)
    webhook, _ = ingest_transitions.create_webhook(slug=f"gh-{slug}", owner=owner, source="github",
                                                   secret=SECRET)
    ingest_transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="issues")
    return endpoint, credential, webhook


def deliver(base_url, webhook, number):
    body = json.dumps({"action": "opened", "issue": {"number": number, "title": "It broke",
                                                       "body": BODY_MARKER},
                       # A nonce: the same body under a new delivery id is a replay (§12).
                       "repository": {"full_name": "acme/app"}, "nonce": uuid.uuid4().hex}).encode()
    signature = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    answer = httpx.post(f"{base_url}/hooks/{webhook.slug}", content=body,
                        timeout=DEADLINE_SECONDS, headers={
        "Content-Type": "application/json", "X-Hub-Signature-256": f"sha256={signature}",
        "X-GitHub-Event": "issues", "X-GitHub-Delivery": str(uuid.uuid4())})
    assert answer.status_code == 202, answer.text
    return answer.json()["todos"][0]["id"]


def stream_open(endpoint):
    return McpSession.objects.filter(endpoint=endpoint, open_streams__gt=0).exists()


async def wait_stream(client, endpoint):
    await client.call_tool("list_todos", {"limit": 1})  # the SDK opens its GET stream
    assert await asyncio.to_thread(poll, lambda: stream_open(endpoint))


def test_signed_webhook_rings_the_sdk_client_which_claims_by_todo_id(daphne_server):
    endpoint, credential, webhook = setup_route("e2e-bell")
    listener = ChannelListener()

    async def scenario():
        async with sdk_client(daphne_server.url, endpoint.slug, credential,
                              listener=listener) as client:
            await wait_stream(client, endpoint)
            todo_id = await asyncio.to_thread(deliver, daphne_server.url, webhook, 12)
            doorbell = await listener.next()
            claimed = await client.call_tool("claim", {"todo_id": doorbell.meta["todo_id"]})
            again = await client.call_tool("claim", {"todo_id": doorbell.meta["todo_id"]})
            return todo_id, doorbell, claimed, again

    todo_id, doorbell, claimed, again = asyncio.run(scenario())
    assert doorbell.meta == {"todo_id": todo_id, "queue": "issues", "kind": "issues.opened",
                             "source": "github", "trust": "signed"}
    assert "acme/app#12" in doorbell.content and BODY_MARKER not in doorbell.content
    assert not claimed.is_error and claimed.structured_content["todo"]["id"] == todo_id
    assert again.is_error  # a duplicate doorbell cannot double-process
    log = daphne_server.log_text()
    assert credential not in log and SECRET not in log and BODY_MARKER not in log


def test_stream_on_one_process_rings_for_a_webhook_delivered_to_another(start_daphne):
    a, b = start_daphne(), start_daphne()
    endpoint, credential, webhook = setup_route("e2e-two")
    listener = ChannelListener()

    async def scenario():
        async with sdk_client(a.url, endpoint.slug, credential, listener=listener) as client:
            await wait_stream(client, endpoint)
            todo_id = await asyncio.to_thread(deliver, b.url, webhook, 7)
            doorbell = await listener.next()
            claimed = await client.call_tool("claim", {"todo_id": doorbell.meta["todo_id"]})
            return todo_id, doorbell, claimed

    todo_id, doorbell, claimed = asyncio.run(scenario())
    assert doorbell.meta["todo_id"] == todo_id
    assert not claimed.is_error


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class OwnRedis:
    """A redis-server of this test's own on a spare port: the one we stop and start (never
    the shared one)."""

    def __init__(self):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self):
        subprocess.run(["redis-server", "--port", str(self.port), "--save", "", "--appendonly",
                        "no", "--daemonize", "yes"], check=True, capture_output=True)
        assert poll(self.up)

    def up(self):
        return subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True,
                              text=True).stdout.strip() == "PONG"

    def stop(self):
        subprocess.run(["redis-cli", "-p", str(self.port), "shutdown", "nosave"],
                       capture_output=True)
        assert poll(lambda: not self.up())


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_redis_down_keeps_ingest_and_claims_working_and_pushes_resume(start_daphne):
    redis = OwnRedis()
    redis.start()
    try:
        server = start_daphne(REDIS_URL=redis.url)
        endpoint, credential, webhook = setup_route("e2e-redis")
        listener = ChannelListener()

        async def scenario():
            async with sdk_client(server.url, endpoint.slug, credential,
                                  listener=listener) as client:
                await wait_stream(client, endpoint)
                first = await asyncio.to_thread(deliver, server.url, webhook, 1)
                assert (await listener.next()).meta["todo_id"] == first

                await asyncio.to_thread(redis.stop)
                during = await asyncio.to_thread(deliver, server.url, webhook, 2)  # ingest works
                claimed = await client.call_tool("claim", {"todo_id": during})  # claims work
                assert not claimed.is_error, claimed
                def lines_of_during():
                    return [line for line in server.log_text().splitlines()
                            if f"todo_id={during}" in line and "doorbell" in line]

                # Lost with Redis: logged once, as dropped, never as rung.
                dropped = await asyncio.to_thread(poll, lambda: any(
                    "doorbell dropped: channel layer send failed" in line
                    for line in lines_of_during()))
                assert dropped, server.log_text()[-3000:]
                assert len(lines_of_during()) == 1, lines_of_during()
                assert listener.received.empty()

                await asyncio.to_thread(redis.start)
                # The layer reconnects on its own; the first deliveries after the restart may
                # race its re-subscription, so deliver until one rings (deadline-bounded).
                deadline = time.monotonic() + DEADLINE_SECONDS
                rung, number = None, 3
                while rung is None and time.monotonic() < deadline:
                    # Each its own issue: a second delivery on one would be a follow-up.
                    after = await asyncio.to_thread(deliver, server.url, webhook, number)
                    number += 1
                    try:
                        doorbell = await listener.next(timeout=2)
                    except asyncio.TimeoutError:
                        continue
                    rung = (after, doorbell.meta["todo_id"])
                return during, rung

        during, rung = asyncio.run(scenario())
        assert rung is not None, "pushes did not resume after Redis came back"
        assert Todo.objects.get(pk=during).state == "claimed"
        log = server.log_text()
        assert credential not in log and SECRET not in log
    finally:
        redis.stop()


def test_logs_of_a_whole_flow_carry_no_bearer_secret_or_body(start_daphne):
    """Every log line of the service during ingest, hand-over with secrets, doorbells, claims
    and a failing signature, at DEBUG: no bearer, webhook secret, operator token, secret value
    or body text."""
    server = start_daphne(LOG_LEVEL="DEBUG")
    endpoint, credential, webhook = setup_route("e2e-logs")
    token = ingest_transitions.mint_operator_token(user=endpoint.owner, name="cli")[1]
    listener = ChannelListener()

    async def scenario():
        async with sdk_client(server.url, endpoint.slug, credential, listener=listener) as client:
            await wait_stream(client, endpoint)
            await asyncio.to_thread(deliver, server.url, webhook, 5)
            await listener.next()
            handed = await asyncio.to_thread(httpx.post, f"{server.url}/api/v1/endpoints/{endpoint.slug}/todos",
                                             json={"queue": "ops", "title": "rotate keys",
                                                   "secrets": {"api": "sk-live-supersecret"}},
                                             headers={"Authorization": f"Bearer {token}"},
                                             timeout=DEADLINE_SECONDS)
            assert handed.status_code == 201, handed.text
            doorbell = await listener.next()
            claimed = await client.call_tool("claim", {"todo_id": doorbell.meta["todo_id"]})
            ref = claimed.structured_content["todo"]["payload"]["secrets"]["api"]["$secret"]
            read = await client.call_tool("read_secret", {"ref": ref})
            assert read.structured_content["value"] == "sk-live-supersecret"
            bad = await asyncio.to_thread(httpx.post, f"{server.url}/hooks/{webhook.slug}",
                                          content=b'{"body": "' + BODY_MARKER.encode() + b'"}',
                                          headers={"X-Hub-Signature-256": "sha256=00",
                                                   "X-GitHub-Event": "issues"},
                                          timeout=DEADLINE_SECONDS)
            assert bad.status_code == 401

    asyncio.run(scenario())
    log = server.log_text()
    assert "doorbell" in log or "webhook delivery accepted" in log  # the flow did log
    for secret in (credential, SECRET, token, "sk-live-supersecret", BODY_MARKER):
        assert secret not in log


def test_clocked_out_agent_gets_no_doorbell_then_one_digest_on_clock_in(daphne_server):
    """Presence end to end (§8): the SDK client clocks out, a signed webhook rings nothing,
    clock_in brings one digest, and draining it with claim_next finds the todo."""
    endpoint, credential, webhook = setup_route("e2e-presence")
    listener = ChannelListener()

    async def scenario():
        async with sdk_client(daphne_server.url, endpoint.slug, credential,
                              listener=listener) as client:
            await wait_stream(client, endpoint)
            out = await client.call_tool("clock_out", {})
            held = await asyncio.to_thread(deliver, daphne_server.url, webhook, 21)
            back = await client.call_tool("clock_in", {})
            digest = await listener.next()  # the first notification after the webhook
            drained = await client.call_tool("claim_next", {})
            return out, held, back, digest, drained

    out, held, back, digest, drained = asyncio.run(scenario())
    assert out.structured_content == {"presence": "out"}
    assert back.structured_content == {"presence": "in"}
    assert digest.meta == {"kind": "digest", "pending": "1", "queues": "issues", "reason": "clock_in",
                           "unverified": "0"}
    assert "todo_id" not in digest.meta and "It broke" not in digest.content
    assert drained.structured_content["todo"]["id"] == held
    assert Todo.objects.get(pk=held).ring_attempts == 0
