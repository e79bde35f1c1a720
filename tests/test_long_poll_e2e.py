"""Long-poll claim_next (CONTRACT §6) against real daphne processes on PostgreSQL + Redis (and
the embedded default): a waiter on one web process gets the todo a signed webhook created on
another, quickly; concurrent waiters never share a todo; a client that leaves claims nothing;
keep-alives carry a wait through a proxy that cuts idle connections; waiting holds no database
connection."""

import asyncio
import hashlib
import hmac
import json
import statistics
import subprocess
import threading
import time
import uuid

import httpx
import pytest
from django.db import connection

from endpoints import transitions as endpoint_transitions
from ingest import transitions as ingest_transitions
from tests.factories import UserFactory
from tests.long_poll_client import long_poll, open_session
from tests.mcp_clients import sdk_client
from tests.processes import DEADLINE_SECONDS, PYTHON, ROOT, poll
from tests.servers import DaphneServer, free_port
from tests.test_embedded import embedded_env
from todos.models import State, Todo, TodoEvent

pytestmark = pytest.mark.django_db(transaction=True)

SECRET = "long-poll-webhook-secret-0123456789"
# The bar: the claim answered within 250 ms of the webhook's 202, median over 50.
LATENCY_ROUNDS = 50
LATENCY_MEDIAN_SECONDS = 0.25
# A shared 2-core machine can stall a whole run; the median is measured again (never relaxed)
# at most this many times before the test fails.
LATENCY_RUNS = 3


def setup_route(slug):
    owner = UserFactory(username=f"owner-{slug}")
    endpoint, credential = endpoint_transitions.vend_endpoint(slug=slug, owner=owner)
    webhook, _ = ingest_transitions.create_webhook(slug=f"gh-{slug}", owner=owner,
                                                   source="github", secret=SECRET)
    ingest_transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="issues")
    return endpoint, credential, webhook.slug


def signed(number: int, secret: str = SECRET) -> tuple[bytes, dict]:
    # A nonce: the same body under a new delivery id is a refused replay (§12).
    body = json.dumps({"action": "opened", "issue": {"number": number, "title": f"n{number}"},
                       "repository": {"full_name": "acme/app"}, "nonce": uuid.uuid4().hex}).encode()
    signature = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return body, {"Content-Type": "application/json", "X-Hub-Signature-256": f"sha256={signature}",
                  "X-GitHub-Event": "issues", "X-GitHub-Delivery": str(uuid.uuid4())}


async def deliver(http, base_url, hook_slug, number, secret=SECRET) -> tuple[str, float]:
    """POST a signed webhook; (todo id, perf_counter when the 202 arrived)."""
    body, headers = signed(number, secret)
    answer = await http.post(f"{base_url}/hooks/{hook_slug}", content=body, headers=headers)
    accepted_at = time.perf_counter()
    assert answer.status_code == 202, answer.text
    return answer.json()["todos"][0]["id"], accepted_at


def mcp_url(server_url, endpoint_slug):
    return f"{server_url}/mcp/{endpoint_slug}"


# A latency bar: measured with nothing else of the suite beside it (scripts/test's serial pass).
@pytest.mark.serial
def test_a_waiter_on_web_a_gets_the_todo_a_webhook_created_on_web_b_quickly(start_daphne):
    a, b = start_daphne(), start_daphne()
    endpoint, credential, hook = setup_route("lp-latency")
    url = mcp_url(a.url, endpoint.slug)

    async def measure_once(http, headers, first_number):
        latencies = []
        for number in range(first_number, first_number + LATENCY_ROUNDS):
            opened = asyncio.Event()
            waiter = asyncio.ensure_future(long_poll(http, url, headers, 20, opened=opened))
            await asyncio.wait_for(opened.wait(), DEADLINE_SECONDS)  # web A is waiting
            todo_id, accepted_at = await deliver(http, b.url, hook, number)
            result, answered_at = await waiter
            assert result["todo"]["id"] == todo_id
            latencies.append(answered_at - accepted_at)
        return statistics.median(latencies)

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as http:
            headers = await open_session(http, url, credential)
            medians = []
            for run in range(LATENCY_RUNS):
                medians.append(await measure_once(http, headers, 1 + run * LATENCY_ROUNDS))
                if medians[-1] <= LATENCY_MEDIAN_SECONDS:
                    break
            return medians

    medians = asyncio.run(scenario())
    assert medians[-1] <= LATENCY_MEDIAN_SECONDS, f"medians of each run: {medians}"
    # Every round's todo was claimed by the waiter, exactly once.
    claims = TodoEvent.objects.filter(todo__endpoint=endpoint, action="claim")
    assert claims.count() == Todo.objects.filter(endpoint=endpoint).count() == \
        LATENCY_ROUNDS * len(medians)


