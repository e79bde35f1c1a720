"""Ingest benchmark: signed GitHub deliveries over loopback, side by side with the HTTP
stack's floor, in one run.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/sb REDIS_URL=redis://127.0.0.1:6379/0 \\
        python bench/ingest.py [--deliveries 3000] [--concurrency 16] [--max-seconds 60]

It starts daphne processes itself on free loopback ports: one serving switchboard on PostgreSQL
(database ``<DATABASE_URL name>_bench``, created and migrated here), one serving
``bench/bare_asgi.py``, which reads the body and answers 202 without touching anything (the floor).
All get the same pre-signed requests from the same client at the same concurrency, in alternating
rounds (floor, switchboard, …, floor, switchboard, …) so drift on a shared machine hits all alike.
Prints deliveries/s, p50 and p99 for each, daphne's CPU per delivery (from /proc/<pid>/stat) for
each, and the ratio switchboard / bare-sql (target >= 0.75;
docs/decisions/one-statement-delivery.md), by throughput and by CPU per delivery; switchboard /
floor is printed for information.

What is measured on switchboard's side: ``POST /hooks/<slug>`` as production serves it, a plain
ASGI app (``switchboard/http/plain.py``) calling ``ingest.hook.answer_hook`` in one thread
hop: webhook lookup, rate limit (Redis), signature, strict JSON, then the writes: for a
delivery matching one route, one autocommit statement (delivery event, replay-ledger entry,
delivery-log record, todo, its create event; docs/decisions/one-statement-delivery.md),
then the board publish and the doorbell check.

A diagnostic third line, ``bare-sql`` (``bench/bare_sql_asgi.py``, a third daphne): the same
lookup and durable write with psycopg and nothing else, the least any Python server can do per
delivery here: the target's denominator. It tells how much of the gap to the floor is the
database write itself and how much is switchboard.

``--compare-tree DIR`` is an A/B: a second switchboard daphne served from another checkout of
this repository (``git worktree add DIR <commit>``), line ``compare``, on the same database with
the same kind of requests, alternating with ``switchboard`` round by round (the order of the
targets reverses every round, so drift does not favour the one that goes first). Each round is
printed, and at the end the per-round ratios compare/switchboard with their median and range.
``--no-reference`` leaves out ``floor`` and ``bare-sql`` (fewer processes, shorter rounds).

PostgreSQL's share is measured too: every daphne connects under an application name of its
own (``PGAPPNAME``), and the CPU of that server's backends (``pg_stat_activity``, then
/proc/<pid>/stat) is read around each round. Run it on the machine the database runs on.

``--sources github,github-write-back,linear,slack,sentry`` adds one switchboard line per sender (``sb-linear``,
…): the same daphne and load, each sender's own signature scheme and a payload of its shape
(Linear's body timestamp and Slack's header timestamp are signed just before each round, so no
request is stale). Each line's p99 is that sender's hook answer time under this load; Slack
allows 3 s, Sentry 1 s, Linear 5 s.

``--anonymous`` adds three lines of anonymous posts to an ``unsigned`` webhook on the same
daphne (queue ``anon``): ``sb-anon-tiny`` (a 30-byte body), ``sb-anon-64k-arrays`` (64 KiB of
small nested arrays, the costliest shape to decode and check) and ``sb-anon-64k-text``
(64 KiB of escaped strings, which must be walked for NUL and lone surrogates), and prints
``anonymous body CPU``: each 64 KiB line's daphne + PostgreSQL CPU per request over the tiny
one's. What an anonymous sender can make a server spend per request is bounded by these
ratios; a refused body's answer status shows in its line.

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
# "github-write-back": GitHub deliveries to a webhook that writes back under a connection
# (docs/write-back.md): the loop guard and the create's outbox entry on the ingest path.
SOURCES = ("github", "github-write-back", "linear", "slack", "sentry")
ANONYMOUS = ("anon-tiny", "anon-64k-arrays", "anon-64k-text")
ANONYMOUS_WEBHOOK = "bench-unsigned"
ANONYMOUS_BODY_BYTES = 64 * 1024
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


def webhook_slug(source: str) -> str:
    if source in ANONYMOUS:
        return ANONYMOUS_WEBHOOK
    return WEBHOOK if source == "github" else f"bench-{source}"


def sender_of(source: str) -> str:
    return "github" if source == "github-write-back" else source


def target_name(source: str) -> str:
    return "switchboard" if source == "github" else f"sb-{source}"


def prepare_switchboard(env: dict, sources=("github",)) -> None:
    """Migrate the bench database and (re)create the webhook, endpoint and route; old bench
    todos are removed so every run starts from the same table size."""
    webhooks = sorted({(webhook_slug(source), "unsigned", "", "anon") if source in ANONYMOUS
                       else (webhook_slug(source), sender_of(source), SECRET, "inbox",
                             source == "github-write-back")
                       for source in sources})
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=REPO,
                   env=env, check=True)
    script = f"""
