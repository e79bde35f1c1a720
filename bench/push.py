"""Benchmark: webhook POST → the agent hears of the todo, by doorbell and by long poll
(docs/reference.md#doorbells, docs/reference.md#long-poll).

    DATABASE_URL=postgres://… REDIS_URL=redis://… python bench/push.py [--deliveries 500] \
        [--waiters 500]

One run, two modes side by side, each against a real server process:

* embedded — ``manage.py serve`` with no DATABASE_URL and no REDIS_URL: SQLite (WAL) in a
  fresh temporary directory and the in-memory channel layer, sweeps in the process;
* postgres+redis — ``daphne switchboard.asgi:application`` on DATABASE_URL (PostgreSQL, migrated
  first) with the Redis channel layer at REDIS_URL.

In each, one official ``mcp`` SDK client is attached to the endpoint with its notification
stream open, and ``--deliveries`` signed GitHub webhooks are POSTed one after another to
``/hooks/<slug>``. For each, the clock runs from just before the POST to the moment the client
has the ``notifications/claude/channel`` naming that todo. Prints p50/p99/max per mode (target:
p99 < 100 ms on loopback) and the share of the time the POST itself took.

Side by side, in the same run and server, the long-poll path: a pull-only agent parked in
``claim_next`` with ``wait_seconds`` (raw HTTP, the SSE answer), and the same signed webhooks;
the clock runs from the webhook's 202 to the claim's answer naming that todo.

With ``--waiters N`` (postgres+redis only), N long polls wait at once on one
daphne whose connection pool is capped at 2 (``DATABASE_POOL_MAX_SIZE=2``: waiting needs none),
the database connections that process holds are counted in ``pg_stat_activity`` while they
wait, and the webhook POST → claim latency (the target's clock; 202 → claim beside it) is
measured with all N parked (each claimed waiter polls again at once). Targets: ≤ 2
connections, POST → claim p99 < 150 ms.

The burst (``--burst N``, postgres+redis): one SDK client streams while a second session of the
same endpoint is attached without a stream (a raw-HTTP initialize), and N operator hand-overs
are committed at once from N threads of this process (publishers racing for the endpoint's
sessions, as several web processes and workers do; one daphne rings its own deliveries one
after another). The line is the share of their doorbells that reached the stream (target
100 %: the streamless session is rung only when no session streams, and its doorbell is
dropped).

A benchmark, not a test: nothing here asserts a speed, and a shared machine makes the tail noisy.
"""

import argparse
import asyncio
import hashlib
import hmac
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

# Run as a script, this directory would shadow installed packages (bench/mcp.py vs the SDK).
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(ROOT))
from bench.modes import percentile, run_children  # noqa: E402

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "switchboard.settings")
# Production settings need a secrets key of their own; a bench-only one.
os.environ.setdefault("SWITCHBOARD_SECRETS_KEY", "c3dpdGNoYm9hcmQtYmVuY2gtb25seS1zZWNyZXRzISE=")

SECRET = "bench-push-secret-0123456789abcdef"
# The many-waiters run parks hundreds of sessions on one credential: lift the per-credential
# session cap (SWITCHBOARD_MAX_SESSIONS_PER_CREDENTIAL, default 32) along with the rate limits.
UNTHROTTLED = {"SWITCHBOARD_INGEST_RATE_PER_MINUTE": "100000000",
               "SWITCHBOARD_MCP_RATE_PER_MINUTE": "100000000",
               "SWITCHBOARD_MAX_SESSIONS_PER_CREDENTIAL": "100000",
               # The 500-waiter line parks every long poll under one credential.
               "SWITCHBOARD_MAX_LONG_POLLS_PER_CREDENTIAL": "100000"}


def prepare(run_id: str, kind: str = "push"):
    """Migrate, then an endpoint, a GitHub webhook and its route (one per measured path, so
    one path's leftover todos never answer another's claim). Returns the names we need."""
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    from endpoints import transitions as endpoint_transitions
    from ingest import transitions as ingest_transitions

    call_command("migrate", interactive=False, verbosity=0)
    owner, _ = get_user_model().objects.get_or_create(username=f"bench-{run_id}")
    endpoint, credential = endpoint_transitions.vend_endpoint(slug=f"{kind}-{run_id}", owner=owner)
    webhook, _ = ingest_transitions.create_webhook(slug=f"{kind}-{run_id}", owner=owner,
                                                   source="github", secret=SECRET)
    ingest_transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="issues")
    return endpoint.slug, credential, webhook.slug