def test_twenty_waiters_and_ten_todos_make_ten_claims_and_ten_empties(start_daphne):
    a, b = start_daphne(), start_daphne()
    endpoint, credential, hook = setup_route("lp-twenty")
    # The ten deliveries must all land within the wait, which the ten empty waiters spend in
    # full: long enough for a loaded machine.
    wait_seconds = 20

    async def scenario():
        limits = httpx.Limits(max_connections=50, max_keepalive_connections=50)
        async with httpx.AsyncClient(timeout=30, limits=limits) as http:
            # Ten waiters on each web process, each in its own MCP session.
            urls = [mcp_url(server.url, endpoint.slug) for server in (a, b)]
            sessions = [(url, await open_session(http, url, credential))
                        for url in urls for _ in range(10)]
            opened = [asyncio.Event() for _ in sessions]
            waiters = [asyncio.ensure_future(long_poll(http, url, headers, wait_seconds,
                                                       opened=event))
                       for (url, headers), event in zip(sessions, opened)]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in opened)),
                                   DEADLINE_SECONDS)
            created = await asyncio.gather(*(deliver(http, b.url, hook, n) for n in range(10)))
            results = await asyncio.gather(*waiters)
            return [todo_id for todo_id, _ in created], [result for result, _ in results]

    created, results = asyncio.run(scenario())
    claimed = [result["todo"]["id"] for result in results if "todo" in result]
    assert sorted(claimed) == sorted(created)  # exactly ten claims, none twice
    assert [result for result in results if "todo" not in result] == [{"empty": True}] * 10
    assert TodoEvent.objects.filter(todo__endpoint=endpoint, action="claim").count() == 10
    assert set(Todo.objects.filter(endpoint=endpoint).values_list("state", flat=True)) == {
        State.CLAIMED}


def test_a_client_that_disconnects_mid_wait_claims_nothing(daphne_server):
    endpoint, credential, hook = setup_route("lp-gone")
    url = mcp_url(daphne_server.url, endpoint.slug)

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as http:
            headers = await open_session(http, url, credential)
            opened = asyncio.Event()
            waiter = asyncio.ensure_future(long_poll(http, url, headers, 30, opened=opened))
            await asyncio.wait_for(opened.wait(), DEADLINE_SECONDS)
            waiter.cancel()  # the client goes away: its connection closes
            with pytest.raises(asyncio.CancelledError):
                await waiter
        async with httpx.AsyncClient(timeout=30) as http:
            todo_id, _ = await deliver(http, daphne_server.url, hook, 1)
            # Had the departed waiter claimed it, that would take a few milliseconds.
            taken = await asyncio.to_thread(
                poll, lambda: Todo.objects.get(pk=todo_id).state != State.PENDING, 2.0)
            # The todo is still there for a client that does wait.
            headers = await open_session(http, url, credential)
            result, _ = await long_poll(http, url, headers, 5)
            return todo_id, taken, result

    todo_id, taken, result = asyncio.run(scenario())
    assert not taken, "a client that disconnected was handed the todo"
    assert result["todo"]["id"] == todo_id
    assert TodoEvent.objects.filter(todo_id=todo_id, action="claim").count() == 1


