"""How /metrics' scrape-time queries grow with history (not a test; prints numbers).

    DATABASE_URL=postgres://…/scratch python bench/metrics_scrape.py [--rows 1000000]

Fills a scratch database (migrated here; its todo tables are emptied first) with N todos, 90 %
done, each with three events written an hour ago, plus 1,000 recent events, then times, side by
side: the naive full GROUP BYs against what /metrics runs (the per-endpoint backlog probe and
the incremental event tally in its steady state), and a primary-key probe as the yardstick.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "switchboard.settings_test")


def timed(fn, repeat=5):
    fn()  # warm
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000)
    rows = parser.parse_args().rows
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    from django.db.models import Count

    from console import metrics
    from todos import queries
    from todos.models import Todo

    if connection.vendor != "postgresql":
        sys.exit("run against PostgreSQL")
    call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE todos_todoevent, todos_todo CASCADE")
        cursor.execute("INSERT INTO auth_user (username, password, is_superuser, first_name, last_name, "
                       "email, is_staff, is_active, date_joined) VALUES ('bench', '', false, '', '', '', "
                       "false, true, now()) ON CONFLICT DO NOTHING")
        # Endpoints through the ORM: their columns grow with features (presence added NOT NULL
        # ones), and ten rows cost nothing; the todos below stay raw SQL for speed.
        from django.contrib.auth import get_user_model

        from endpoints.models import Endpoint

        owner = get_user_model().objects.get(username="bench")
        for number in range(1, 11):
            Endpoint.objects.get_or_create(slug=f"bench-{number}",
                                           defaults={"owner": owner, "scope": ["*"]})
        cursor.execute(
            "INSERT INTO todos_todo (endpoint_id, queue, state, title, kind, source, payload, trust, "
            "attempts, max_attempts, created_at, updated_at, ring_attempts) "
            "SELECT (SELECT min(id) FROM endpoints_endpoint WHERE slug LIKE 'bench-%%') + g %% 10, "
            "'q' || (g %% 4), CASE WHEN g %% 10 = 0 THEN 'pending' ELSE 'done' END, 't', '', '', "
            "'{}', 'signed', 1, 5, now(), now(), 0 FROM generate_series(1, %s) g", [rows])
        cursor.execute(
            "INSERT INTO todos_todoevent (todo_id, action, from_state, to_state, actor, at, detail) "
            "SELECT t.id, a.action, NULL, a.to_state, 'bench', now() - interval '1 hour', '{}' FROM todos_todo t "
            "CROSS JOIN (VALUES ('create', 'pending'), ('claim', 'claimed'), ('complete', 'done')) "
            "AS a(action, to_state)")
        cursor.execute(
            "INSERT INTO todos_todoevent (todo_id, action, from_state, to_state, actor, at, detail) "
            "SELECT id, 'heartbeat', 'claimed', 'claimed', 'bench', now(), '{}' FROM todos_todo "
            "ORDER BY id LIMIT 1000")
    connection.close()
    with connection.cursor() as cursor:  # VACUUM cannot run inside a transaction block
        cursor.execute("VACUUM ANALYZE todos_todo")
        cursor.execute("VACUUM ANALYZE todos_todoevent")

    def probe():
        with connection.cursor() as cursor:
            cursor.execute("SELECT id FROM todos_todo WHERE id = (SELECT min(id) FROM todos_todo)")

    def naive_by_state():
        list(Todo.objects.values_list("endpoint__slug", "queue", "state").annotate(n=Count("id")).order_by())

    tally = metrics.EventTally()
    tally.counts()  # the first scrape of a process counts everything once
    results = [
        ("todos: naive GROUP BY, all states", timed(naive_by_state)),
        ("todos: backlog probe (/metrics)", timed(queries.count_backlog_by_queue)),
        ("events: naive GROUP BY", timed(queries.count_todo_events)),
        ("events: tally, steady state (/metrics)", timed(tally.counts)),
        ("primary-key probe", timed(probe)),
    ]
    baseline = results[-1][1]
    print(f"todos={rows} (10 % pending) events={rows * 3 + 1000}")
    for label, seconds in results:
        print(f"  {label:40s} {seconds * 1000:9.2f} ms  {seconds / baseline:9,.0f}x the PK probe")


if __name__ == "__main__":
    main()
