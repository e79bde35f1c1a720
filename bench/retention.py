"""Retention on PostgreSQL: prune a large history while agents keep draining
(docs/operating.md#retention).

    bench/.venv/bin/python bench/retention.py [--done 1000000] [--events-per-todo 3]
        [--pending 4000] [--workers 4]

Fixture (database sb_bench_retention, created and migrated when missing): ``--done`` done todos
of which 80 % are past SWITCHBOARD_RETAIN_DONE_DAYS (30), each with ``--events-per-todo`` audit
events (1M todos → 3M events), 1,000 dead letters past retention (kept: dead-letter retention is
off), and ``--pending`` pending todos that ``--workers`` agent processes drain with switchboard's
own transitions (claim_next + complete).

Two phases, side by side in one run: the agents drain with no prune running, then drain again
while ``manage.py prune``'s function deletes the old history in its bounded batches. Printed:
claim_next p50/p99 in each phase and their ratio (a claim must never wait behind more than one
batch), the prune's rows and rows/s, and a check that exactly the rows past retention went.
"""

import sys

# Run as a script, this folder would be first on the import path, and bench/queue.py would
# shadow the standard library's queue module that psycopg and multiprocessing use.
sys.path = [p for p in sys.path if p not in ("", __file__.rsplit("/", 1)[0])]

import argparse  # noqa: E402
import multiprocessing as mp  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import psycopg  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# Production settings need a secrets key of their own; a bench-only one.
os.environ.setdefault("SWITCHBOARD_SECRETS_KEY", "c3dpdGNoYm9hcmQtYmVuY2gtb25seS1zZWNyZXRzISE=")
PG = os.environ.get("BENCH_PG", "postgres://postgres@127.0.0.1:5432").rstrip("/")
DB_NAME = "sb_bench_retention"
DB = f"{PG}/{DB_NAME}"
SLUG = "retention-bench"
RETAIN_DONE_DAYS = 30


def django_env() -> dict:
    env = dict(os.environ, DATABASE_URL=DB, DJANGO_SETTINGS_MODULE="switchboard.settings",
               SWITCHBOARD_RETAIN_DONE_DAYS=str(RETAIN_DONE_DAYS))
    env.pop("REDIS_URL", None)  # no board publishing: the database is what is measured
    return env


def prepare_schema():
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB_NAME,)).fetchone():
            conn.execute(f'CREATE DATABASE "{DB_NAME}"')
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=django_env(),
                   check=True)
    script = (
        "import django; django.setup()\n"
        "from django.contrib.auth.models import User\n"
        "from endpoints import transitions\n"
        "from endpoints.models import Endpoint\n"
        "owner, _ = User.objects.get_or_create(username='bench')\n"
        f"Endpoint.objects.filter(slug='{SLUG}').exists() or transitions.vend_endpoint("
        f"slug='{SLUG}', owner=owner, scope=['*'])\n"
    )
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=django_env(), check=True)


def build_history(done: int, events_per_todo: int, dead: int):
    """Fresh history: ``done`` done todos (80 % old), their events, ``dead`` old dead letters."""
    with psycopg.connect(DB, autocommit=True) as conn:
        ep = conn.execute("SELECT id FROM endpoints_endpoint WHERE slug = %s", (SLUG,)).fetchone()[0]
        conn.execute("TRUNCATE todos_todoevent, todos_todo, todos_prunedeventtally, "
                     "ingest_operatorsecret CASCADE")
        old = int(done * 0.8)
        # Old ones 31..90 days ago, recent ones within the last 29 days.
        conn.execute(
            "INSERT INTO todos_todo (endpoint_id, queue, state, title, kind, source, payload, "
            "trust, attempts, max_attempts, created_at, updated_at, ring_attempts) "
            "SELECT %s, 'inbox', 'done', 'history', '', 'bench', '{}', 'signed', 1, 5, t, t, 0 "
            "FROM (SELECT g, CASE WHEN g <= %s "
            "  THEN now() - make_interval(days => 31 + g %% 60) "
            "  ELSE now() - make_interval(days => g %% 29, secs => 1) END AS t "
            "  FROM generate_series(1, %s) g) s",
            (ep, old, done),
        )
        conn.execute(
            "INSERT INTO todos_todo (endpoint_id, queue, state, title, kind, source, payload, "
            "trust, attempts, max_attempts, created_at, updated_at, dead_lettered_at, "
            "ring_attempts) SELECT %s, 'inbox', 'failed', 'dead', '', 'bench', '{}', 'signed', "
            "5, 5, now() - interval '60 days', now() - interval '60 days', "
            "now() - interval '60 days', 0 FROM generate_series(1, %s)",
            (ep, dead),
        )
        actions = ["create", "claim", "complete", "heartbeat", "heartbeat"][:events_per_todo]
        for n, action in enumerate(actions):
            conn.execute(
                "INSERT INTO todos_todoevent (todo_id, action, from_state, to_state, actor, at, "
                "detail) SELECT id, %s, NULL, %s, 'bench', updated_at, '{}' FROM todos_todo",
                (action, "done" if action == "complete" else "pending"),
            )
        conn.execute("VACUUM ANALYZE todos_todo")
        conn.execute("VACUUM ANALYZE todos_todoevent")
        conn.execute("CHECKPOINT")