def signed_delivery(number: int) -> tuple[bytes, dict]:
    # A nonce: the same body under a new delivery id is a refused replay.
    body = json.dumps({"action": "opened", "issue": {"number": number, "title": f"bench {number}"},
                       "repository": {"full_name": "bench/push"},
                       "nonce": uuid.uuid4().hex}).encode()
    signature = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    return body, {"Content-Type": "application/json", "X-Hub-Signature-256": f"sha256={signature}",
                  "X-GitHub-Event": "issues", "X-GitHub-Delivery": str(uuid.uuid4())}


async def wait_for_stream(client, listener, http, base_url, hook_slug):
    """Until the SDK client's notification stream is open: it is once a doorbell arrives, so
    ring until one does (bounded)."""
    await client.call_tool("list_todos", {"limit": 1})  # the SDK opens its GET stream
    deadline = time.monotonic() + 30
    while True:
        body, headers = signed_delivery(0)
        await http.post(f"{base_url}/hooks/{hook_slug}", content=body, headers=headers)
        try:
            await listener.next(timeout=1)
            return
        except asyncio.TimeoutError:
            if time.monotonic() > deadline:
                raise RuntimeError("no doorbell ever arrived") from None


async def measure(base_url, slug, credential, hook_slug, deliveries, warmup):
    import httpx

    from tests.mcp_clients import ChannelListener, sdk_client

    listener = ChannelListener()
    totals, posts = [], []
    async with sdk_client(base_url, slug, credential, listener=listener) as client, \
            httpx.AsyncClient(timeout=30) as http:
        await wait_for_stream(client, listener, http, base_url, hook_slug)
        while not listener.received.empty():
            listener.received.get_nowait()
        for number in range(1, warmup + deliveries + 1):
            body, headers = signed_delivery(number)
            started = time.perf_counter()
            answer = await http.post(f"{base_url}/hooks/{hook_slug}", content=body, headers=headers)
            accepted = time.perf_counter()
            assert answer.status_code == 202, answer.text
            todo_id = answer.json()["todos"][0]["id"]
            while True:  # the doorbell for THIS todo (a late earlier one is skipped)
                params = await listener.next(timeout=10)
                if params.meta.get("todo_id") == todo_id:
                    break
            received = time.perf_counter()
            if number > warmup:
                totals.append(received - started)
                posts.append(accepted - started)
    return totals, posts


async def measure_long_poll(base_url, slug, credential, hook_slug, deliveries, warmup):
    """One pull-only agent long-polling: webhook 202 → its claim_next answers with the todo."""
    import httpx

    from tests.long_poll_client import long_poll, open_session

    url = f"{base_url}/mcp/{slug}"
    totals, from_202 = [], []
    async with httpx.AsyncClient(timeout=30) as http:
        headers = await open_session(http, url, credential)
        for number in range(1, warmup + deliveries + 1):
            opened = asyncio.Event()
            waiter = asyncio.ensure_future(long_poll(http, url, headers, 30, opened=opened))
            await asyncio.wait_for(opened.wait(), 10)
            body, hook_headers = signed_delivery(100_000 + number)
            started = time.perf_counter()
            answer = await http.post(f"{base_url}/hooks/{hook_slug}", content=body,
                                     headers=hook_headers)
            accepted = time.perf_counter()
            assert answer.status_code == 202, answer.text
            result, answered = await waiter
            assert result["todo"]["id"] == answer.json()["todos"][0]["id"], result
            if number > warmup:
                totals.append(answered - started)
                from_202.append(answered - accepted)
    return totals, from_202