class IdleCuttingProxy:
    """A TCP proxy that closes both sides of a connection after ``idle_seconds`` without a
    byte in either direction: what a load balancer's idle timeout does to a silent answer."""

    def __init__(self, target_port: int, idle_seconds: float):
        self.target_port, self.idle_seconds = target_port, idle_seconds
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        assert self._ready.wait(10)

    def _run(self):
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()

    async def _serve(self, client_reader, client_writer):
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1",
                                                                         self.target_port)
        last_byte = [self._loop.time()]

        async def pipe(reader, writer):
            while data := await reader.read(65536):
                last_byte[0] = self._loop.time()
                writer.write(data)
                await writer.drain()

        pipes = [asyncio.ensure_future(pipe(client_reader, upstream_writer)),
                 asyncio.ensure_future(pipe(upstream_reader, client_writer))]
        try:
            while not all(p.done() for p in pipes):
                await asyncio.sleep(0.05)  # the idle clock's resolution
                if self._loop.time() - last_byte[0] > self.idle_seconds:
                    break
        finally:
            for p in pipes:
                p.cancel()
            for writer in (client_writer, upstream_writer):
                writer.close()

    def stop(self):
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _shutdown(self):
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def test_keep_alives_carry_a_long_wait_through_a_proxy_that_cuts_idle_connections(start_daphne):
    # Scaled down from "a 60 s wait behind a 30 s idle cut with 15 s keep-alives" to keep the
    # suite fast: keep-alive 1 s, proxy idle cut 8 s, wait 16 s. The cut is eight keep-alives
    # long, so a loaded machine that delays a few of them does not look like a silent answer.
    server = start_daphne(SWITCHBOARD_LONG_POLL_KEEPALIVE_SECONDS="1")
    proxy = IdleCuttingProxy(server.port, idle_seconds=8)
    endpoint, credential, _ = setup_route("lp-proxy")
    url = mcp_url(f"http://127.0.0.1:{proxy.port}", endpoint.slug)

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as http:
            headers = await open_session(http, url, credential)
            started = time.monotonic()
            through_sse, _ = await long_poll(http, url, headers, 16)
            sse_took = time.monotonic() - started
            # The control: the same wait answered as JSON has nothing to say for 16 s, and the
            # proxy cuts it — which is what the keep-alives above prevented.
            with pytest.raises(httpx.HTTPError):
                await long_poll(http, url, headers, 16, accept="application/json")
            return through_sse, sse_took

    try:
        through_sse, sse_took = asyncio.run(scenario())
    finally:
        proxy.stop()
    assert through_sse == {"empty": True} and sse_took >= 16


def test_waiting_holds_no_database_connection(start_daphne):
    # A pool of two connections: were a waiter to hold one (or a thread that holds one), the
    # third waiter could not even start, and nothing else could run.
    app_name = f"sb-lp-{uuid.uuid4().hex[:8]}"
    # Fifty-one sessions and fifty waiting claims on one credential: above the default caps
    # of 32 (CONTRACT §12).
    server = start_daphne(PGAPPNAME=app_name, DATABASE_POOL_MAX_SIZE="2",
                          SWITCHBOARD_MAX_SESSIONS_PER_CREDENTIAL="100",
                          SWITCHBOARD_MAX_LONG_POLLS_PER_CREDENTIAL="100")
    endpoint, credential, hook = setup_route("lp-conns")
    url = mcp_url(server.url, endpoint.slug)
    waiters_count = 50

    def connections() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND "
                           "application_name = %s", [connection.settings_dict["NAME"], app_name])
            return cursor.fetchone()[0]

    async def scenario():
        limits = httpx.Limits(max_connections=waiters_count + 10)
        async with httpx.AsyncClient(timeout=30, limits=limits) as http:
            sessions = [await open_session(http, url, credential) for _ in range(waiters_count)]
            idle, _ = await long_poll(http, url, sessions[0], 0.1)
            assert idle == {"empty": True}
            without_waiters = await asyncio.to_thread(connections)
            opened = [asyncio.Event() for _ in sessions]
            # The longest wait there is: the first waiters still wait when the delivery comes,
            # however long a loaded machine takes to open all fifty.
            waiters = [asyncio.ensure_future(long_poll(http, url, headers, 60, opened=event))
                       for headers, event in zip(sessions, opened)]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in opened)),
                                   DEADLINE_SECONDS)
            with_waiters = await asyncio.to_thread(connections)
            # The process still does database work for others while fifty wait.
            other = await open_session(http, url, credential)
            listed = await http.post(url, headers=other, json={
                "jsonrpc": "2.0", "id": 9, "method": "tools/call",
                "params": {"name": "list_todos", "arguments": {}}}, timeout=DEADLINE_SECONDS)
            todo_id, _ = await deliver(http, server.url, hook, 1)
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            first = next(iter(done)).result()[0]
            for waiter in waiters:
                waiter.cancel()
            return without_waiters, with_waiters, listed, todo_id, first

    without_waiters, with_waiters, listed, todo_id, first = asyncio.run(scenario())
    assert 0 < with_waiters <= without_waiters <= 2, (without_waiters, with_waiters)
    assert listed.status_code == 200 and listed.json()["result"]["isError"] is False
    assert first["todo"]["id"] == todo_id


