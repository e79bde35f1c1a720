"""Many agents on one web process: open MCP notification streams and board
streams on ONE daphne process, on PostgreSQL + Redis.

    DATABASE_URL=postgres://… REDIS_URL=redis://… python bench/streams.py \
        [--streams 1000] [--per-endpoint 20] [--idle-seconds 60] [--deliveries 200] [--boards 200]

Clients are raw asyncio HTTP/1.1 connections in this process (1,000 SDK processes would not fit
the machine): each agent POSTs ``initialize``, then holds ``GET /mcp/<slug>`` open and reads its
SSE frames. Printed, side by side in one run:

* daphne's RSS per open MCP stream (RSS with the streams open minus RSS before, ÷ streams);
* database writes (rows inserted/updated/deleted, from ``pg_stat_database``, and per table
  from ``pg_stat_user_tables``) and transactions per minute while every stream is idle. No
  beat, worker or embedded scheduler runs, so no sweep statement is in the window: every row
  counted is the streams' own (their process heartbeat included);
* doorbell latency, signed webhook POST → the frame on the agent's stream, p50/p99, with all
  streams attached and then with only 10 attached;
* the same for ``--boards`` board streams (``/todos/events``, signed-in operators, 4 streams
  each; half the operators are superusers who see every change, half own none of the
  endpoints the deliveries reach), on a second, fresh daphne process so memory the closed MCP
  streams freed is not reused by them: RSS per stream; database transactions per committed burst
  of 5 deliveries (one board batch) beyond the idle rate, with the boards open and closed (the
  difference is what the boards cost per batch); and the idle boards' own transactions per
  minute (their keep-alive re-checks). Counts come from ``pg_stat_database`` read after
  PostgreSQL's late stats reports have landed (an idle backend reports up to 10 s late). That
  per-batch figure is a difference of two totals: it shows there is no per-board query, not
  an exact count (channels_push/board/tests/test_stream.py pins one query per batch for every
  view, after the two of the batch's re-check of every viewer).

Isolation from other runs on the same machine: the database is DATABASE_URL's, the channel
layer REDIS_URL's (with CHANNEL_PREFIX), and daphne listens on a free port of its own.

A benchmark, not a test: nothing here asserts a speed.
"""

import argparse
import asyncio
import hashlib
import hmac
import json
import os
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "switchboard.settings")
# The board's session cookies are minted here and checked by daphne: one SECRET_KEY for both.
os.environ.setdefault("SECRET_KEY", "bench-streams-secret-key")
# Production settings need a secrets key of their own; a bench-only one.
os.environ.setdefault("SWITCHBOARD_SECRETS_KEY", "c3dpdGNoYm9hcmQtYmVuY2gtb25seS1zZWNyZXRzISE=")

SECRET = "bench-streams-secret"
PROTOCOL = "2025-06-18"


# -- set-up (Django, in this process) -----------------------------------------------------------

def make_agents(run_id: str, endpoints: int):
    """``endpoints`` endpoints, each with a credential and a signed GitHub webhook routed to
    its inbox. Returns [(slug, credential, webhook slug)]."""
    from django.contrib.auth import get_user_model

    from endpoints import transitions as endpoint_transitions
    from ingest import transitions as ingest_transitions

    owner, _ = get_user_model().objects.get_or_create(username=f"bench-{run_id}")
    agents = []
    for n in range(endpoints):
        endpoint, credential = endpoint_transitions.vend_endpoint(slug=f"s{run_id}-{n}",
                                                                  owner=owner)
        webhook, _ = ingest_transitions.create_webhook(slug=f"h{run_id}-{n}", owner=owner,
                                                       source="github", secret=SECRET)
        ingest_transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="inbox")
        agents.append((endpoint.slug, credential, webhook.slug))
    return agents


def make_operators(run_id: str, count: int) -> list[str]:
    """``count`` signed-in operators (4 board streams each at most): their session keys. Every
    other one is a superuser (sees every change); the rest own one endpoint no delivery
    reaches (every change is one they may not see)."""
    from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY
    from django.contrib.auth import get_user_model
    from django.contrib.sessions.backends.db import SessionStore

    from endpoints import transitions as endpoint_transitions

    keys = []
    for n in range(count):
        user = get_user_model().objects.create_user(f"op-{run_id}-{n}", password="x",
                                                    is_superuser=n % 2 == 0)
        endpoint_transitions.vend_endpoint(slug=f"b{run_id}-{n}", owner=user)
        session = SessionStore()
        session[SESSION_KEY] = str(user.pk)
        session[BACKEND_SESSION_KEY] = "django.contrib.auth.backends.ModelBackend"
        session[HASH_SESSION_KEY] = user.get_session_auth_hash()
        session.create()
        keys.append(session.session_key)
    return keys