async def measure_many_waiters(base_url, slug, credential, hook_slug, waiters, deliveries,
                               count_connections):
    """``waiters`` long polls parked at once; connections counted; webhook POST → claim (the
    target's clock) and 202 → claim."""
    import httpx

    from tests.long_poll_client import long_poll, open_session

    url = f"{base_url}/mcp/{slug}"
    answered = {}  # todo id -> perf_counter of the claim's answer
    limits = httpx.Limits(max_connections=waiters + 20, max_keepalive_connections=waiters + 20)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        sessions = []
        for start in range(0, waiters, 50):
            sessions += await asyncio.gather(*(open_session(http, url, credential)
                                               for _ in range(start, min(waiters, start + 50))))
        ready = [asyncio.Event() for _ in sessions]

        async def agent(headers, opened):
            while True:  # claim, and wait again at once: N stay parked
                event = asyncio.Event()
                task = asyncio.ensure_future(long_poll(http, url, headers, 60, opened=event))
                await event.wait()
                opened.set()
                result, at = await task
                if "todo" in result:
                    answered[result["todo"]["id"]] = at

        agents = [asyncio.ensure_future(agent(h, e)) for h, e in zip(sessions, ready)]
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in ready)), 120)
            connections = await asyncio.to_thread(count_connections)
            from_post, from_202 = [], []
            for number in range(1, deliveries + 1):
                body, hook_headers = signed_delivery(200_000 + number)
                posted = time.perf_counter()
                answer = await http.post(f"{base_url}/hooks/{hook_slug}", content=body,
                                         headers=hook_headers)
                accepted = time.perf_counter()
                todo_id = answer.json()["todos"][0]["id"]
                deadline = accepted + 30
                while todo_id not in answered and time.perf_counter() < deadline:
                    await asyncio.sleep(0.001)  # the claim's answer lands in ``answered``
                from_post.append(answered.get(todo_id, deadline) - posted)
                from_202.append(answered.get(todo_id, deadline) - accepted)
                await asyncio.sleep(0.02)  # let the claimed waiter park again
            connections_after = await asyncio.to_thread(count_connections)
        finally:
            for task in agents:
                task.cancel()
    return from_post, from_202, max(connections, connections_after)


def hand_over_at_once(slug: str, count: int) -> list[str]:
    """``count`` operator hand-overs to ``slug``, committed at once from ``count`` threads (each
    rings after its commit). Returns their todo ids once their doorbells left."""
    from channels_push.bus import publish
    from channels_push.tests.conftest import make_ready_todos_at_once
    from endpoints.models import Endpoint

    made = make_ready_todos_at_once(Endpoint.objects.get(slug=slug), count, "issues",
                                    trust="operator")
    publish.wait_for_sends(30)
    return [str(todo.pk) for todo in made]


async def measure_burst(base_url, slug, credential, hook_slug, deliveries):
    """``deliveries`` hand-overs at once while one SDK client streams and a second session of
    the endpoint is attached without a stream. Returns how many of their doorbells reached
    the stream."""
    import httpx

    from tests.long_poll_client import open_session
    from tests.mcp_clients import ChannelListener, sdk_client

    listener = ChannelListener()
    async with sdk_client(base_url, slug, credential, listener=listener) as client, \
            httpx.AsyncClient(timeout=60) as http:
        await wait_for_stream(client, listener, http, base_url, hook_slug)
        # Claim the warm-up todo(s) so nothing else waits, then attach the streamless session.
        while (await client.call_tool("claim_next", {})).structured_content.get("todo"):
            pass
        while not listener.received.empty():
            listener.received.get_nowait()
        await open_session(http, f"{base_url}/mcp/{slug}", credential)
        made = set(await asyncio.to_thread(hand_over_at_once, slug, deliveries))
        heard = set()
        try:
            while not made <= heard:
                heard.add((await listener.next(timeout=5)).meta.get("todo_id"))
        except asyncio.TimeoutError:
            pass  # the rest went to the streamless session (or were lost)
    return len(made & heard)


def wait_ready(url, process, deadline_seconds=60):
    import httpx

    deadline = time.monotonic() + deadline_seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("server not ready")


def free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(mode: str, extra_env=None):
    port = free_port()
    env = {**os.environ, **UNTHROTTLED, "PYTHONUNBUFFERED": "1", "LOG_LEVEL": "WARNING",
           **(extra_env or {})}
    if mode == "embedded":
        command = [sys.executable, "manage.py", "serve", "--port", str(port)]
    else:
        command = [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
                   "switchboard.asgi:application"]
    log = tempfile.NamedTemporaryFile(prefix=f"bench-push-{mode}-", suffix=".log", delete=False)
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, server)
    return url, server