def test_embedded_default_long_polls_the_same_way(tmp_path):
    env = embedded_env(tmp_path / "var")
    subprocess.run([PYTHON, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True,
                   timeout=120)
    seeded = subprocess.run([PYTHON, "manage.py", "seed_demo", "--json", "--password", "pw-x"],
                            cwd=ROOT, env=env, check=True, timeout=120, capture_output=True,
                            text=True)
    demo = json.loads(seeded.stdout.strip().splitlines()[-1])
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "wb")
    server = subprocess.Popen([PYTHON, "manage.py", "serve", "--port", str(port)], cwd=ROOT,
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    url = mcp_url(base, demo["endpoint"])
    hook = demo["hook_url"].rsplit("/", 1)[1]

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as http:
            headers = await open_session(http, url, demo["credential"])
            sessions = [headers] + [await open_session(http, url, demo["credential"])
                                    for _ in range(2)]
            opened = [asyncio.Event() for _ in sessions]
            waiters = [asyncio.ensure_future(long_poll(http, url, h, 6, opened=event))
                       for h, event in zip(sessions, opened)]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in opened)),
                                   DEADLINE_SECONDS)
            created = [await deliver(http, base, hook, n, demo["secret"]) for n in range(2)]
            results = await asyncio.gather(*waiters)
            return created, results

    try:
        DaphneServer.wait_ready_at(base, server)
        created, results = asyncio.run(scenario())
    finally:
        server.terminate()
        server.wait(15)
    claimed = {r["todo"]["id"]: answered_at for r, answered_at in results if "todo" in r}
    assert sorted(claimed) == sorted(todo_id for todo_id, _ in created)
    assert [r for r, _ in results if "todo" not in r] == [{"empty": True}]
    # Woken by the in-memory layer, not found by the deadline (6 s) or the re-check (5 s).
    last_accepted = created[-1][1]
    assert all(answered_at - last_accepted < 3 for answered_at in claimed.values())


def test_the_official_sdk_client_long_polls_with_progress(start_daphne):
    server = start_daphne(SWITCHBOARD_LONG_POLL_KEEPALIVE_SECONDS="0.5")
    endpoint, credential, hook = setup_route("lp-sdk")
    progress = []

    async def on_progress(done, total, message):
        progress.append((done, total))

    async def scenario():
        async with sdk_client(server.url, endpoint.slug, credential) as client, \
                httpx.AsyncClient(timeout=30) as http:
            empty = await client.call_tool("claim_next", {"wait_seconds": 1.6},
                                           progress_callback=on_progress)
            started_waiting = asyncio.Event()

            async def on_waiting_progress(done, total, message):
                started_waiting.set()

            waiting = asyncio.ensure_future(client.call_tool(
                "claim_next", {"wait_seconds": 20}, progress_callback=on_waiting_progress))
            # Delivered once the call waits (its first progress says so): the wake-up, not the
            # first look, must find the todo.
            await asyncio.wait_for(started_waiting.wait(), DEADLINE_SECONDS)
            todo_id, _ = await deliver(http, server.url, hook, 1)
            return empty, await asyncio.wait_for(waiting, DEADLINE_SECONDS), todo_id

    empty, claimed, todo_id = asyncio.run(scenario())
    assert empty.structured_content == {"empty": True} and not empty.is_error
    assert len(progress) >= 2 and all(total == 1.6 for _, total in progress)
    assert claimed.structured_content["todo"]["id"] == todo_id
