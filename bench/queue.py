"""Queue throughput and claim latency on PostgreSQL, measured side by side in one run.

    python3 -m venv bench/.venv && bench/.venv/bin/pip install -r bench/requirements.txt
    bench/.venv/bin/python bench/queue.py [--todos 2000] [--workers 1,4,8] [--rounds 3]

Throughput: claim_next + complete cycles per second with 1, 4 and 8 worker processes for
  (a) switchboard's transitions (todos spread over 4 queues of one endpoint whose scope lists
      them, claim_next over all granted queues, as agents use it),
  (b) the bare single-statement SQL floor with psycopg and no Django (claim = one
      UPDATE … (SELECT … FOR UPDATE SKIP LOCKED) RETURNING; complete = one UPDATE; no audit),
  (c) Procrastinate, the closest peer a Django user would pick, draining no-op jobs,
  (d) switchboard's own audited statements with plain psycopg, no Django (d/b is
      the ceiling for any Python implementation of them here; see audited_sql_worker).
Rounds interleave a, b, c, d so machine noise hits all alike; the median round counts. Each row
also gives PostgreSQL's CPU per cycle (the workers' backends, from /proc) and the worker
processes' own CPU per cycle (a's against d's is what switchboard's Python costs).

PostgreSQL CPU breakdown (``--breakdown-workers``, default 4): d's statements with one piece
taken out at a time (the four per-queue claim probes, the audit events)
beside b, so the PG a/b ratio comes with what it is made of.

Priorities: (e) is (a) draining todos with mixed priorities (-50…50; docs/work-control.md),
interleaved in the same rounds, so its table shows what ordering by priority costs (target: e
within 10 % of a). ``--systems a,e`` runs only those two.

Budgets (``--budget-blocks``, default 24; 0 skips it): what the daily budget's guard in the
claim statement costs a claim (target: within 5 %; docs/reference.md#usage-and-budgets). Not
a system of the rounds: on a shared, loaded machine the rates of separate drains move more than
the difference under test. Instead one process on one connection runs blocks of
``--block-cycles`` claim_next + complete cycles alternating (a f, f a, …) between two endpoints
alike but for the budget (``bench``: none; ``bench-budget``: a budget never reached), each
complete reporting the same usage, and takes the connection's PostgreSQL backend CPU from
/proc/<backend pid>/stat around every block. Load hits both settings alike within a pair of
neighbouring blocks, so the paired ratios and the CPU per cycle survive it.
``--budget-control`` leaves both without a budget: what differences the method shows then is
its noise on the machine at the time.
``--systems '' --history '' --breakdown-workers 0`` runs only this.

Latency: claim_next p50/p99 for one worker with 10k and with 1M done todos in the table, with
the pending todos at one priority and with mixed priorities.

Caps: ``--max-claimed N`` sets the bench endpoint's cap on claimed todos (docs/work-control.md#caps)
for the (a) rows: with N at or above the worker count it measures what the capacity guard costs
a claim; below it, claims held back by the cap (at_capacity) are retried and the rate is what
N slots sustain.

Databases (created when missing): sb_bench (switchboard's schema; BENCH_DB names another, so
two checkouts can bench at once) and sb_bench_procrastinate. The PostgreSQL server comes from
BENCH_PG (default postgres://postgres@127.0.0.1:5432), the Redis channel layer for (a) from
BENCH_REDIS (default redis://127.0.0.1:6379/9).
"""

import sys

# This file is named queue.py (the issue names it so); drop its folder from the import path so
# it does not shadow the standard library's queue module that psycopg and multiprocessing use.
sys.path = [p for p in sys.path if p not in ("", __file__.rsplit("/", 1)[0])]

import argparse  # noqa: E402
import functools  # noqa: E402
import multiprocessing as mp
import os  # noqa: E402
import platform  # noqa: E402
import secrets  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from datetime import datetime, timedelta, timezone  # noqa: E402
from pathlib import Path  # noqa: E402

import psycopg  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# Production settings need a secrets key of their own; a bench-only one.
os.environ.setdefault("SWITCHBOARD_SECRETS_KEY", "c3dpdGNoYm9hcmQtYmVuY2gtb25seS1zZWNyZXRzISE=")
PG = os.environ.get("BENCH_PG", "postgres://postgres@127.0.0.1:5432").rstrip("/")
SB_DB_NAME = os.environ.get("BENCH_DB", "sb_bench")
SB_DB = f"{PG}/{SB_DB_NAME}"
PROC_DB = f"{PG}/sb_bench_procrastinate"
BENCH_REDIS = os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379/9")
QUEUES = ["q0", "q1", "q2", "q3"]
SLUG = "bench"
BUDGET_SLUG = "bench-budget"  # as SLUG, with a daily budget in the budget blocks
WRITE_BACK_SLUG = "bench-write-back"  # as SLUG, its todos written back to their source


# -- set-up ----------------------------------------------------------------------------------------


def ensure_database(name: str):
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')