def child(mode: str, deliveries: int, warmup: int, waiters: int, burst: int):
    run_id = f"{os.getpid()}{int(time.time()) % 100000}"
    slug, credential, hook_slug = prepare(run_id)
    result = {"mode": mode}
    url, server = start_server(mode)
    try:
        result["totals"], result["posts"] = asyncio.run(
            measure(url, slug, credential, hook_slug, deliveries, warmup))
        result["poll_totals"], result["poll_from_202"] = asyncio.run(
            measure_long_poll(url, *prepare(run_id, "poll"), deliveries, warmup))
        if burst and mode != "embedded":  # its in-memory layer reaches no stream from here
            result["burst"] = burst
            result["burst_on_stream"] = asyncio.run(
                measure_burst(url, *prepare(run_id, "burst"), burst))
    finally:
        server.terminate()
        try:
            # A loaded machine can take longer than an idle one's ~2 s to drain the server.
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    if waiters and mode != "embedded":
        from django.db import connection

        app_name = f"bench-push-{run_id}"

        def count_connections():
            with connection.cursor() as cursor:
                cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                               [app_name])
                return cursor.fetchone()[0]

        url, server = start_server(mode, {"PGAPPNAME": app_name, "DATABASE_POOL_MAX_SIZE": "2"})
        try:
            (result["many_from_post"], result["many_from_202"],
             result["many_connections"]) = asyncio.run(
                measure_many_waiters(url, *prepare(run_id, "many"), waiters,
                                     max(50, deliveries // 4), count_connections))
        finally:
            server.terminate()
            server.wait(10)
        result["waiters"] = waiters
    print(json.dumps(result))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deliveries", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--waiters", type=int, default=500,
                        help="long polls parked at once on one process (0: skip)")
    parser.add_argument("--burst", type=int, default=40,
                        help="concurrent deliveries with one streaming + one streamless "
                             "session (0: skip)")
    parser.add_argument("--child", choices=["embedded", "postgres+redis"])
    args = parser.parse_args()
    if args.child:
        child(args.child, args.deliveries, args.warmup, args.waiters, args.burst)
        return
    if not os.environ.get("DATABASE_URL", "").startswith("postgres") or not os.environ.get("REDIS_URL"):
        sys.exit("bench/push.py compares against PostgreSQL + Redis: set DATABASE_URL=postgres://… "
                 "and REDIS_URL=redis://…")
    results = run_children(str(Path(__file__).resolve()), "postgres+redis", [
        "--deliveries", str(args.deliveries), "--warmup", str(args.warmup),
        "--waiters", str(args.waiters), "--burst", str(args.burst)])
    print(f"switchboard bench/push.py — {args.deliveries} signed webhooks one at a time "
          f"(+{args.warmup} warm-up) per path, loopback; doorbell: 1 SDK client attached; "
          "long poll: 1 raw-HTTP agent in claim_next(wait_seconds=30)")

    def ms(values, fraction):
        return f"{percentile(values, fraction) * 1000:6.1f} ms"

    for mode, result in results.items():
        totals, posts = result["totals"], result["posts"]
        print(f"  {mode:15s} POST → doorbell:      p50 {ms(totals, .5)}  p99 {ms(totals, .99)}  "
              f"max {max(totals) * 1000:6.1f} ms  mean {statistics.fmean(totals) * 1000:6.1f} ms"
              f"   (POST alone p50 {percentile(posts, .5) * 1000:.1f} ms, p99 "
              f"{percentile(posts, .99) * 1000:.1f} ms)")
        polled, after_202 = result["poll_totals"], result["poll_from_202"]
        print(f"  {mode:15s} POST → long-poll claim: p50 {ms(polled, .5)}  p99 {ms(polled, .99)}"
              f"  max {max(polled) * 1000:6.1f} ms;  202 → claim answered: p50 "
              f"{ms(after_202, .5)}  p99 {ms(after_202, .99)}")
    print("  target: p99 < 100 ms on loopback (doorbell)")
    for mode, result in results.items():
        if result.get("burst"):
            on_stream, burst = result["burst_on_stream"], result["burst"]
            print(f"  {mode:15s} burst: {burst} concurrent deliveries, 1 streaming + 1 streamless "
                  f"session: {on_stream}/{burst} rung on the stream "
                  f"({100 * on_stream / burst:.0f} %; target 100 %)")
    many = results.get("postgres+redis", {})
    if many.get("waiters"):
        after_post, after_202 = many["many_from_post"], many["many_from_202"]
        # The pool is capped at 2 on purpose: what is shown is that 500 waiters work within
        # it (no connection held while waiting) at the latency below, read from
        # pg_stat_activity; the count alone could not exceed the cap.
        print(f"  postgres+redis  {many['waiters']} long polls parked on one process whose pool "
              f"is capped at 2: {many['many_connections']} database connections held;  "
              f"POST → claim answered ({len(after_post)} webhooks): p50 {ms(after_post, .5)}  "
              f"p99 {ms(after_post, .99)}  max {max(after_post) * 1000:6.1f} ms;  202 → claim: "
              f"p50 {ms(after_202, .5)}  p99 {ms(after_202, .99)}")
        print("  targets: ≤ 2 connections, POST → claim p99 < 150 ms")


if __name__ == "__main__":
    main()
