"""Benchmark: agents draining a queue over MCP vs. the same cycle through the transitions.

    DATABASE_URL=postgres://… REDIS_URL=redis://… python bench/mcp.py [--todos 4000] [--clients 8]
        [--trace-rounds 1] [--compare-tree DIR]

One run, side by side, on the database DATABASE_URL names (PostgreSQL; it is migrated first):

* direct — ``--clients`` threads each loop ``claim_next_todo`` + ``complete_todo`` in-process
  until the queue is empty;
* mcp — ``--clients`` processes, each one official ``mcp`` SDK client (Streamable HTTP) on its
  own MCP session, loop ``tools/call claim_next`` + ``tools/call complete`` against a real
  daphne process until ``{"empty": true}``. Clients are processes so the client side's Python
  is not what is measured.

Prints cycles/s for both and the tool-call latency p50/p99 seen by the clients. A benchmark,
not a test: nothing here asserts a speed.

The target is server CPU: the same SDK clients then drive the SDK's own Streamable
HTTP server (bench/mcp_reference_server.py: MCPServer, stateless, JSON answers, uvicorn, a no-op
tool) for as many tool calls, and the ratio of daphne's CPU per tools/call to the reference
server's is printed (target <= 1.0: switchboard doing real work costs no more server CPU per call
than the reference doing none). The same reference app is then served by daphne too, so the
ratio splits into the HTTP server's share (daphne vs uvicorn, same app) and the app's (switchboard
vs the no-op SDK app, same server).

It also prints where the CPU went (read from /proc: Linux, with PostgreSQL on this machine):
per direct cycle, this process and its PostgreSQL backends; per MCP tool call, the daphne
process, the SDK clients and daphne's backends. On a small machine all of them share the
cores, so when the cores are busy the ratio tends to direct CPU per cycle over MCP CPU per
cycle (clients included), whatever the server does; the split says which part a change can
still win.

Traces (docs/operating.md#traces): ``--trace-rounds N`` (default 1) more runs of the MCP
drain, alternating one with no OTEL_* variable ("unset"), one with an endpoint but
``OTEL_SDK_DISABLED=true`` ("off"), one exporting every span to a local OTLP/HTTP receiver
(tests/otlp_receiver.py, "on") and, with ``--compare-tree DIR``, one served from a checkout
from before traces ("before"), and prints the daphne process's CPU per tools/call for each side
by side, medians over the rounds (targets: before, off and unset alike; on at most 10 % over
unset).
"""

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

# Run as a script, this file's directory comes first on sys.path, and this file is named
# mcp.py: drop that entry so `import mcp` finds the SDK, and put the repository root there.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "switchboard.settings")
# Production settings need a secrets key of their own; a bench-only one.
os.environ.setdefault("SWITCHBOARD_SECRETS_KEY", "c3dpdGNoYm9hcmQtYmVuY2gtb25seS1zZWNyZXRzISE=")


def setup_django():
    import django

    django.setup()


def make_queue(slug: str, count: int):
    from django.contrib.auth import get_user_model

    from endpoints import transitions as endpoint_transitions
    from todos.models import State, Todo

    from datetime import timedelta

    from django.utils import timezone

    owner, _ = get_user_model().objects.get_or_create(username="bench")
    endpoint, credential = endpoint_transitions.vend_endpoint(slug=slug, owner=owner)
    # Bulk-inserted fixtures, not create_todo: creation is not what is measured.
    now = timezone.now()
    Todo.objects.bulk_create([
        Todo(endpoint=endpoint, queue="inbox", title=f"bench {i}", state=State.PENDING,
             max_attempts=5, created_at=now + timedelta(microseconds=i),
             updated_at=now + timedelta(microseconds=i))
        for i in range(count)
    ])
    return endpoint, credential


def run_direct(endpoint, clients: int) -> tuple[int, float]:
    from django.db import connection

    from todos import transitions

    done = [0] * clients
    barrier = threading.Barrier(clients + 1)

    def worker(index):
        caller = transitions.Caller.agent(endpoint, f"direct-{index}")
        barrier.wait()
        try:
            while True:
                todo = transitions.claim_next_todo(caller)
                if todo is None:
                    return
                transitions.complete_todo(caller, todo.pk, lease_id=todo.lease_id,
                                          result={"ok": True})
                done[index] += 1
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    return sum(done), time.perf_counter() - started