def prepare_switchboard_schema():
    ensure_database(SB_DB_NAME)
    env = dict(os.environ, DATABASE_URL=SB_DB, DJANGO_SETTINGS_MODULE="switchboard.settings")
    env.pop("REDIS_URL", None)
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True)
    # The endpoint through the product's own code, so the bench never lags behind the schema.
    script = (
        "import django; django.setup()\n"
        "from django.contrib.auth.models import User\n"
        "from endpoints import transitions\n"
        "from endpoints.models import Endpoint\n"
        "owner, _ = User.objects.get_or_create(username='bench')\n"
        f"for slug in {[SLUG, BUDGET_SLUG, WRITE_BACK_SLUG]!r}:\n"
        "    Endpoint.objects.filter(slug=slug).exists() or transitions.vend_endpoint("
        f"slug=slug, owner=owner, scope={QUEUES!r}, verbs=['claim_next', 'complete'])\n"
    )
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, check=True)


def _endpoint_columns() -> set:
    with psycopg.connect(SB_DB) as conn:
        return {row[0] for row in conn.execute(
            "SELECT column_name FROM information_schema.columns"
            " WHERE table_name = 'endpoints_endpoint'")}


def endpoint_id(conn, slug: str = SLUG) -> int:
    return conn.execute("SELECT id FROM endpoints_endpoint WHERE slug = %s", (slug,)).fetchone()[0]


# Mixed priorities for (e) and the latency runs: -50…50 in steps of 10, spread over creation
# order so that the claim order differs from the age order throughout.
MIXED_PRIORITY_SQL = "((g * 37) %% 11) * 10 - 50"


def refill_todos(count: int, done: int = 0, *, priorities: bool = False, slugs=(SLUG,)):
    """Empty the ledger, then add ``count`` pending todos over the queues (and ``done`` history)
    for each endpoint of ``slugs``; with ``priorities``, the pending todos get
    MIXED_PRIORITY_SQL."""
    with psycopg.connect(SB_DB, autocommit=True) as conn:
        conn.execute("TRUNCATE todos_todoevent, todos_todo CASCADE")
        insert = (
            "INSERT INTO todos_todo (endpoint_id, queue, state, title, kind, source, payload, trust, "
            "attempts, max_attempts, created_at, updated_at, ring_attempts, priority) "
            "SELECT %s, (ARRAY['q0','q1','q2','q3'])[1 + g %% 4], %s, 'bench todo', '', 'bench', "
            "'{\"n\": 1}', 'signed', %s, 5, now() - make_interval(secs => %s - g), now(), 0, "
            "{priority} FROM generate_series(1, %s) g"
        )
        for slug in slugs:
            ep = endpoint_id(conn, slug)
            if done:
                conn.execute(insert.replace("{priority}", "0"), (ep, "done", 1, done + count, done))
            conn.execute(insert.replace("{priority}", MIXED_PRIORITY_SQL if priorities else "0"),
                         (ep, "pending", 0, count, count))
        conn.execute("VACUUM ANALYZE todos_todo")
        if done:
            # Flush the fixture's write burst now: a checkpoint it triggers later would land
            # in the latency samples and measure the fixture, not the claim.
            conn.execute("CHECKPOINT")


def set_budget_and_spend(slug: str, usd_per_day):
    """``slug``'s daily budgets (None: none; with one, 10^11 tokens as well) and a row of
    today's spend well below any budget, so a guard's probe finds a row, as on a working
    day."""
    with psycopg.connect(SB_DB, autocommit=True) as conn:
        ep = endpoint_id(conn, slug)
        conn.execute("UPDATE endpoints_endpoint SET budget_usd_per_day = %s,"
                     " budget_tokens_per_day = %s WHERE id = %s",
                     (usd_per_day, None if usd_per_day is None else 10**11, ep))
        conn.execute("DELETE FROM todos_dailyspend WHERE endpoint_id = %s", (ep,))
        conn.execute("INSERT INTO todos_dailyspend (endpoint_id, day, cost_microusd, tokens)"
                     " VALUES (%s, (now() AT TIME ZONE 'utc')::date, 1000000, 5000)", (ep,))


