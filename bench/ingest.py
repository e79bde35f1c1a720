"""Ingest benchmark (issue 3): signed GitHub deliveries over loopback, side by side with the HTTP
stack's floor, in one run.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/sb REDIS_URL=redis://127.0.0.1:6379/0 \\
        python bench/ingest.py [--deliveries 3000] [--concurrency 16] [--max-seconds 60]

It starts daphne processes itself on free loopback ports: one serving switchboard on
PostgreSQL (database ``<DATABASE_URL name>_bench``, created and migrated here), one serving
``bench/bare_asgi.py``, which reads the body and answers 202 without touching anything (the
floor). All get the same pre-signed requests from the same client at the same concurrency, in
alternating rounds (floor, switchboard, …, floor, switchboard, …) so drift on a shared machine
hits all alike. Prints deliveries/s, p50 and p99 for each, daphne's CPU per delivery (from
/proc/<pid>/stat) for each, and the ratio switchboard / bare-sql (issue 17's target >= 0.75),
by throughput and by CPU per delivery; switchboard / floor is printed for information.

What is measured on switchboard's side: ``POST /hooks/<slug>`` as production serves it, a plain
ASGI app (``channels_push/plain_http.py``) calling ``ingest.views.answer_hook`` in one thread
hop: webhook lookup, rate limit (Redis), signature, strict JSON, then the writes: for a
delivery matching one route, one autocommit statement (delivery event, replay-ledger entry,
delivery-log record, todo, its create event; see README), then the board publish and the
doorbell check.

A diagnostic third line, ``bare-sql`` (``bench/bare_sql_asgi.py``, a third daphne): the same
lookup and durable write with psycopg and nothing else, the least any Python server can do per
delivery here: the target's denominator. It tells how much of the gap to the floor is the
database write itself and how much is switchboard.

The client is a minimal HTTP/1.1 keep-alive client on asyncio streams rather than httpx: on a
small machine the load generator shares CPUs with the servers, and a heavier client would lower
both numbers and flatter the ratio. Bounded: at most ``--deliveries`` per round and
``--max-seconds`` per round. Exits non-zero if any switchboard answer is not 202 or the count of
switchboard's todos does not match the deliveries (exactly once per delivery).
"""

import sys
from pathlib import Path

# Run as a script, this folder is sys.path[0], and bench/queue.py would shadow the standard
# library's queue module (psycopg and concurrent.futures import it).
sys.path[:] = [entry for entry in sys.path
               if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import hashlib
import hmac
import json
import os
import signal
import socket
import statistics
import subprocess
import time
import uuid
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parent.parent
SECRET = "bench-secret-0123456789abcdef"
WEBHOOK = "bench-github"
ENDPOINT = "bench-agent"
READY_TIMEOUT_SECONDS = 30.0
RESPONSE_TIMEOUT_SECONDS = 30.0


# -- setup ---------------------------------------------------------------------------------------


def bench_database_url(url: str) -> str:
    parts = urlsplit(url)
    if not parts.scheme.startswith("postgres"):
        sys.exit("bench/ingest.py measures PostgreSQL: set DATABASE_URL=postgres://…")
    name = parts.path.lstrip("/") or "switchboard"
    return urlunsplit(parts._replace(path=f"/{name}_bench"))


def ensure_database(url: str) -> None:
    import psycopg

    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')


def prepare_switchboard(env: dict) -> None:
    """Migrate the bench database and (re)create the webhook, endpoint and route; old bench
    todos are removed so every run starts from the same table size."""
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=REPO,
                   env=env, check=True)
    script = f"""
import django
django.setup()
from django.contrib.auth import get_user_model
from endpoints.models import Endpoint
from ingest.models import DeliveryEvent, Route, Webhook
from todos.models import Todo
owner, _ = get_user_model().objects.get_or_create(username="bench-operator")
endpoint, _ = Endpoint.objects.get_or_create(slug={ENDPOINT!r}, defaults={{"owner": owner}})
Todo.objects.filter(endpoint=endpoint).delete()
DeliveryEvent.objects.filter(webhook__slug={WEBHOOK!r}).delete()
webhook, _ = Webhook.objects.update_or_create(
    slug={WEBHOOK!r}, defaults={{"owner": owner, "source": "github", "secret": {SECRET!r}}})
Route.objects.get_or_create(webhook=webhook, endpoint=endpoint, queue="inbox")
"""
    subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, check=True)


