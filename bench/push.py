"""Benchmark: webhook POST → doorbell received by an attached SDK client (CONTRACT §7).

    DATABASE_URL=postgres://… REDIS_URL=redis://… python bench/push.py [--deliveries 500]

One run, two modes side by side, each against a real server process:

* embedded — ``manage.py serve`` with no DATABASE_URL and no REDIS_URL: SQLite (WAL) in a
  fresh temporary directory and the in-memory channel layer, sweeps in the process;
* postgres+redis — ``daphne switchboard.asgi:application`` on DATABASE_URL (PostgreSQL, migrated
  first) with the Redis channel layer at REDIS_URL.

In each, one official ``mcp`` SDK client is attached to the endpoint with its notification
stream open, and ``--deliveries`` signed GitHub webhooks are POSTed one after another to
``/hooks/<slug>``. For each, the clock runs from just before the POST to the moment the client
has the ``notifications/claude/channel`` naming that todo. Prints p50/p99/max per mode (target:
p99 < 100 ms on loopback) and the share of the time the POST itself took. A benchmark, not a
test: nothing here asserts a speed, and a shared machine makes the tail noisy.
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
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "switchboard.settings")
# Production settings need a secrets key of their own (issue 15); a bench-only one.
os.environ.setdefault("SWITCHBOARD_SECRETS_KEY", "c3dpdGNoYm9hcmQtYmVuY2gtb25seS1zZWNyZXRzISE=")

SECRET = "bench-push-secret-0123456789abcdef"
UNTHROTTLED = {"SWITCHBOARD_INGEST_RATE_PER_MINUTE": "100000000",
               "SWITCHBOARD_MCP_RATE_PER_MINUTE": "100000000"}


def prepare(run_id: str):
    """Migrate, then an endpoint, a GitHub webhook and its route. Returns the names we need."""
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    from endpoints import transitions as endpoint_transitions
    from ingest import transitions as ingest_transitions

    call_command("migrate", interactive=False, verbosity=0)
    owner, _ = get_user_model().objects.get_or_create(username=f"bench-{run_id}")
    endpoint, credential = endpoint_transitions.vend_endpoint(slug=f"push-{run_id}", owner=owner)
    webhook, _ = ingest_transitions.create_webhook(slug=f"push-{run_id}", owner=owner,
                                                   source="github", secret=SECRET)
    ingest_transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="issues")
    return endpoint.slug, credential, webhook.slug


def signed_delivery(number: int) -> tuple[bytes, dict]:
    body = json.dumps({"action": "opened", "issue": {"number": number, "title": f"bench {number}"},
                       "repository": {"full_name": "bench/push"}}).encode()
    signature = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    return body, {"Content-Type": "application/json", "X-Hub-Signature-256": f"sha256={signature}",
                  "X-GitHub-Event": "issues", "X-GitHub-Delivery": str(uuid.uuid4())}


async def measure(base_url, slug, credential, hook_slug, deliveries, warmup):
    import httpx

    from tests.mcp_clients import ChannelListener, sdk_client

    listener = ChannelListener()
    totals, posts = [], []
    async with sdk_client(base_url, slug, credential, listener=listener) as client, \
            httpx.AsyncClient(timeout=30) as http:
        await client.call_tool("list_todos", {"limit": 1})  # the SDK opens its GET stream
        # The stream is open once a doorbell arrives; ring until one does (bounded).
        deadline = time.monotonic() + 30
        while True:
            body, headers = signed_delivery(0)
            await http.post(f"{base_url}/hooks/{hook_slug}", content=body, headers=headers)
            try:
                await listener.next(timeout=1)
                break
            except asyncio.TimeoutError:
                if time.monotonic() > deadline:
                    raise RuntimeError("no doorbell ever arrived") from None
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


def percentile(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


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


def child(mode: str, deliveries: int, warmup: int):
    run_id = f"{os.getpid()}{int(time.time()) % 100000}"
    slug, credential, hook_slug = prepare(run_id)
    port = free_port()
    env = {**os.environ, **UNTHROTTLED, "PYTHONUNBUFFERED": "1", "LOG_LEVEL": "WARNING"}
    if mode == "embedded":
        command = [sys.executable, "manage.py", "serve", "--port", str(port)]
    else:
        command = [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
                   "switchboard.asgi:application"]
    log = tempfile.NamedTemporaryFile(prefix=f"bench-push-{mode}-", suffix=".log", delete=False)
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, server)
        totals, posts = asyncio.run(measure(url, slug, credential, hook_slug, deliveries, warmup))
    finally:
        server.terminate()
        server.wait(10)
    print(json.dumps({"mode": mode, "totals": totals, "posts": posts}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deliveries", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--child", choices=["embedded", "postgres+redis"])
    args = parser.parse_args()
    if args.child:
        child(args.child, args.deliveries, args.warmup)
        return
    if not os.environ.get("DATABASE_URL", "").startswith("postgres") or not os.environ.get("REDIS_URL"):
        sys.exit("bench/push.py compares against PostgreSQL + Redis: set DATABASE_URL=postgres://… "
                 "and REDIS_URL=redis://…")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-push-") as var_dir:
        embedded_env = {k: v for k, v in os.environ.items()
                        if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY")}
        embedded_env["SWITCHBOARD_VAR_DIR"] = var_dir
        for mode, env in (("embedded", embedded_env), ("postgres+redis", dict(os.environ))):
            out = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--child", mode,
                 "--deliveries", str(args.deliveries), "--warmup", str(args.warmup)],
                env=env, cwd=ROOT, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                sys.exit(f"{mode} run failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
            results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"switchboard bench/push.py — {args.deliveries} signed webhooks one at a time "
          f"(+{args.warmup} warm-up), 1 SDK client attached, loopback")
    for mode, result in results.items():
        totals, posts = result["totals"], result["posts"]
        print(f"  {mode:15s} POST → doorbell: p50 {percentile(totals, .5) * 1000:6.1f} ms  "
              f"p99 {percentile(totals, .99) * 1000:6.1f} ms  max {max(totals) * 1000:6.1f} ms  "
              f"mean {statistics.fmean(totals) * 1000:6.1f} ms   (POST alone p50 "
              f"{percentile(posts, .5) * 1000:.1f} ms, p99 {percentile(posts, .99) * 1000:.1f} ms)")
    print("  target: p99 < 100 ms on loopback")


if __name__ == "__main__":
    main()