import django
django.setup()
from django.contrib.auth import get_user_model
from endpoints.models import Endpoint
from ingest.models import Connection, DeliveryEvent, Route, Webhook
from todos.models import Todo
owner, _ = get_user_model().objects.get_or_create(username="bench-operator")
endpoint, _ = Endpoint.objects.get_or_create(slug={ENDPOINT!r}, defaults={{"owner": owner}})
Todo.objects.filter(endpoint=endpoint).delete()
DeliveryEvent.objects.filter(webhook__slug={WEBHOOK!r}).delete()
for slug, source, secret, queue, writes_back in {webhooks!r}:
    DeliveryEvent.objects.filter(webhook__slug=slug).delete()
    connection = None
    if writes_back:  # never sent to: no worker runs, the sender's wake-up is enqueued only
        connection, _ = Connection.objects.get_or_create(name="bench-github", owner=owner,
            defaults={{"kind": "github_token", "secret": "ghp_bench",
                       "api_url": "https://api.github.com", "identity": "bench-bot"}})
    webhook, _ = Webhook.objects.update_or_create(
        slug=slug, defaults={{"owner": owner, "source": source, "secret": secret,
                             "connection": connection}})
    Route.objects.get_or_create(webhook=webhook, endpoint=endpoint, queue=queue)
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