def mcp_worker(url: str, slug: str, credential: str, start_at: float, results):
    sys.path.insert(0, str(HERE.parent))
    from tests.mcp_clients import sdk_client

    async def loop():
        latencies, cycles = [], 0
        async with sdk_client(url, slug, credential) as client:
            await client.call_tool("list_todos", {"limit": 1})  # warm the connection
            while time.time() < start_at:
                await asyncio.sleep(0.001)
            cpu_started = time.process_time()
            while True:
                t0 = time.perf_counter()
                claimed = await client.call_tool("claim_next", {})
                latencies.append(time.perf_counter() - t0)
                content = claimed.structured_content
                if content.get("empty"):
                    break
                todo = content["todo"]
                t0 = time.perf_counter()
                await client.call_tool("complete", {"todo_id": todo["id"],
                                                    "lease_id": todo["lease_id"],
                                                    "result": {"ok": True}})
                latencies.append(time.perf_counter() - t0)
                cycles += 1
            finished = time.time()
            cpu_seconds = time.process_time() - cpu_started
        return cycles, latencies, finished, cpu_seconds

    _report(results, loop)


def _report(results, loop) -> None:
    """Run a client process's ``loop`` and put its outcome on ``results``, or the traceback
    when it failed: the parent must not wait out its timeout for a client that is gone."""
    try:
        results.put(asyncio.run(loop()))
    except BaseException:
        results.put(("failed", traceback.format_exc()))
        raise


def collect(results, count: int) -> list:
    """``count`` outcomes from the client processes; the first failure ends the run with the
    client's traceback."""
    outcomes = []
    for _ in range(count):
        outcome = results.get(timeout=600)
        if outcome[0] == "failed":
            raise RuntimeError(f"an SDK client process failed:\n{outcome[1]}")
        outcomes.append(outcome)
    return outcomes


def reference_worker(url: str, calls: int, start_at: float, results):
    """The same SDK client against the reference server: ``calls`` no-op tool calls."""
    sys.path.insert(0, str(HERE.parent))
    from tests.mcp_clients import sdk_client

    async def loop():
        latencies = []
        async with sdk_client(url, "reference", "unused") as client:
            await client.call_tool("noop", {})  # warm the connection
            while time.time() < start_at:
                await asyncio.sleep(0.001)
            for n in range(calls):
                t0 = time.perf_counter()
                await client.call_tool("noop", {"todo_id": str(n), "result": {"ok": True}})
                latencies.append(time.perf_counter() - t0)
        return len(latencies), latencies, time.time(), 0.0

    _report(results, loop)