def database_activity() -> tuple[int, int]:
    """(rows written, transactions committed) so far in this database, all backends."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute(
            "SELECT tup_inserted + tup_updated + tup_deleted, xact_commit FROM pg_stat_database "
            "WHERE datname = current_database()")
        return cursor.fetchone()


def table_writes() -> dict:
    """Rows written so far per table of this database (inserted + updated + deleted)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT relname, n_tup_ins + n_tup_upd + n_tup_del FROM pg_stat_user_tables")
        return dict(cursor.fetchall())


def wait_for_attachments(expected: int, deadline_seconds: float = 120.0) -> None:
    """Until only ``expected`` streams are attached (their sessions' StreamAttachment rows)."""
    from django.db import connection

    deadline = time.monotonic() + deadline_seconds
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM channels_push_streamattachment")
            if cursor.fetchone()[0] <= expected:
                return
        time.sleep(0.05)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


# -- raw HTTP clients -----------------------------------------------------------------------------

async def request(port: int, method: str, path: str, headers: dict, body: bytes = b""):
    """One request on its own connection: (status, headers, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close",
             f"Content-Length: {len(body)}"] + [f"{k}: {v}" for k, v in headers.items()]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    found = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        found[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), found, payload


class Stream:
    """An open SSE stream; every ``data:`` frame naming a todo id is stamped on arrival."""

    def __init__(self, arrivals: dict):
        self.arrivals = arrivals
        self.writer = None
        self.task = None

    async def open(self, port: int, path: str, headers: dict):
        reader, self.writer = await asyncio.open_connection("127.0.0.1", port)
        lines = [f"GET {path} HTTP/1.1", "Host: 127.0.0.1", "Accept: text/event-stream"] + [
            f"{k}: {v}" for k, v in headers.items()]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        await self.writer.drain()
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"stream refused: {status!r}")
        self.task = asyncio.ensure_future(self._read(reader))

    async def _read(self, reader):
        while line := await reader.readline():
            if line.startswith(b"data:") and b"todo_id" in line:
                try:
                    params = json.loads(line[5:]).get("params", {})
                except ValueError:
                    continue
                todo_id = params.get("meta", {}).get("todo_id")
                if todo_id is not None:
                    self.arrivals.setdefault(str(todo_id), time.perf_counter())

    def close(self):
        self.task.cancel()
        self.writer.close()


async def open_agent_stream(port, slug, credential, arrivals) -> Stream:
    auth = {"Authorization": f"Bearer {credential}", "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream"}
    initialize = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": PROTOCOL, "capabilities": {},
        "clientInfo": {"name": "bench", "version": "1"}}}).encode()
    status, headers, _ = await request(port, "POST", f"/mcp/{slug}", auth, initialize)
    assert status == 200, status
    session = {"Mcp-Session-Id": headers["mcp-session-id"], "MCP-Protocol-Version": PROTOCOL}
    await request(port, "POST", f"/mcp/{slug}", {**auth, **session}, json.dumps(
        {"jsonrpc": "2.0", "method": "notifications/initialized"}).encode())
    stream = Stream(arrivals)
    await stream.open(port, f"/mcp/{slug}", {"Authorization": f"Bearer {credential}", **session})
    return stream


async def deliver(port, webhook_slug, number) -> tuple[str, float]:
    # A nonce: the same body under a new delivery id is a refused replay.
    body = json.dumps({"action": "opened", "issue": {"number": number, "title": "bench"},
                       "repository": {"full_name": "acme/app"}, "nonce": uuid.uuid4().hex}).encode()
    signature = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    began = time.perf_counter()
    status, _, payload = await request(port, "POST", f"/hooks/{webhook_slug}", {
        "Content-Type": "application/json", "X-Hub-Signature-256": f"sha256={signature}",
        "X-GitHub-Event": "issues", "X-GitHub-Delivery": str(uuid.uuid4())}, body)
    assert status == 202, (status, payload)
    return str(json.loads(payload)["todos"][0]["id"]), began


async def doorbell_latencies(port, agents, deliveries, arrivals) -> list[float]:
    latencies = []
    for n in range(deliveries):
        _, _, webhook_slug = agents[n % len(agents)]
        todo_id, began = await deliver(port, webhook_slug, n)
        deadline = time.perf_counter() + 5
        while todo_id not in arrivals and time.perf_counter() < deadline:
            await asyncio.sleep(0.001)
        if todo_id in arrivals:
            latencies.append(arrivals[todo_id] - began)
        await asyncio.sleep(0.05)
    return sorted(latencies)


def p(values, fraction):
    return values[min(len(values) - 1, int(fraction * len(values)))] * 1000 if values else float("nan")


# -- the run ----------------------------------------------------------------------------------------

async def measure(port, pid, args, agents, board_keys):
    arrivals = {}
    report = {}
    rss_before = rss_kib(pid)
    streams = []
    for slug, credential, _ in agents:
        for _ in range(min(args.per_endpoint, args.streams - len(streams))):
            streams.append(await open_agent_stream(port, slug, credential, arrivals))
    await asyncio.sleep(2)
    report["rss_per_stream_kib"] = (rss_kib(pid) - rss_before) / len(streams)
    report["streams"] = len(streams)

    # An idle backend reports its counters up to 10 s late (PostgreSQL's PGSTAT_IDLE_INTERVAL):
    # let the connections that served the opens report them before the idle window starts.
    await asyncio.sleep(12)
    writes, xacts = await asyncio.to_thread(database_activity)
    tables = await asyncio.to_thread(table_writes)
    await asyncio.sleep(args.idle_seconds)
    writes2, xacts2 = await asyncio.to_thread(database_activity)
    tables2 = await asyncio.to_thread(table_writes)
    per_minute = 60 / args.idle_seconds
    report["idle_writes_per_min"] = (writes2 - writes) * per_minute
    report["idle_xacts_per_min"] = (xacts2 - xacts) * per_minute
    report["idle_tables"] = {name: (rows - tables.get(name, 0)) * per_minute
                             for name, rows in tables2.items() if rows != tables.get(name, 0)}

    ten = agents[:10]
    report["bell_all"] = await doorbell_latencies(port, ten, args.deliveries, arrivals)
    # Keep one stream on each of the first 10 endpoints, close the rest.
    keep = {slug: None for slug, _, _ in ten}
    for stream, (slug, _, _) in zip(streams, [a for a in agents for _ in range(args.per_endpoint)]):
        if slug in keep and keep[slug] is None:
            keep[slug] = stream
        else:
            stream.close()
    # Measure 10 attached once the closed streams' detaches are done (each is a transaction in
    # the server's thread pool, which a webhook's handler would otherwise queue behind): this
    # is the latency with 10 attached, not during a mass disconnect, which is timed apart.
    closed_at = time.monotonic()
    await asyncio.to_thread(wait_for_attachments, len(ten))
    report["detach_seconds"] = time.monotonic() - closed_at
    report["bell_ten"] = await doorbell_latencies(port, ten, args.deliveries, arrivals)
    for stream in keep.values():
        if stream:
            stream.close()
    return report


async def measure_boards(port, pid, args, agents, board_keys, report):
    """Board streams on a daphne process of their own: RSS freed by closed MCP streams would be
    reused by the boards on the same process and hide what they cost. One board opened and
    closed first, so imports and first-use caches are in the baseline, not in the boards."""
    warm_up = Stream({})
    await warm_up.open(port, "/todos/events", {"Cookie": f"sessionid={board_keys[0]}"})
    await asyncio.sleep(1)
    warm_up.close()
    await asyncio.sleep(2)
    rss_before = rss_kib(pid)
    boards = []
    for key in board_keys:
        for _ in range(min(4, args.boards - len(boards))):
            board = Stream({})
            await board.open(port, "/todos/events", {"Cookie": f"sessionid={key}"})
            boards.append(board)
    await asyncio.sleep(2)
    report["boards"] = len(boards)
    report["rss_per_board_kib"] = (rss_kib(pid) - rss_before) / max(1, len(boards))
    ten = agents[:10]
    report["board_idle_rate"], report["board_xacts_per_burst"] = await board_burst_cost(port, ten)
    for board in boards:
        board.close()
    await asyncio.sleep(2)
    report["board_idle_rate_without"], report["board_xacts_per_burst_without"] = \
        await board_burst_cost(port, ten)


# PostgreSQL reports an idle backend's counters up to 10 s late (PGSTAT_IDLE_INTERVAL).
STATS_SETTLE_SECONDS = 12


async def settled_transactions() -> tuple[int, float]:
    """(transactions committed, when), read once every backend has reported what it did more
    than STATS_SETTLE_SECONDS ago."""
    await asyncio.sleep(STATS_SETTLE_SECONDS)
    _, xacts = await asyncio.to_thread(database_activity)
    return xacts, time.monotonic()


async def board_burst_cost(port, agents, bursts=10, per_burst=5) -> tuple[float, float]:
    """(transactions per second while nothing changes, transactions per burst of
    ``per_burst`` deliveries beyond that idle rate). A quiet window first gives the idle rate
    (the open streams' own re-checks); the burst window's count less that rate times its
    length is the bursts' cost (the deliveries' own included: the caller runs this with and
    without the boards and takes the difference)."""
    xacts0, at0 = await settled_transactions()
    await asyncio.sleep(15)
    xacts1, at1 = await settled_transactions()
    idle_rate = (xacts1 - xacts0) / (at1 - at0)
    for n in range(bursts):
        await asyncio.gather(*(deliver(port, agents[k % len(agents)][2], n) for k in range(per_burst)))
        await asyncio.sleep(0.5)  # one board batch per burst (publish batches 50 ms)
    xacts2, at2 = await settled_transactions()
    return idle_rate, ((xacts2 - xacts1) - idle_rate * (at2 - at1)) / bursts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--per-endpoint", type=int, default=20)
    parser.add_argument("--idle-seconds", type=float, default=60)
    # 200 samples: the p99 is then the 3rd-slowest, not the slowest of 50.
    parser.add_argument("--deliveries", type=int, default=200)
    parser.add_argument("--boards", type=int, default=200)
    args = parser.parse_args()

    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connection

    if connection.vendor != "postgresql" or not settings.REDIS_URL:
        sys.exit("bench/streams.py measures PostgreSQL + Redis: set DATABASE_URL and REDIS_URL")
    call_command("migrate", interactive=False, verbosity=0)
    run_id = f"{os.getpid() % 100000}{int(time.time()) % 10000}"
    endpoints = -(-args.streams // args.per_endpoint)
    agents = make_agents(run_id, max(endpoints, 10))
    board_keys = make_operators(run_id, -(-args.boards // 4))

    from tests.servers import DaphneServer

    def start_server():
        server = DaphneServer(env={
            "DATABASE_URL": os.environ["DATABASE_URL"],
            "SWITCHBOARD_MCP_RATE_PER_MINUTE": "100000000",
            "SWITCHBOARD_INGEST_RATE_PER_MINUTE": "100000000",
            "LOG_LEVEL": "WARNING",
        })
        server.env.pop("SWITCHBOARD_VAR_DIR", None)
        server.start()
        return server

    server = start_server()
    try:
        report = asyncio.run(measure(server.port, server.process.pid, args, agents, board_keys))
    finally:
        server.stop()
    server = start_server()
    try:
        asyncio.run(measure_boards(server.port, server.process.pid, args, agents, board_keys,
                                   report))
    finally:
        server.stop()

    print(f"switchboard bench/streams.py — one daphne process, PostgreSQL + Redis, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    print(f"  open MCP streams: {report['streams']}; daphne RSS per stream "
          f"{report['rss_per_stream_kib']:.1f} KiB (goal <= 50)")
    print(f"  idle for {args.idle_seconds:.0f} s: {report['idle_writes_per_min']:.1f} rows written "
          f"and {report['idle_xacts_per_min']:.0f} transactions per minute (goal: 0 beyond the "
          f"sweeps'; no sweep runs here, so every row counted is the streams' own)")
    by_table = ", ".join(f"{name} {rows:.1f}" for name, rows in sorted(report["idle_tables"].items()))
    print(f"    rows per minute by table (pg_stat_user_tables): {by_table or 'none'}")
    print(f"    (information) {report['streams'] - 10} streams closed at once: their detaches "
          f"done in {report['detach_seconds']:.1f} s")
    for label, key in ((f"{report['streams']} attached", "bell_all"), ("10 attached", "bell_ten")):
        values = report[key]
        print(f"  doorbell webhook -> frame, {label}: p50 {p(values, 0.5):.1f} ms, "
              f"p99 {p(values, 0.99):.1f} ms over {len(values)} (goal p99 < 100 ms)")
    print(f"  board streams: {report['boards']}; daphne RSS per stream "
          f"{report['rss_per_board_kib']:.1f} KiB; database transactions per burst of 5 "
          f"deliveries (one board batch) beyond the idle rate: "
          f"{report['board_xacts_per_burst']:.1f} with the boards open, "
          f"{report['board_xacts_per_burst_without']:.1f} without, so "
          f"{report['board_xacts_per_burst'] - report['board_xacts_per_burst_without']:.1f} "
          f"per batch for {report['boards']} boards (goal: one shared read per batch, not one "
          f"per board; each counted transaction of the board hub is one query)")
    print(f"    idle board streams' own transactions (keep-alive re-checks): "
          f"{(report['board_idle_rate'] - report['board_idle_rate_without']) * 60:.0f} per minute")
    bell_all, bell_ten = report["bell_all"], report["bell_ten"]
    if bell_all and bell_ten:
        print(f"  ratio doorbell p99 {report['streams']} attached / 10 attached: "
              f"{p(bell_all, 0.99) / p(bell_ten, 0.99):.2f}")


if __name__ == "__main__":
    main()