def start_daphne(app: str, port: int, env: dict, log_path: Path,
                 tree: Path = REPO) -> subprocess.Popen:
    log = open(log_path, "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), app],
        cwd=tree, env={**env, "PYTHONPATH": str(tree)}, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
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


def _hex_hmac(message: bytes) -> str:
    return hmac.new(SECRET.encode(), message, hashlib.sha256).hexdigest()


def anonymous_body(source: str, number: int, run_id: str) -> bytes:
    """An anonymous post of ``source``'s shape, distinct per number (an unsigned delivery's key
    is its body's digest), the 64 KiB ones padded to exactly ANONYMOUS_BODY_BYTES."""
    head = f'{{"run":"{run_id}","n":{number},"a":['.encode()
    if source == "anon-tiny":
        return head + b"]}"
    item = b"[1]" if source == "anon-64k-arrays" else b'"\\n"'
    count = (ANONYMOUS_BODY_BYTES - len(head) - 2 + 1) // (len(item) + 1)
    body = head + b",".join([item] * count) + b"]}"
    return body + b" " * (ANONYMOUS_BODY_BYTES - len(body))


def sender_request(source: str, number: int, run_id: str) -> bytes:
    """One Linear, Slack or Sentry delivery of the shape each sends, signed as each signs; or
    an anonymous post (``ANONYMOUS``)."""
    delivery = f"{run_id}-{number}"
    text = "Steps to reproduce: run the benchmark. " * 8
    if source in ANONYMOUS:
        body = anonymous_body(source, number, run_id)
        headers = ""
    elif source == "linear":
        body = json.dumps({
            "action": "create", "type": "Issue", "organizationId": "bench", "run": run_id,
            "data": {"id": delivery, "identifier": f"BEN-{number}", "title": f"Benchmark {number}",
                     "description": text}, "webhookTimestamp": int(time.time() * 1000),
        }).encode()
        headers = (f"Linear-Event: Issue\r\nLinear-Delivery: {delivery}\r\n"
                   f"Linear-Signature: {_hex_hmac(body)}\r\n")
    elif source == "slack":
        body = json.dumps({
            "type": "event_callback", "team_id": "T0BENCH", "event_id": f"Ev{delivery}",
            "event": {"type": "app_mention", "user": "U0BENCH", "channel": "C0BENCH",
                      "text": f"<@U0APP> benchmark {number}: {text}"}, "run": run_id,
        }).encode()
        stamp = str(int(time.time()))
        headers = (f"X-Slack-Request-Timestamp: {stamp}\r\n"
                   f"X-Slack-Signature: v0={_hex_hmac(f'v0:{stamp}:'.encode() + body)}\r\n")
    elif source == "sentry":
        body = json.dumps({
            "action": "created", "installation": {"uuid": "bench"}, "run": run_id,
            "data": {"issue": {"id": delivery, "shortId": f"BENCH-{number}",
                               "title": f"ZeroDivisionError: benchmark {number}",
                               "culprit": text}},
        }).encode()
        headers = (f"Sentry-Hook-Resource: issue\r\nRequest-ID: {delivery}\r\n"
                   f"Sentry-Hook-Signature: {_hex_hmac(body)}\r\n")
    else:
        raise ValueError(source)
    head = (f"POST /hooks/{webhook_slug(source)} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{headers}\r\n")
    return head.encode() + body


def source_requests(source: str, start: int, count: int, run_id: str) -> list[bytes]:
    """Requests ``start`` … ``start + count - 1`` of one source, signed now."""
    if source in ("github", "github-write-back"):
        return signed_requests(start + count, run_id, webhook_slug(source))[start:]
    return [sender_request(source, number, run_id) for number in range(start, start + count)]


def signed_requests(count: int, run_id: str, webhook: str = WEBHOOK) -> list[bytes]:
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
            # Unique per run: the same body under a new delivery id is a refused replay.
            "run": run_id,
        }).encode()
        signature = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
        head = (
            f"POST /hooks/{webhook} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
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


def app_name(server: str) -> str:
    return f"bench-ingest-{server}"


def backend_cpu_seconds(monitor, server: str) -> dict:
    """``{pid: CPU seconds so far}`` of the PostgreSQL backends ``server``'s daphne holds."""
    rows = monitor.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                           (app_name(server),)).fetchall()
    return {pid: process_cpu_seconds(pid) for (pid,) in rows}


def backend_cpu_spent(before: dict, after: dict) -> tuple[float, int]:
    """CPU the backends spent between two readings, and how many backends ended in between
    (their share is lost: the pool keeps its connections, so this should stay 0)."""
    spent = sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())
    return spent, len(before.keys() - after.keys())


def ratio_summary(values: list) -> str:
    return (f"median {statistics.median(values):.3f}  range {min(values):.3f}-{max(values):.3f}"
            f"  ({len(values)} rounds)")