def count_bench_todos(env: dict) -> int:
    script = f"""
import django
django.setup()
from todos.models import Todo
print(Todo.objects.filter(endpoint__slug={ENDPOINT!r}, queue="inbox").count())
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, check=True,
                         capture_output=True, text=True)
    return int(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_daphne(app: str, port: int, env: dict, log_path: Path) -> subprocess.Popen:
    log = open(log_path, "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), app],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )


def wait_until_serving(port: int, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"daphne on port {port} exited; see {log_path}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                if sock.recv(64).startswith(b"HTTP/1.1"):
                    return
        except OSError:
            time.sleep(0.1)  # not listening yet: poll again until the deadline
    sys.exit(f"daphne on port {port} not serving after {READY_TIMEOUT_SECONDS} s; see {log_path}")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# -- requests ------------------------------------------------------------------------------------


def signed_requests(count: int, run_id: str) -> list[bytes]:
    """Distinct GitHub ``issues.opened`` deliveries, each with its own delivery id and a valid
    X-Hub-Signature-256, as raw HTTP/1.1 requests (signing is not part of what is measured)."""
    requests = []
    for number in range(count):
        body = json.dumps({
            "action": "opened",
            "issue": {"number": number, "title": f"Benchmark issue {number}",
                      "body": "Steps to reproduce: run the benchmark. " * 8},
            "repository": {"full_name": "bench/switchboard"},
            "sender": {"login": "bench"},
            # Unique per run: the same body under a new delivery id is a refused replay (§12).
            "run": run_id,
        }).encode()
        signature = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
        head = (
            f"POST /hooks/{WEBHOOK} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
            "X-GitHub-Event: issues\r\n"
            f"X-GitHub-Delivery: {run_id}-{number}\r\n"
            f"X-Hub-Signature-256: sha256={signature}\r\n\r\n"
        )
        requests.append(head.encode() + body)
    return requests


async def read_response(reader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if b"content-length" in headers:
        await reader.readexactly(int(headers[b"content-length"]))
    elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    return status


async def drive(port: int, requests: list[bytes], concurrency: int, max_seconds: float):
    """Send ``requests`` over ``concurrency`` keep-alive connections; return (elapsed seconds,
    latencies in seconds, {status: count})."""
    pending = iter(requests)
    latencies, statuses = [], {}
    deadline = time.perf_counter() + max_seconds

    async def worker():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for request in pending:
                if time.perf_counter() > deadline:
                    return
                started = time.perf_counter()
                writer.write(request)
                status = await asyncio.wait_for(read_response(reader), RESPONSE_TIMEOUT_SECONDS)
                latencies.append(time.perf_counter() - started)
                statuses[status] = statuses.get(status, 0) + 1
        finally:
            writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started, latencies, statuses


def percentile(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` so far (0.0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- main ----------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deliveries", type=int, default=3000, help="per measured round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per target")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=300, help="deliveries before measuring")
    parser.add_argument("--max-seconds", type=float, default=60.0, help="cap per round")
    args = parser.parse_args()

    database_url = bench_database_url(os.environ.get("DATABASE_URL", ""))
    ensure_database(database_url)
    env = {
        **os.environ, "DATABASE_URL": database_url, "DJANGO_SETTINGS_MODULE": "switchboard.settings",
        "SECRET_KEY": os.environ.get("SECRET_KEY", "bench-secret-key"),
        # Production settings need a secrets key of their own (issue 15); a bench-only one.
        "SWITCHBOARD_SECRETS_KEY": os.environ.get("SWITCHBOARD_SECRETS_KEY", "c3dpdGNoYm9hcmQtYmVuY2gtb25seS1zZWNyZXRzISE="),
        "ALLOWED_HOSTS": "127.0.0.1,localhost", "SWITCHBOARD_INGEST_RATE_PER_MINUTE": "1000000000",
        "PYTHONPATH": str(REPO),
    }
    prepare_switchboard(env)
    logs = REPO / "var"
    logs.mkdir(exist_ok=True)
    env["BENCH_BARE_SQL_DSN"] = database_url
    env["BENCH_WEBHOOK_SECRET"] = SECRET
    ports = {"floor": free_port(), "switchboard": free_port(), "bare-sql": free_port()}
    apps = {"floor": "bench.bare_asgi:application", "switchboard": "switchboard.asgi:application",
            "bare-sql": "bench.bare_sql_asgi:application"}
    processes = {}
    try:
        for name in apps:
            log_path = logs / f"bench-ingest-{name}.log"
            processes[name] = start_daphne(apps[name], ports[name], env, log_path)
            wait_until_serving(ports[name], processes[name], log_path)
        run_id = uuid.uuid4().hex[:12]
        total = args.warmup + args.rounds * args.deliveries
        requests = signed_requests(total, run_id)
        warm, measured = requests[:args.warmup], requests[args.warmup:]
        warmed = {name: asyncio.run(drive(ports[name], warm, args.concurrency, args.max_seconds))
                  for name in apps}
        results = {name: {"elapsed": 0.0, "latencies": [], "statuses": {}, "cpu": 0.0}
                   for name in apps}
        for round_number in range(args.rounds):
            batch = measured[round_number * args.deliveries:(round_number + 1) * args.deliveries]
            for name, port in ports.items():
                cpu_before = process_cpu_seconds(processes[name].pid)
                elapsed, latencies, statuses = asyncio.run(
                    drive(port, batch, args.concurrency, args.max_seconds))
                result = results[name]
                result["cpu"] += process_cpu_seconds(processes[name].pid) - cpu_before
                result["elapsed"] += elapsed
                result["latencies"] += latencies
                for status, count in statuses.items():
                    result["statuses"][status] = result["statuses"].get(status, 0) + count
    finally:
        for process in processes.values():
            stop(process)

    print(f"ingest benchmark: signed GitHub deliveries, concurrency {args.concurrency}, "
          f"{args.rounds} alternating rounds, PostgreSQL {urlsplit(database_url).path.lstrip('/')}, "
          f"Redis {'on' if os.environ.get('REDIS_URL') else 'off'}, {os.cpu_count()} CPUs")
    rates = {}
    for name, result in results.items():
        done = len(result["latencies"])
        rates[name] = done / result["elapsed"] if result["elapsed"] else 0.0
        print(f"  {name:<12} {done:>6} sent  {rates[name]:8.1f} deliveries/s  "
              f"p50 {percentile(result['latencies'], 0.50) * 1000:7.2f} ms  "
              f"p99 {percentile(result['latencies'], 0.99) * 1000:7.2f} ms  "
              f"mean {statistics.fmean(result['latencies']) * 1000:7.2f} ms  "
              f"statuses {dict(sorted(result['statuses'].items()))}")
    cpu_ms = {name: result["cpu"] / max(1, len(result["latencies"])) * 1000
              for name, result in results.items()}
    print(f"  daphne CPU per delivery: switchboard {cpu_ms['switchboard']:.2f} ms, bare-sql "
          f"{cpu_ms['bare-sql']:.2f} ms, floor {cpu_ms['floor']:.2f} ms")
    if rates["bare-sql"] and rates["floor"]:
        print(f"  ratio switchboard/bare-sql = {rates['switchboard'] / rates['bare-sql']:.2f} "
              f"(target >= 0.75); by daphne CPU per delivery bare-sql/switchboard = "
              f"{cpu_ms['bare-sql'] / cpu_ms['switchboard']:.2f}")
        print(f"  (information) switchboard/floor = {rates['switchboard'] / rates['floor']:.2f}, "
              f"bare-sql/floor = {rates['bare-sql'] / rates['floor']:.2f}")
    sent = len(warmed["switchboard"][1]) + len(results["switchboard"]["latencies"])
    todos = count_bench_todos(env)
    print(f"  todos created {todos} for {sent} deliveries sent (one per delivery: {todos == sent})")
    accepted = results["switchboard"]["statuses"].get(202, 0)
    if accepted != len(results["switchboard"]["latencies"]) or todos != sent:
        sys.exit(1)


if __name__ == "__main__":
    main()