def add_pending(count: int):
    with psycopg.connect(DB, autocommit=True) as conn:
        ep = conn.execute("SELECT id FROM endpoints_endpoint WHERE slug = %s", (SLUG,)).fetchone()[0]
        conn.execute(
            "INSERT INTO todos_todo (endpoint_id, queue, state, title, kind, source, payload, "
            "trust, attempts, max_attempts, created_at, updated_at, ring_attempts) "
            "SELECT %s, 'inbox', 'pending', 'work', '', 'bench', '{}', 'signed', 0, 5, "
            "now() + make_interval(secs => g), now(), 0 FROM generate_series(1, %s) g",
            (ep, count),
        )


def agent_worker(ready, start, results):
    """Drain with switchboard's transitions, timing every claim_next."""
    os.environ.update(django_env())
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
    timings = []
    while True:
        began = time.perf_counter()
        todo = transitions.claim_next_todo(caller)
        timings.append(time.perf_counter() - began)
        if todo is None:
            break
        transitions.complete_todo(caller, todo.pk, lease_id=todo.lease_id)
    results.put(timings[5:])  # the first calls prepare statements


def prune_worker(ready, start, results):
    os.environ.update(django_env())
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from ingest import sweeps

    ready.put(os.getpid())
    start.wait()
    began = time.perf_counter()
    pruned = sweeps.prune_history()
    results.put((pruned, time.perf_counter() - began))


def drain(workers: int, with_prune: bool):
    ctx = mp.get_context("spawn")
    ready, start, results, prune_results = ctx.Queue(), ctx.Event(), ctx.Queue(), ctx.Queue()
    processes = [ctx.Process(target=agent_worker, args=(ready, start, results))
                 for _ in range(workers)]
    if with_prune:
        processes.append(ctx.Process(target=prune_worker, args=(ready, start, prune_results)))
    for process in processes:
        process.start()
    for _ in processes:
        ready.get(timeout=120)
    time.sleep(0.2)
    start.set()
    timings = []
    for _ in range(workers):
        timings += results.get(timeout=1800)
    prune = prune_results.get(timeout=1800) if with_prune else None
    for process in processes:
        process.join(timeout=60)
    timings.sort()
    return (statistics.median(timings) * 1000, timings[int(len(timings) * 0.99)] * 1000,
            len(timings), prune)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--done", type=int, default=1_000_000)
    parser.add_argument("--events-per-todo", type=int, default=3)
    parser.add_argument("--dead", type=int, default=1000)
    parser.add_argument("--pending", type=int, default=4000)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()

    prepare_schema()
    print(f"building history: {args.done} done todos, {args.done * args.events_per_todo} "
          f"events, {args.dead} dead letters", flush=True)
    build_history(args.done, args.events_per_todo, args.dead)
    with psycopg.connect(DB, autocommit=True) as conn:
        before = dict(conn.execute(
            "SELECT CASE WHEN state = 'done' AND updated_at < now() - make_interval(days => %s) "
            "THEN 'old_done' WHEN state = 'done' THEN 'recent_done' ELSE state END, count(*) "
            "FROM todos_todo GROUP BY 1", (RETAIN_DONE_DAYS,)).fetchall())
        events_before = conn.execute("SELECT count(*) FROM todos_todoevent").fetchone()[0]

    add_pending(args.pending)
    quiet = drain(args.workers, with_prune=False)
    add_pending(args.pending)
    busy = drain(args.workers, with_prune=True)
    pruned, prune_seconds = busy[3]

    with psycopg.connect(DB, autocommit=True) as conn:
        after = dict(conn.execute(
            "SELECT CASE WHEN state = 'done' AND updated_at < now() - make_interval(days => %s) "
            "THEN 'old_done' WHEN state = 'done' THEN 'recent_done' ELSE state END, count(*) "
            "FROM todos_todo WHERE title <> 'work' GROUP BY 1", (RETAIN_DONE_DAYS,)).fetchall())
        events_after = conn.execute(
            "SELECT count(*) FROM todos_todoevent e JOIN todos_todo t ON t.id = e.todo_id "
            "WHERE t.title <> 'work'").fetchone()[0]
    exact = (pruned["done_todos"] == before.get("old_done", 0)
             and after.get("old_done", 0) == 0
             and after.get("recent_done", 0) == before.get("recent_done", 0)
             and after.get("failed", 0) == before.get("failed", 0)
             and events_after == events_before - pruned["todo_events"]
             and pruned["todo_events"] == before.get("old_done", 0) * args.events_per_todo)

    print(f"claim_next while draining ({args.workers} agents, {quiet[2]} / {busy[2]} claims):")
    print(f"  without prune: p50 {quiet[0]:.2f} ms, p99 {quiet[1]:.2f} ms")
    print(f"  with prune:    p50 {busy[0]:.2f} ms, p99 {busy[1]:.2f} ms")
    print(f"prune: {pruned['done_todos']} todos + {pruned['todo_events']} events in "
          f"{prune_seconds:.1f} s ({(pruned['done_todos'] + pruned['todo_events']) / prune_seconds:.0f} "
          f"rows/s, batches of 1000); dead letters kept: {after.get('failed', 0)}")
    print(f"exactly the rows past retention pruned: {'yes' if exact else 'NO'} "
          f"(before {before}, after {after})")
    print(f"ratio claim p99 with/without prune: {busy[1] / quiet[1]:.2f}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