def refill_jobs(count: int):
    from procrastinate import App, PsycopgConnector

    app = procrastinate_app(App, PsycopgConnector)
    with app.open():
        with psycopg.connect(PROC_DB, autocommit=True) as conn:
            conn.execute("TRUNCATE procrastinate_jobs CASCADE")
        batch = [{} for _ in range(count)]
        app.tasks["bench.noop"].batch_defer(*batch)
        with psycopg.connect(PROC_DB, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE procrastinate_jobs")


def procrastinate_app(App, PsycopgConnector):
    app = App(connector=PsycopgConnector(conninfo=PROC_DB))

    @app.task(name="bench.noop")
    def noop():
        return None

    return app


def prepare_procrastinate_schema():
    from procrastinate import App, PsycopgConnector

    ensure_database("sb_bench_procrastinate")
    with psycopg.connect(PROC_DB, autocommit=True) as conn:
        present = conn.execute("SELECT to_regclass('procrastinate_jobs')").fetchone()[0]
    if not present:
        app = procrastinate_app(App, PsycopgConnector)
        with app.open():
            app.schema_manager.apply_schema()


# -- workers (each its own process and connection) ---------------------------------------------


def production_env():
    """Production mode for the switchboard side: PostgreSQL and the Redis channel layer, so
    every transition pays for its after-commit board publish as it does in production."""
    os.environ.update(DATABASE_URL=SB_DB, DJANGO_SETTINGS_MODULE="switchboard.settings",
                      REDIS_URL=BENCH_REDIS, CHANNEL_PREFIX="sbbench")


def switchboard_worker(ready, start, done_queue, release):
    production_env()
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    import logging

    logging.disable(logging.WARNING)
    from endpoints.models import Endpoint
    from todos import transitions

    caller = transitions.Caller.agent(Endpoint.objects.get(slug=SLUG), f"w{os.getpid()}")
    ready.put(os.getpid())
    start.wait()
    cycles = 0
    while True:
        try:
            todo = transitions.claim_next_todo(caller)
        except transitions.Refusal as refusal:
            if refusal.code != "at_capacity":  # --max-claimed below the worker count
                raise
            continue
        if todo is None:
            break
        transitions.complete_todo(caller, todo.pk, lease_id=todo.lease_id)
        cycles += 1
    done_queue.put((time.perf_counter(), cycles))
    release.wait(60)  # keep the connection (and its backend's CPU count) until measured


BARE_CLAIM = (
    "UPDATE todos_todo SET state = 'claimed', lease_id = md5(random()::text), lease_owner = %s, "
    "lease_expires_at = now() + interval '300 seconds', attempts = attempts + 1 "
    "WHERE id = (SELECT id FROM todos_todo WHERE endpoint_id = %s AND state = 'pending' "
    "ORDER BY created_at, id LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING id, lease_id"
)
BARE_COMPLETE = (
    "UPDATE todos_todo SET state = 'done', lease_expires_at = NULL, updated_at = now() "
    "WHERE id = %s AND state = 'claimed' AND lease_id = %s"
)


def drain_with_psycopg(ready, start, done_queue, release, cycle):
    """A plain-psycopg worker: one connection, then ``cycle(conn, endpoint_id, owner)`` (one
    claim + complete; False once nothing is left) until the queue is empty."""
    conn = psycopg.connect(SB_DB, autocommit=True)
    ep = endpoint_id(conn)
    owner = f"w{os.getpid()}"
    ready.put(os.getpid())
    start.wait()
    cycles = 0
    while cycle(conn, ep, owner):
        cycles += 1
    done_queue.put((time.perf_counter(), cycles))
    release.wait(60)


def bare_cycle(conn, ep, owner) -> bool:
    row = conn.execute(BARE_CLAIM, (owner, ep)).fetchone()
    if row is None:
        return False
    conn.execute(BARE_COMPLETE, row)
    return True


def bare_worker(ready, start, done_queue, release):
    drain_with_psycopg(ready, start, done_queue, release, bare_cycle)


# (d) the floor of target 1 (a/d): switchboard's own claim_next and complete statements
# (as todos/transitions.py sends them on PostgreSQL: the four-queue LATERAL claim, the audit
# event in the same statement, the whole row returned, prepared) run with plain psycopg and no
# Django. d/b is the most any Python implementation of these audited statements can reach on
# this machine; a/d is what switchboard's Python costs on top. Keep in step with transitions.py.
_TODO_COLUMNS = (
    "id, endpoint_id, queue, state, title, kind, source, payload, idempotency_key, "
    "delivery_event_id, trust, attempts, max_attempts, lease_id, lease_owner, lease_expires_at, "
    "lease_ttl, retry_at, dead_lettered_at, result, last_error, created_at, updated_at, "
    "ring_attempts, last_ringed_at, priority, not_before"
)
_EVENT = (
    ", e AS (INSERT INTO todos_todoevent (todo_id, action, from_state, to_state, actor, at, "
    "detail) SELECT t.id, '{action}', '{before}', t.state, %(actor)s, %(now)s, "
    "%(detail)s::jsonb FROM t) SELECT * FROM t"
)
AUDITED_CLAIM = (
    "WITH t AS (UPDATE todos_todo SET state = 'claimed', lease_id = %(lease_id)s, "
    "lease_owner = %(owner)s, lease_expires_at = %(expires)s, lease_ttl = %(ttl)s, "
    "attempts = attempts + 1, retry_at = NULL, not_before = NULL, updated_at = %(now)s "
    "WHERE id = (SELECT c.id FROM "
    "unnest(%(queues)s::text[]) AS q(name) CROSS JOIN LATERAL (SELECT h.id, h.priority, "
    "h.created_at FROM (SELECT p.id, p.priority, p.created_at FROM todos_todo p "
    "WHERE p.endpoint_id = %(endpoint_id)s AND p.queue = q.name AND "
    "p.state = 'pending' AND p.not_before IS NULL ORDER BY p.priority DESC, p.created_at, p.id"
    ") h WHERE todo_claim_hold(h.id) LIMIT 1) c "
    "ORDER BY c.priority DESC, c.created_at, c.id LIMIT 1) AND state = 'pending' "
    "AND not_before IS NULL "
    f"RETURNING {_TODO_COLUMNS})" + _EVENT.format(action="claim", before="pending")
)
AUDITED_COMPLETE = (
    "WITH t AS (UPDATE todos_todo SET state = 'done', result = %(result)s::jsonb, "
    "lease_expires_at = NULL, updated_at = %(now)s WHERE id = %(todo_id)s AND "
    "(endpoint_id = %(endpoint_id)s AND queue = ANY(%(queues)s::text[]) AND state = 'claimed' "
    "AND lease_id = %(lease_id)s AND lease_expires_at > %(now)s) IS TRUE "
    f"RETURNING {_TODO_COLUMNS})"
    + _EVENT.format(action="complete", before="claimed")
)


def _without(sql: str, part: str, instead: str = "") -> str:
    assert part in sql, part  # keep the variants in step with the statements above
    return sql.replace(part, instead)


_LATERAL_PICK = AUDITED_CLAIM[AUDITED_CLAIM.index("(SELECT c.id"):AUDITED_CLAIM.index(
    ") AND state") + 1]
_EVENT_CTE = AUDITED_CLAIM[AUDITED_CLAIM.index(", e AS ("):AUDITED_CLAIM.index(" SELECT * FROM t")]
# Where PostgreSQL's CPU per cycle goes beyond the bare floor (b): the audited statements with
# one piece taken out at a time. A diagnostic for the PG a/b target; none of these variants is a
# product path (each drops something switchboard must do, or, for the one-scan claim, does what
# a `*` scope does, which a listed scope cannot: see claim_candidate_sql).
AUDITED_VARIANTS = {
    "audited statements (d)": (AUDITED_CLAIM, AUDITED_COMPLETE),
    "claim by one scan of todo_claim_any_queue (as a '*' scope), not 4 per-queue probes": (
        _without(AUDITED_CLAIM, _LATERAL_PICK,
                 "(SELECT h.id FROM (SELECT p.id FROM todos_todo p WHERE p.endpoint_id = "
                 "%(endpoint_id)s AND p.queue = ANY(%(queues)s::text[]) AND p.state = 'pending' "
                 "AND p.not_before IS NULL ORDER BY p.priority DESC, p.created_at, p.id) h "
                 "WHERE todo_claim_hold(h.id) LIMIT 1)"),
        AUDITED_COMPLETE),
    "no audit events (the two todo-event inserts)": (
        _without(AUDITED_CLAIM, _EVENT_CTE),
        _without(AUDITED_COMPLETE, AUDITED_COMPLETE[AUDITED_COMPLETE.index(", e AS ("):
                                                    AUDITED_COMPLETE.index(" SELECT * FROM t")])),
}


def audited_sql_cycle(conn, ep, owner, statements=(AUDITED_CLAIM, AUDITED_COMPLETE)) -> bool:
    claim, complete = statements
    now = datetime.now(timezone.utc)
    row = conn.execute(claim, {
        "lease_id": secrets.token_urlsafe(16), "owner": owner, "now": now,
        "expires": now + timedelta(seconds=300), "ttl": timedelta(seconds=300),
        "queues": QUEUES, "endpoint_id": ep,
        "actor": owner, "detail": "{}"}, prepare=True).fetchone()
    if row is None:
        return False
    conn.execute(complete, {
        "result": None, "now": datetime.now(timezone.utc), "todo_id": row[0],
        "endpoint_id": ep, "queues": QUEUES, "lease_id": row[13], "actor": owner,
        "detail": "{}"}, prepare=True).fetchall()
    return True


def audited_sql_worker(ready, start, done_queue, release):
    drain_with_psycopg(ready, start, done_queue, release, audited_sql_cycle)


def audited_variant_worker(variant, ready, start, done_queue, release):
    statements = AUDITED_VARIANTS[variant]
    drain_with_psycopg(ready, start, done_queue, release,
                       lambda conn, ep, owner: audited_sql_cycle(conn, ep, owner, statements))


def procrastinate_worker(ready, start, done_queue, release):
    import logging

    logging.disable(logging.WARNING)
    from procrastinate import App, PsycopgConnector

    app = procrastinate_app(App, PsycopgConnector)
    with app.open():
        ready.put(os.getpid())
        start.wait()
        app.run_worker(concurrency=1, wait=False, install_signal_handlers=False,
                       listen_notify=False, delete_jobs="never")
        done_queue.put((time.perf_counter(), None))
        release.wait(60)


SYSTEMS = {
    "a switchboard": (switchboard_worker, lambda n: refill_todos(n)),
    "b bare SQL": (bare_worker, lambda n: refill_todos(n)),
    "c procrastinate": (procrastinate_worker, refill_jobs),
    "d audited SQL, psycopg only": (audited_sql_worker, lambda n: refill_todos(n)),
    "e switchboard, mixed priorities": (switchboard_worker,
                                        lambda n: refill_todos(n, priorities=True)),
}


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` so far (0.0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def backends_cpu(database: str) -> dict[int, float]:
    """CPU so far of every PostgreSQL backend connected to ``database`` (the workers'; this
    probe's own connection left out). PostgreSQL must run on this machine (/proc)."""
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        pids = [pid for (pid,) in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (database,)).fetchall()]
    return {pid: process_cpu_seconds(pid) for pid in pids}


def run_round(worker, refill, todos: int, workers: int) -> tuple[float, float, float]:
    """One drain: (cycles/s, PostgreSQL CPU seconds per cycle of the workers' backends, the
    worker processes' own CPU seconds per cycle)."""
    refill(todos)
    database = "sb_bench_procrastinate" if worker is procrastinate_worker else SB_DB_NAME
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    release = ctx.Event()
    ready = ctx.Queue()
    done_queue = ctx.Queue()
    processes = [ctx.Process(target=worker, args=(ready, start, done_queue, release))
                 for _ in range(workers)]
    for process in processes:
        process.start()
    # Open the gate only when every process has imported, set up and connected: on 2 cores,
    # eight Django start-ups take several seconds, and a fixed sleep let them eat into the
    # measured drain (the bare SQL worker imports almost nothing, so that skewed a/b).
    pids = [ready.get(timeout=120) for _ in processes]
    time.sleep(0.2)  # let the last one reach start.wait()
    before = backends_cpu(database)
    workers_before = sum(process_cpu_seconds(pid) for pid in pids)
    began = time.perf_counter()
    start.set()
    finished = [done_queue.get(timeout=600)[0] for _ in processes]
    after = backends_cpu(database)
    workers_cpu = sum(process_cpu_seconds(pid) for pid in pids) - workers_before
    release.set()
    for process in processes:
        process.join(timeout=60)
    pg_cpu = sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())
    return todos / (max(finished) - began), pg_cpu / todos, workers_cpu / todos


# -- latency with history ------------------------------------------------------------------------


def claim_latency(done_rows: int, samples: int, *, priorities: bool = False) -> tuple[float, float]:
    refill_todos(samples, done=done_rows, priorities=priorities)
    production_env()
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    import logging

    logging.disable(logging.WARNING)
    from django.db import connection

    from endpoints.models import Endpoint
    from todos import transitions

    connection.close()
    caller = transitions.Caller.agent(Endpoint.objects.get(slug=SLUG), "latency")
    timings = []
    while True:
        began = time.perf_counter()
        todo = transitions.claim_next_todo(caller)
        timings.append(time.perf_counter() - began)
        if todo is None:
            break
        transitions.complete_todo(caller, todo.pk, lease_id=todo.lease_id)
    timings = sorted(timings[5:])  # the first few calls prepare statements
    return statistics.median(timings) * 1000, timings[int(len(timings) * 0.99)] * 1000


# Each complete of the budget blocks reports this, on both endpoints: the spend row is written
# by every complete and read by every budgeted claim, as on a working day; only the guard differs.
BLOCK_USAGE = {"input_tokens": 1200, "output_tokens": 300, "cost_usd": 0.0001, "turns": 1}


def _django_for_blocks():
    """Django set up in this process, on the bench database in production mode, quiet."""
    production_env()
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    import logging

    logging.disable(logging.WARNING)


def alternating_blocks(callers: dict, pairs: int, cycles: int, *, after_block=None):
    """Run ``pairs`` pairs of blocks of ``cycles`` claim_next + complete cycles, one block per
    setting of ``callers`` (two: setting -> Caller) in each pair, the order alternating so a
    drift in load is felt by both, on this process's one connection. ``after_block(setting)``
    runs untimed after each block. Returns per setting the blocks' wall seconds per cycle and
    the PostgreSQL backend's and this process's CPU seconds per block."""
    from django.db import connection

    from todos import transitions

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        backend = cursor.fetchone()[0]

    def block(setting: str, count: int) -> tuple[float, float, float]:
        caller = callers[setting]
        pg_before, own_before = process_cpu_seconds(backend), time.process_time()
        began = time.perf_counter()
        for _ in range(count):
            todo = transitions.claim_next_todo(caller)
            transitions.complete_todo(caller, todo.pk, lease_id=todo.lease_id,
                                      usage_reported=BLOCK_USAGE)
        measured = (time.perf_counter() - began, process_cpu_seconds(backend) - pg_before,
                    time.process_time() - own_before)
        if after_block is not None:
            after_block(setting)
        return measured

    first, second = callers
    for setting in callers:  # warm-up: prepared statements, caches; not counted
        block(setting, cycles // 2)
    wall, pg, own = ({setting: [] for setting in callers} for _ in range(3))
    for pair in range(pairs):
        for setting in (first, second) if pair % 2 == 0 else (second, first):
            seconds, pg_seconds, own_seconds = block(setting, cycles)
            wall[setting].append(seconds / cycles)
            pg[setting].append(pg_seconds)
            own[setting].append(own_seconds)
    return wall, pg, own


def print_blocks(title: str, labels: dict, wall: dict, pg: dict, own: dict, pairs: int,
                 cycles: int, load: tuple, target: str):
    """The table of ``alternating_blocks``' two settings: the median block's wall time per
    cycle, the backend's and the client's CPU per cycle, and the ratios (the second setting's
    rate as a share of the first's)."""
    (a, f) = labels
    per_cycle = {setting: (statistics.median(wall[setting]) * 1000,
                           sum(pg[setting]) / (pairs * cycles) * 1000,
                           sum(own[setting]) / (pairs * cycles) * 1000) for setting in labels}
    paired = statistics.median(x / y for x, y in zip(wall[a], wall[f]))
    (wall_a, pg_a, own_a), (wall_f, pg_f, own_f) = per_cycle[a], per_cycle[f]
    print(f"\n{title}: one process, one connection, {pairs} pairs of {cycles}-cycle blocks "
          f"alternating {a} {f} / {f} {a}; load average {load[0]:.1f} before, {load[1]:.1f} "
          f"after ({os.cpu_count()} cores)\n")
    print("| setting | wall ms/cycle (median block) | PG backend CPU ms/cycle | client CPU "
          "ms/cycle |")
    print("| --- | --- | --- | --- |")
    print(f"| {a}: {labels[a]} | {wall_a:.3f} | {pg_a:.3f} | {own_a:.3f} |")
    print(f"| {f}: {labels[f]} | {wall_f:.3f} | {pg_f:.3f} | {own_f:.3f} |")
    print(f"| {a}/{f}: {f}'s rate as a share of {a}'s (target {target}) | {wall_a / wall_f:.3f} "
          f"(median of the pairs: {paired:.3f}) | {pg_a / pg_f:.3f} | {own_a / own_f:.3f} |",
          flush=True)


def budget_blocks(pairs: int, cycles: int, *, control: bool = False):
    """The budget guard's cost, measured side by side (``alternating_blocks``; see the
    module's docstring): a has no budget, f a budget never reached; both report the same usage
    on every complete. ``control``: f has no budget either (an a/a run: the differences it
    shows are the method's noise on this machine)."""
    refill_todos(pairs * cycles + cycles, slugs=(SLUG, BUDGET_SLUG))
    set_budget_and_spend(SLUG, None)
    set_budget_and_spend(BUDGET_SLUG, None if control else 100_000)  # USD/day: never reached
    _django_for_blocks()
    from django.db import connection

    from endpoints.models import Endpoint
    from todos import transitions

    connection.close()
    callers = {setting: transitions.Caller.agent(Endpoint.objects.get(slug=slug), "blocks")
               for setting, slug in (("a", SLUG), ("f", BUDGET_SLUG))}
    assert not callers["a"].endpoint.has_budget and callers["f"].endpoint.has_budget != control
    load_before = os.getloadavg()
    wall, pg, own = alternating_blocks(callers, pairs, cycles)
    load_after = os.getloadavg()
    connection.close()
    set_budget_and_spend(BUDGET_SLUG, None)
    print_blocks("claim_next + complete with a daily budget set or not",
                 {"a": "no budget",
                  "f": "no budget either (control)" if control else "budget set, never reached"},
                 wall, pg, own, pairs, cycles, (load_before[0], load_after[0]), ">= 0.95")


def write_back_blocks(pairs: int, cycles: int):
    """What ``--write-back status`` costs a claim + complete (docs/write-back.md#the-outbox),
    side by side (``alternating_blocks``): a's todos write nothing back; w's came from a GitHub
    webhook with a connection, so each transition also writes its outbox entry in its own
    statement and wakes the sender (a Celery task enqueued on Redis, as in production). After
    each w block, untimed, the sender's first step takes the entries into write-backs
    (``absorb_outbox_entries``): its time and backend CPU per entry are printed beside the
    table. Nothing is sent (the source's answer is the worker's time, not a transition's)."""
    refill_todos(pairs * cycles + cycles, slugs=(SLUG, WRITE_BACK_SLUG))
    _django_for_blocks()
    from django.contrib.auth.models import User
    from django.db import connection
    from django.utils import timezone

    from endpoints.models import Endpoint
    from ingest import write_back
    from ingest.models import Connection, DeliveryEvent, Webhook, WriteBack
    from todos import transitions
    from todos.models import OutboxEntry

    owner = User.objects.get(username="bench")
    github, _ = Connection.objects.get_or_create(
        name="bench-github", owner=owner,
        defaults={"kind": "github_token", "secret": "ghp_bench", "api_url": "https://api.github.com"})
    webhook, _ = Webhook.objects.get_or_create(
        slug="bench-write-back", defaults={"owner": owner, "source": "github", "connection": github})
    delivery = DeliveryEvent.objects.create(webhook=webhook, trust="signed", source="github",
                                            kind="issues.opened", received_at=timezone.now())
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE todos_todo SET write_back = 'status', kind = 'issues.opened',"
            " delivery_event_id = %s, payload = jsonb_build_object('repository',"
            " jsonb_build_object('name', 'widgets', 'owner', jsonb_build_object('login', 'acme')),"
            " 'issue', jsonb_build_object('number', id)) WHERE endpoint_id = %s",
            [delivery.pk, Endpoint.objects.get(slug=WRITE_BACK_SLUG).pk])
        # Earlier runs' (the refill's TRUNCATE reaches neither: no constraint ties them).
        cursor.execute(f"DELETE FROM {OutboxEntry._meta.db_table}")
        cursor.execute(f"DELETE FROM {WriteBack._meta.db_table}")
        cursor.execute("SELECT pg_backend_pid()")
        backend = cursor.fetchone()[0]
    callers = {setting: transitions.Caller.agent(Endpoint.objects.get(slug=slug), "blocks")
               for setting, slug in (("a", SLUG), ("w", WRITE_BACK_SLUG))}
    absorbed = {"entries": 0, "seconds": 0.0, "pg": 0.0}

    def absorb(setting):
        if setting != "w":
            return
        pg_before, began = process_cpu_seconds(backend), time.perf_counter()
        while (taken := write_back.absorb_outbox_entries(now=timezone.now())):
            absorbed["entries"] += taken
        absorbed["seconds"] += time.perf_counter() - began
        absorbed["pg"] += process_cpu_seconds(backend) - pg_before

    load_before = os.getloadavg()
    wall, pg, own = alternating_blocks(callers, pairs, cycles, after_block=absorb)
    load_after = os.getloadavg()
    print_blocks("claim_next + complete, write-back off or status", {
        "a": "write-back off", "w": "write-back status (outbox entry + sender woken)"},
        wall, pg, own, pairs, cycles, (load_before[0], load_after[0]), ">= 0.90")
    entries = max(absorbed["entries"], 1)
    print(f"\nthe sender taking w's {absorbed['entries']} outbox entries into write-backs "
          f"(untimed above): {absorbed['seconds'] / entries * 1000:.3f} ms and "
          f"{absorbed['pg'] / entries * 1000:.3f} ms of PostgreSQL CPU per entry", flush=True)
    connection.close()


def pg_breakdown(todos: int, workers: int, rounds: int):
    """PostgreSQL CPU per cycle of the audited statements with one piece taken out at a time,
    beside the bare floor, interleaved like the main table: what the PG a/b gap is made of."""
    systems = {"bare SQL (b)": bare_worker}
    systems.update({variant: functools.partial(audited_variant_worker, variant)
                    for variant in AUDITED_VARIANTS})
    cpu = {name: [] for name in systems}
    for _ in range(rounds):
        for name, worker in systems.items():
            cpu[name].append(run_round(worker, lambda n: refill_todos(n), todos, workers)[1])
    median = {name: statistics.median(values) for name, values in cpu.items()}
    floor, audited = median["bare SQL (b)"], median["audited statements (d)"]
    print(f"\nPostgreSQL CPU per claim+complete cycle, {workers} workers: what d costs beyond "
          "b, one piece taken out at a time (diagnostic; no variant is a product path)\n")
    print("| statements | PG CPU/cycle | x bare | saved vs d |")
    print("| --- | --- | --- | --- |")
    for name, value in median.items():
        print(f"| {name} | {value * 1000:.3f} ms | {value / floor:.2f} "
              f"| {(audited - value) * 1000:+.3f} ms |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--todos", type=int, default=2000)
    parser.add_argument("--workers", default="1,4,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--history", default="10000,1000000", help="done rows for the latency runs")
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--max-claimed", type=int, default=None,
                        help="cap the bench endpoint's claimed todos (default: no cap)")
    parser.add_argument("--breakdown-workers", type=int, default=4,
                        help="workers for the PostgreSQL CPU breakdown (0: skip it)")
    parser.add_argument("--budget-blocks", type=int, default=24,
                        help="pairs of blocks for the budget guard's cost (0: skip it)")
    parser.add_argument("--block-cycles", type=int, default=100,
                        help="claim_next + complete cycles per budget block")
    parser.add_argument("--budget-control", action="store_true",
                        help="budget blocks with no budget on either endpoint: the noise floor")
    parser.add_argument("--write-back-blocks", type=int, default=24,
                        help="pairs of blocks for write-back's cost (0: skip it)")
    parser.add_argument("--systems", default="a,b,c,d,e",
                        help="which systems the throughput rounds run (letters, e.g. a,e)")
    args = parser.parse_args()
    chosen = {name: system for name, system in SYSTEMS.items()
              if name.split()[0] in args.systems.split(",")}

    prepare_switchboard_schema()
    if "c procrastinate" in chosen:
        prepare_procrastinate_schema()
    if args.max_claimed is not None or "max_claimed" in _endpoint_columns():
        with psycopg.connect(SB_DB, autocommit=True) as conn:
            conn.execute("UPDATE endpoints_endpoint SET max_claimed = %s WHERE slug IN (%s, %s)",
                         (args.max_claimed, SLUG, BUDGET_SLUG))
        print(f"# endpoint cap max_claimed = {args.max_claimed}")
    print(f"# bench/queue.py — {time.strftime('%Y-%m-%d %H:%M')} — {platform.node()}, "
          f"{os.cpu_count()} cores, Python {platform.python_version()}")
    with psycopg.connect(f"{PG}/postgres") as conn:
        print(f"# {conn.execute('SELECT version()').fetchone()[0].split(' on ')[0]}")
    if chosen:
        print(f"# {args.todos} todos per round, {args.rounds} interleaved rounds, median shown\n")
    full = all(name in chosen for name in list(SYSTEMS)[:4])
    if full:
        print("| workers | a switchboard | b bare SQL | c procrastinate | d audited SQL, psycopg "
              "only | a/d (target >= 0.9) | a/c (target >= 3 at 8) | a/b | PG CPU/cycle a, b, d "
              "| PG a/b (target <= 1.25) | a cycles/s per PG core | worker CPU/cycle a, d |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    # Printed as they come when the full table is not (a, e only), else after it.
    priority_rows = []
    compare = "a switchboard" in chosen and "e switchboard, mixed priorities" in chosen
    priority_header = (
        "\nclaim_next + complete with priorities in play, the same rounds (a: every todo "
        "at priority 0; e: mixed priorities -50…50)\n\n"
        "| workers | a switchboard | e switchboard, mixed priorities | e/a (target >= 0.9) |\n"
        "| --- | --- | --- | --- |")
    if compare and not full:
        print(priority_header, flush=True)
    for workers in [int(w) for w in args.workers.split(",")] if chosen else ():
        rates, pg_cpu, own_cpu = ({name: [] for name in chosen} for _ in range(3))
        for _ in range(args.rounds):
            for name, (worker, refill) in chosen.items():
                rate, cpu, own = run_round(worker, refill, args.todos, workers)
                rates[name].append(rate)
                pg_cpu[name].append(cpu)
                own_cpu[name].append(own)
        median = {name: statistics.median(rates[name]) for name in chosen}
        if full:
            a, b, c, d = (median[name] for name in list(SYSTEMS)[:4])
            pa, pb, _, pd = (statistics.median(pg_cpu[name]) for name in list(SYSTEMS)[:4])
            wa, _, _, wd = (statistics.median(own_cpu[name]) for name in list(SYSTEMS)[:4])
            print(f"| {workers} | {a:.0f}/s | {b:.0f}/s | {c:.0f}/s | {d:.0f}/s | {a / d:.2f} "
                  f"| {a / c:.2f} | {a / b:.2f} | {pa * 1000:.3f} / {pb * 1000:.3f} / "
                  f"{pd * 1000:.3f} ms | {pa / pb:.2f} | {1 / pa:.0f} "
                  f"| {wa * 1000:.3f} / {wd * 1000:.3f} ms |", flush=True)
        plain, mixed = median.get("a switchboard"), median.get("e switchboard, mixed priorities")
        if compare:
            row = f"| {workers} | {plain:.0f}/s | {mixed:.0f}/s | {mixed / plain:.2f} |"
            priority_rows.append(row)
            if not full:
                print(row, flush=True)
    if compare and full:
        print(priority_header)
        print("\n".join(priority_rows), flush=True)

    if args.breakdown_workers:
        pg_breakdown(args.todos, args.breakdown_workers, args.rounds)

    if args.budget_blocks:
        budget_blocks(args.budget_blocks, args.block_cycles, control=args.budget_control)

    if args.write_back_blocks:
        write_back_blocks(args.write_back_blocks, args.block_cycles)

    history = [int(n) for n in args.history.split(",") if n]
    if history:
        print("\n| done todos in table | pending todos' priorities | claim_next p50 | p99 |")
        print("| --- | --- | --- | --- |")
    results = {}
    for done_rows in history:
        for priorities in (False, True):
            p50, p99 = claim_latency(done_rows, args.samples, priorities=priorities)
            results[done_rows, priorities] = p50
            print(f"| {done_rows:,} | {'mixed' if priorities else 'all 0'} | {p50:.2f} ms "
                  f"| {p99:.2f} ms |", flush=True)
    sizes = sorted({size for size, _ in results})
    if len(sizes) >= 2:
        for priorities in (False, True):
            print(f"\np50 ratio {sizes[-1]:,} / {sizes[0]:,} done rows, "
                  f"{'mixed priorities' if priorities else 'priority 0'}: "
                  f"{results[sizes[-1], priorities] / results[sizes[0], priorities]:.2f} "
                  "(target <= 1.5)")


if __name__ == "__main__":
    main()