# -- main ----------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deliveries", type=int, default=3000, help="per measured round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per target")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=300, help="deliveries before measuring")
    parser.add_argument("--max-seconds", type=float, default=60.0, help="cap per round")
    parser.add_argument("--sources", default="github",
                        help=f"comma-separated senders to measure, of {','.join(SOURCES)}")
    parser.add_argument("--compare-tree", type=Path, default=None,
                        help="another checkout of this repository: served as line 'compare'")
    parser.add_argument("--no-reference", action="store_true",
                        help="leave out the floor and bare-sql lines")
    parser.add_argument("--anonymous", action="store_true",
                        help="add tiny and 64 KiB anonymous posts to an unsigned webhook and "
                             "print their CPU ratio")
    args = parser.parse_args()
    if args.compare_tree is not None and not (args.compare_tree / "manage.py").is_file():
        sys.exit(f"--compare-tree: {args.compare_tree} is not a checkout of this repository")
    sources = [name.strip() for name in args.sources.split(",") if name.strip()]
    if not sources or set(sources) - set(SOURCES):
        sys.exit(f"--sources: pick from {','.join(SOURCES)}")
    signed_sources = list(sources)
    if args.anonymous:
        sources += list(ANONYMOUS)

    database_url = bench_database_url(os.environ.get("DATABASE_URL", ""))
    ensure_database(database_url)
    env = {
        **os.environ, "DATABASE_URL": database_url, "DJANGO_SETTINGS_MODULE": "switchboard.settings",
        "SECRET_KEY": os.environ.get("SECRET_KEY", "bench-secret-key"),
        # Production settings need a secrets key of their own; a bench-only one.
        "SWITCHBOARD_SECRETS_KEY": os.environ.get("SWITCHBOARD_SECRETS_KEY", "c3dpdGNoYm9hcmQtYmVuY2gtb25seS1zZWNyZXRzISE="),
        "ALLOWED_HOSTS": "127.0.0.1,localhost", "SWITCHBOARD_INGEST_RATE_PER_MINUTE": "1000000000",
        "PYTHONPATH": str(REPO),
    }
    prepare_switchboard(env, sources)
    logs = REPO / "var"
    logs.mkdir(exist_ok=True)
    env["BENCH_BARE_SQL_DSN"] = database_url
    env["BENCH_WEBHOOK_SECRET"] = SECRET
    apps = {"floor": "bench.bare_asgi:application", "switchboard": "switchboard.asgi:application",
            "bare-sql": "bench.bare_sql_asgi:application"}
    trees = dict.fromkeys(apps, REPO)
    if args.no_reference:
        del apps["floor"], apps["bare-sql"]
    if args.compare_tree is not None:
        apps["compare"] = "switchboard.asgi:application"
        trees["compare"] = args.compare_tree.resolve()
    ports = {name: free_port() for name in apps}
    # Every target: (daphne it is served by, the sender whose requests it gets). The sender
    # lines share switchboard's daphne; floor, bare-sql and compare get GitHub's requests.
    targets = {"floor": ("floor", "github")} if "floor" in apps else {}
    targets.update({target_name(source): ("switchboard", source) for source in sources})
    if "compare" in apps:
        targets["compare"] = ("compare", "github")
    if "bare-sql" in apps:
        targets["bare-sql"] = ("bare-sql", "github")
    processes = {}
    import psycopg

    monitor = psycopg.connect(database_url, autocommit=True)
    try:
        for name in apps:
            log_path = logs / f"bench-ingest-{name}.log"
            processes[name] = start_daphne(apps[name], ports[name],
                                           {**env, "PGAPPNAME": app_name(name)}, log_path,
                                           trees[name])
            wait_until_serving(ports[name], processes[name], log_path)
        run_id = uuid.uuid4().hex[:12]
        # Signed per round, just before it is sent: Linear's and Slack's timestamps age.
        warmed = {name: asyncio.run(drive(
                      ports[server], source_requests(source, 0, args.warmup, f"{run_id}{name}"),
                      args.concurrency, args.max_seconds))
                  for name, (server, source) in targets.items()}
        # Fresh statistics before measuring, as autovacuum would have taken by now; a server
        # with autovacuum off (a shared test box) never does. Without them a server's pooled
        # connections keep whatever generic plan they chose while the tables were nearly
        # empty (ANALYZE invalidates those plans), and a lookup planned on the wrong index
        # then costs more each round as the tables grow.
        monitor.execute("ANALYZE")
        results = {name: {"elapsed": 0.0, "latencies": [], "statuses": {}, "cpu": 0.0,
                          "db_cpu": 0.0, "lost_backends": 0, "rounds": []}
                   for name in targets}
        for round_number in range(args.rounds):
            start = args.warmup + round_number * args.deliveries
            order = list(targets.items())
            if round_number % 2:
                order.reverse()  # A B, B A, …: whichever goes first gains nothing from drift
            for name, (server, source) in order:
                batch = source_requests(source, start, args.deliveries, f"{run_id}{name}")
                db_before = backend_cpu_seconds(monitor, server)
                cpu_before = process_cpu_seconds(processes[server].pid)
                elapsed, latencies, statuses = asyncio.run(
                    drive(ports[server], batch, args.concurrency, args.max_seconds))
                cpu = process_cpu_seconds(processes[server].pid) - cpu_before
                db_cpu, lost = backend_cpu_spent(db_before, backend_cpu_seconds(monitor, server))
                result = results[name]
                result["cpu"] += cpu
                result["db_cpu"] += db_cpu
                result["lost_backends"] += lost
                result["elapsed"] += elapsed
                result["latencies"] += latencies
                done = max(1, len(latencies))
                result["rounds"].append({"rate": len(latencies) / elapsed if elapsed else 0.0,
                                         "cpu_ms": cpu / done * 1000,
                                         "db_cpu_ms": db_cpu / done * 1000})
                for status, count in statuses.items():
                    result["statuses"][status] = result["statuses"].get(status, 0) + count
    finally:
        monitor.close()
        for process in processes.values():
            stop(process)

    print(f"ingest benchmark: signed deliveries ({', '.join(sources)}), concurrency {args.concurrency}, "
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
    print("  daphne CPU per delivery: " + ", ".join(
        f"{name} {cpu_ms[name]:.2f} ms" for name in targets))
    db_ms = {name: result["db_cpu"] / max(1, len(result["latencies"])) * 1000
             for name, result in results.items()}
    print("  PostgreSQL backend CPU per delivery: " + ", ".join(
        f"{name} {db_ms[name]:.2f} ms" for name in targets))
    lost = {name: result["lost_backends"] for name, result in results.items()
            if result["lost_backends"]}
    if lost:
        print(f"  (backends that ended mid-round, their CPU not counted: {lost})")
    if "compare" in results and "switchboard" in results:
        print("  per round (deliveries/s | daphne ms | PostgreSQL ms per delivery):")
        for number, (ours, theirs) in enumerate(zip(results["switchboard"]["rounds"],
                                                    results["compare"]["rounds"]), 1):
            print(f"    {number:>3}  switchboard {ours['rate']:7.1f} | {ours['cpu_ms']:5.2f} |"
                  f" {ours['db_cpu_ms']:5.2f}    compare {theirs['rate']:7.1f} |"
                  f" {theirs['cpu_ms']:5.2f} | {theirs['db_cpu_ms']:5.2f}")
        pairs = list(zip(results["switchboard"]["rounds"], results["compare"]["rounds"]))
        for label, of in (("deliveries/s", lambda r: r["rate"]),
                          ("daphne CPU per delivery", lambda r: r["cpu_ms"]),
                          ("PostgreSQL CPU per delivery", lambda r: r["db_cpu_ms"]),
                          ("daphne + PostgreSQL CPU per delivery",
                           lambda r: r["cpu_ms"] + r["db_cpu_ms"])):
            ratios = [of(theirs) / of(ours) for ours, theirs in pairs if of(ours)]
            if ratios:
                print(f"  compare/switchboard {label}: {ratio_summary(ratios)}")
    if "switchboard" in rates and "bare-sql" in rates and rates["bare-sql"] and rates["floor"]:
        print(f"  ratio switchboard/bare-sql = {rates['switchboard'] / rates['bare-sql']:.2f} "
              f"(target >= 0.75); by daphne CPU per delivery bare-sql/switchboard = "
              f"{cpu_ms['bare-sql'] / cpu_ms['switchboard']:.2f}")
        print(f"  (information) switchboard/floor = {rates['switchboard'] / rates['floor']:.2f}, "
              f"bare-sql/floor = {rates['bare-sql'] / rates['floor']:.2f}")
    if args.anonymous:
        # daphne and PostgreSQL together: a body the server refuses early costs little in
        # either, one it stores costs in both.
        per_request = {name: cpu_ms[name] + db_ms[name] for name in targets}
        tiny = per_request[target_name("anon-tiny")]
        print("  anonymous body CPU (daphne + PostgreSQL per request, over the tiny post's "
              f"{tiny:.2f} ms): " + ", ".join(
                  f"{source.removeprefix('anon-')} {per_request[target_name(source)] / tiny:.1f}x"
                  f" (statuses {dict(sorted(results[target_name(source)]['statuses'].items()))})"
                  for source in ANONYMOUS[1:]))
    ours = [target_name(source) for source in signed_sources] + ["compare"] * ("compare" in targets)
    sent = sum(len(warmed[name][1]) + len(results[name]["latencies"]) for name in ours)
    todos = count_bench_todos(env)
    print(f"  todos created {todos} for {sent} deliveries sent (one per delivery: {todos == sent})")
    if any(results[name]["statuses"].get(202, 0) != len(results[name]["latencies"])
           for name in ours) or todos != sent:
        sys.exit(1)


if __name__ == "__main__":
    main()