def run_reference(calls_per_client: int, clients: int, *, on_daphne: bool = False):
    """Start the SDK's own server (on uvicorn, or ``on_daphne``: the same app on switchboard's
    server, with the flags tests/servers.py gives switchboard), drive it with ``clients`` SDK
    clients; returns (tool calls, server CPU seconds)."""
    import subprocess

    import socket

    from tests.servers import free_port

    port = free_port()
    if on_daphne:
        command = [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
                   "bench.mcp_reference_server:daphne_application"]
    else:
        command = [sys.executable, str(HERE / "mcp_reference_server.py"), str(port)]
    process = subprocess.Popen(command, cwd=HERE.parent, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or process.poll() is not None:
                    raise RuntimeError("the reference server did not start") from None
                time.sleep(0.1)
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        start_at = time.time() + 8.0
        workers = [context.Process(target=reference_worker,
                                   args=(f"http://127.0.0.1:{port}", calls_per_client, start_at,
                                         results)) for _ in range(clients)]
        for worker in workers:
            worker.start()
        time.sleep(max(0.0, start_at - time.time()))
        cpu = process_cpu_seconds(process.pid)
        outcomes = collect(results, len(workers))
        cpu = process_cpu_seconds(process.pid) - cpu
        for worker in workers:
            worker.join()
        return sum(o[0] for o in outcomes), cpu
    finally:
        process.terminate()
        process.wait(timeout=10)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far (0.0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def backends_cpu_snapshot() -> dict[int, float]:
    """CPU so far of each PostgreSQL backend connected to this database (the pools of this
    process and of daphne)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
        return {pid: process_cpu_seconds(pid) for (pid,) in cursor.fetchall()}


def backends_cpu_since(snapshot: dict[int, float]) -> float:
    """CPU the backends spent since ``snapshot``. One opened meanwhile counts with its whole
    life (its start-up included); one that ended meanwhile is missed (pools keep them)."""
    return sum(cpu - snapshot.get(pid, 0.0) for pid, cpu in backends_cpu_snapshot().items())


def run_mcp(server_url, endpoint, credential, clients: int):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    start_at = time.time() + 8.0  # every client connected and warm before the clock starts
    processes = [context.Process(target=mcp_worker,
                                 args=(server_url, endpoint.slug, credential, start_at, results))
                 for _ in range(clients)]
    for process in processes:
        process.start()
    outcomes = collect(results, len(processes))
    for process in processes:
        process.join()
    cycles = sum(o[0] for o in outcomes)
    latencies = sorted(lat for o in outcomes for lat in o[1])
    elapsed = max(o[2] for o in outcomes) - start_at
    return cycles, elapsed, latencies, sum(o[3] for o in outcomes)


def measure_server(slug: str, args, env=None, tree=None):
    """One MCP run on a fresh queue against its own daphne (``env``: more variables for it;
    ``tree``: served from another checkout): ``(cycles, seconds, latencies, client cpu, server
    cpu, backends cpu)``."""
    from tests.servers import DaphneServer

    endpoint, credential = make_queue(slug, args.todos)
    # The bench must not be throttled by the per-credential limit it is not measuring.
    env = {"SWITCHBOARD_MCP_RATE_PER_MINUTE": "100000000",
           "DATABASE_URL": os.environ["DATABASE_URL"], **(env or {})}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    server = DaphneServer(env=env, tree=tree).start()
    try:
        server_pid = server.process.pid
        server_cpu, backends = process_cpu_seconds(server_pid), backends_cpu_snapshot()
        cycles, seconds, latencies, client_cpu = run_mcp(server.url, endpoint, credential,
                                                         args.clients)
        server_cpu = process_cpu_seconds(server_pid) - server_cpu
        return cycles, seconds, latencies, client_cpu, server_cpu, backends_cpu_since(backends)
    finally:
        server.stop()


def compare_traces(run_id: str, args) -> dict:
    """Server CPU per tools/call with traces unset (no OTEL_* variable), off (an endpoint set
    but ``OTEL_SDK_DISABLED=true``) and on (exporting every span to a local OTLP/HTTP receiver,
    tests/otlp_receiver.py), and with ``--compare-tree`` the code before traces ("before"), in
    alternating rounds so drift on a shared machine falls on all: ``{mode: [ms…], "spans": n}``."""
    from tests.otlp_receiver import OtlpReceiver

    unset = {name: "" for name in os.environ if name.startswith("OTEL_")}
    modes = {"unset": (unset, None)}
    if args.compare_tree is not None:
        modes = {"before": (unset, args.compare_tree.resolve()), **modes}
    with OtlpReceiver() as receiver:
        modes["off"] = ({**unset, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
                         "OTEL_SDK_DISABLED": "true"}, None)
        modes["on"] = ({**unset, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}, None)
        per_call = {mode: [] for mode in modes}
        for round_number in range(args.trace_rounds):
            for mode, (env, tree) in modes.items():
                cycles, _, latencies, _, server_cpu, _ = measure_server(
                    f"bench-traces-{mode}-{round_number}-{run_id}", args, env=env, tree=tree)
                per_call[mode].append(server_cpu / len(latencies) * 1000)
        per_call["spans"] = len(receiver.snapshot())
        per_call["problems"] = receiver.problems
    return per_call


def percentile(sorted_values, fraction):
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, int(round(fraction * (len(sorted_values) - 1))))
    return sorted_values[index]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--todos", type=int, default=4000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--trace-rounds", type=int, default=1, metavar="N",
                        help="rounds of the traces comparison (one run unset, one off, one "
                             "on, each round); 0 skips it")
    parser.add_argument("--compare-tree", type=Path, default=None, metavar="DIR",
                        help="a checkout from before traces, served as mode 'before' in the "
                             "traces comparison (git worktree add DIR <commit>)")
    args = parser.parse_args()
    setup_django()
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connection

    if connection.vendor != "postgresql":
        sys.exit("bench/mcp.py measures PostgreSQL: set DATABASE_URL=postgres://…")
    call_command("migrate", interactive=False, verbosity=0)
    run_id = f"{os.getpid()}-{int(time.time())}"

    direct_endpoint, _ = make_queue(f"bench-direct-{run_id}", args.todos)
    direct_cpu, direct_backends = time.process_time(), backends_cpu_snapshot()
    direct_cycles, direct_seconds = run_direct(direct_endpoint, args.clients)
    direct_cpu = time.process_time() - direct_cpu
    direct_backend_cpu = backends_cpu_since(direct_backends)

    (mcp_cycles, mcp_seconds, latencies, client_cpu, server_cpu,
     backend_cpu) = measure_server(f"bench-mcp-{run_id}", args)
    traced = compare_traces(run_id, args) if args.trace_rounds else None

    reference_calls, reference_cpu = run_reference(
        calls_per_client=max(1, (2 * mcp_cycles) // args.clients), clients=args.clients)
    daphne_reference_calls, daphne_reference_cpu = run_reference(
        calls_per_client=max(1, (2 * mcp_cycles) // args.clients), clients=args.clients,
        on_daphne=True)

    direct_rate = direct_cycles / direct_seconds
    mcp_rate = mcp_cycles / mcp_seconds
    print(f"switchboard bench/mcp.py — {args.clients} clients, {args.todos} todos per run, "
          f"PostgreSQL, redis={'yes' if settings.REDIS_URL else 'no'}, 1 daphne process")
    print(f"  direct (transitions, {args.clients} threads): {direct_cycles} cycles in "
          f"{direct_seconds:.2f} s = {direct_rate:,.0f} cycles/s")
    print(f"  mcp    (SDK clients over HTTP):      {mcp_cycles} cycles in "
          f"{mcp_seconds:.2f} s = {mcp_rate:,.0f} cycles/s")
    print(f"  mcp/direct throughput: {mcp_rate / direct_rate:.2f} (information only: the clients "
          f"share the cores)")
    print(f"  tool-call latency: p50 {percentile(latencies, 0.50) * 1000:.1f} ms, "
          f"p99 {percentile(latencies, 0.99) * 1000:.1f} ms, mean "
          f"{statistics.fmean(latencies) * 1000:.1f} ms over {len(latencies)} calls")
    calls = len(latencies)
    print(f"  cpu per cycle: direct {direct_cpu / direct_cycles * 1000:.2f} ms + postgres "
          f"{direct_backend_cpu / direct_cycles * 1000:.2f} ms; mcp per tool call (2 a cycle): "
          f"daphne {server_cpu / calls * 1000:.2f} ms, sdk clients "
          f"{client_cpu / calls * 1000:.2f} ms, postgres {backend_cpu / calls * 1000:.2f} ms")
    daphne_per_call = server_cpu / calls
    reference_per_call = reference_cpu / reference_calls
    print(f"  server cpu per tools/call: switchboard (claim_next/complete: auth, session, rate "
          f"limit, database) {daphne_per_call * 1000:.2f} ms; the SDK's own server (MCPServer, "
          f"stateless JSON, uvicorn, a no-op tool) {reference_per_call * 1000:.2f} ms "
          f"over {reference_calls} calls")
    print(f"  ratio server cpu per call switchboard/reference: "
          f"{daphne_per_call / reference_per_call:.2f} (target <= 1.0)")
    # The same reference app on daphne splits that ratio into the HTTP server's share and the
    # app's: what switchboard's own code costs per call beyond the SDK's no-op tool.
    daphne_reference_per_call = daphne_reference_cpu / daphne_reference_calls
    print(f"  (information) the same reference app on daphne: "
          f"{daphne_reference_per_call * 1000:.2f} ms per call over {daphne_reference_calls} "
          f"calls; ratio daphne/uvicorn for the reference = "
          f"{daphne_reference_per_call / reference_per_call:.2f}; ratio switchboard/reference "
          f"both on daphne = {daphne_per_call / daphne_reference_per_call:.2f}")
    if traced is not None:
        medians = {mode: statistics.median(traced[mode]) for mode in traced
                   if mode not in ("spans", "problems")}
        unset_ms = medians["unset"]
        print(f"  server cpu per tools/call with traces, median of {args.trace_rounds} "
              "alternating rounds (targets: before, off = unset; on <= +10 %): "
              + "; ".join(f"{mode} {ms:.3f} ms ({(ms / unset_ms - 1) * 100:+.1f} %)"
                          for mode, ms in medians.items())
              + f"; {traced['spans']} spans received"
              + (f", receiver problems: {traced['problems']}" if traced["problems"] else ""))
        print("    rounds: " + "; ".join(f"{mode} " + " ".join(f"{ms:.3f}" for ms in traced[mode])
                                         for mode in medians))
    print(f"  load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on "
          f"{os.cpu_count()} cores")


if __name__ == "__main__":
    main()
