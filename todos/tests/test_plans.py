"""The claim path, the reaper and the promoter use their partial indexes (PostgreSQL plans).

A multi-queue claim written as ``queue = ANY(…) ORDER BY created_at`` cannot use an index's
order and measured 6-8x slower; these tests pin the plans so a refactor cannot bring it back.
"""

from datetime import timedelta
from decimal import Decimal

import pytest

from django.db import connection
from django.utils import timezone

from tests import plans
from tests.factories import EndpointFactory, UserFactory
from todos import statements, transitions, usage
from todos.models import DailySpend, Todo

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif("connection.vendor != 'postgresql'",
                       reason="query plans are PostgreSQL's; SQLite runs the same SQL unplanned"),
]


@pytest.fixture
def backlog():
    endpoint = EndpointFactory(owner=UserFactory(), scope=["q0", "q1", "q2", "q3"])
    now = timezone.now()
    states = ["done"] * 8 + ["pending", "claimed"]
    # Mostly from signed senders, some anonymous: the mix a verified-only claim filters.
    trusts = ["signed", "signed", "operator", "unverified"]
    # Mixed priorities, and some pending todos scheduled for later: the claim order is
    # priority first, and scheduled todos are outside the claim indexes.
    Todo.objects.bulk_create(
        Todo(endpoint=endpoint, queue=f"q{i % 4}", title="t", state=states[i % 10],
             trust=trusts[(i // 10) % 4], lease_expires_at=now, created_at=now, updated_at=now,
             priority=(i % 7) * 10 - 30,
             not_before=now + timedelta(hours=1) if i % 30 == 8 else None)
        for i in range(5000)
    )
    with connection.cursor() as cursor:
        plans.analyze_every_table(cursor)
    return endpoint


def plan(sql, params):
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in cursor.fetchall())


# hide_unverified: an endpoint that refuses unverified todos, or claim_next's verified_only.
@pytest.mark.parametrize("hide_unverified", [False, True])
def test_claim_next_over_several_queues_probes_each_queue_by_index(backlog, hide_unverified):
    params = {"endpoint_id": backlog.pk}
    text = plan(statements.claim_candidate_sql(params, ["q0", "q1", "q2"],
                                                hide_unverified=hide_unverified), params)
    assert "todo_claim_by_queue" in text, text
    assert "Seq Scan on todos_todo" not in text, text
    # Each queue's head comes straight off the index in (priority DESC, created_at, id) order:
    # only the few heads are sorted, never a queue's rows.
    assert text.count("Sort  (") <= 1 and "Incremental Sort" not in text, text


@pytest.mark.parametrize("hide_unverified", [False, True])
def test_claim_next_over_all_queues_scans_in_index_order(backlog, hide_unverified):
    params = {"endpoint_id": backlog.pk}
    text = plan(statements.claim_candidate_sql(params, None, hide_unverified=hide_unverified),
                params)
    assert "todo_claim_any_queue" in text, text
    assert "Sort" not in text, text


@pytest.mark.parametrize("sql, index", [
    (statements.lapsed_leases_sql, "todo_reaper"),
    (statements.due_retries_sql, "todo_retry_promoter"),
    (statements.due_scheduled_sql, "todo_scheduled_due"),
])
def test_sweeps_use_their_partial_index(backlog, sql, index):
    text = plan(sql(), {"now": timezone.now(), "limit": 500})
    assert index in text, text


@pytest.fixture
def nothing_claimed_when_analyzed():
    """The statistics a busy table usually has: its sample holds no claimed row (few are claimed
    at any moment), so the planner costs the "claimed" range of todo_by_state and todo_reaper
    at under one row, although that range keeps an entry for every lease ended since the last
    vacuum."""
    endpoint = EndpointFactory(owner=UserFactory(), scope=["q0", "q1", "q2", "q3"])
    now = timezone.now()
    Todo.objects.bulk_create(
        Todo(endpoint=endpoint, queue=f"q{i % 4}", title="t", state="done" if i % 2 else "pending",
             created_at=now, updated_at=now)
        for i in range(5000)
    )
    with connection.cursor() as cursor:
        plans.analyze_every_table(cursor)
    return endpoint


def index_scans(*names) -> dict:
    """Index scans this transaction has made so far, by index name."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT i, pg_stat_get_xact_numscans(i::regclass) FROM unnest(%s::text[]) i",
                       [list(names)])
        return dict(cursor.fetchall())


def test_fenced_verbs_find_their_todo_by_primary_key(nothing_claimed_when_analyzed):
    caller = transitions.Caller.agent(nothing_claimed_when_analyzed, "session-1")
    todo = transitions.claim_next_todo(caller)
    names = ("todos_todo_pkey", "todo_by_state", "todo_reaper")
    before = index_scans(*names)
    transitions.heartbeat_todo(caller, todo.pk, lease_id=todo.lease_id)
    transitions.complete_todo(caller, todo.pk, lease_id=todo.lease_id)
    after = index_scans(*names)
    used = {name: after[name] - before[name] for name in names}
    # Three: the heartbeat's statement also reads its row's follow-up mark under lock first.
    assert used == {"todos_todo_pkey": 3, "todo_by_state": 0, "todo_reaper": 0}, used


# A claim holds its todo by an advisory lock taken in todo_claim_hold, which must run only on
# rows in claim order, after the sort, stopping at the first it holds. Pushed below the sort
# into a sequential scan's filter (the plan PostgreSQL chose for one capped endpoint's
# thousands of pending todos once they were analyzed), it ran on every pending row: the claim
# held all of them until it committed, so every other claimer found nothing to claim, and each
# claim cost a lock per row (measured: a 16-thread cap test ran >15x slower and timed out).
# A daily budget adds its guard to the same statement: it must not bring the hold back below
# the sort either.
@pytest.mark.parametrize("limits", [
    {}, {"max_claimed": 3}, {"queue_limits": {"q0": 2}},
    {"budget_usd_per_day": Decimal("5")},
    {"budget_tokens_per_day": 10**6, "max_claimed": 3},
], ids=["uncapped", "max_claimed", "queue_limits", "budgeted", "budgeted_max_claimed"])
@pytest.mark.parametrize("queues", [None, ["q0", "q1"]], ids=["all_queues", "listed_queues"])
def test_a_claim_holds_only_the_todo_it_claims_whatever_plan_reads_the_candidates(limits, queues):
    from django.db import transaction

    # No scope: a scoped caller's claim_next reads its granted queues as listed ones.
    endpoint = EndpointFactory(owner=UserFactory(), **limits)
    now = timezone.now()
    Todo.objects.bulk_create(
        Todo(endpoint=endpoint, queue=f"q{i % 2}", title="t", created_at=now, updated_at=now)
        for i in range(2000)
    )
    if endpoint.has_budget:
        # Spent today, under the budget: the guard's probe finds a row.
        DailySpend.objects.create(endpoint=endpoint, day=usage.spend_day(now),
                                  cost_microusd=1_000_000, tokens=5000)
    with connection.cursor() as cursor:
        plans.analyze_every_table(cursor)
    caller = transitions.Caller.agent(endpoint, "session-1")
    with transaction.atomic():
        with connection.cursor() as cursor:
            # The plan that pushed the lock into the scan: no index to read in claim order.
            cursor.execute("SET LOCAL enable_indexscan = off")
            cursor.execute("SET LOCAL enable_bitmapscan = off")
        todo = transitions.claim_next_todo(caller, queues=queues)
        with connection.cursor() as cursor:
            # Claim holds use the two-integer key space (objsubid 2); the cap lock is a bigint.
            cursor.execute("SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid()"
                           " AND locktype = 'advisory' AND objsubid = 2")
            held = cursor.fetchone()[0]
    assert todo is not None
    # Over listed queues each queue's head is held, and the best of them claimed.
    most = 1 if queues is None else len(queues)
    assert held <= most, f"the claim held {held} todos' claim locks"
