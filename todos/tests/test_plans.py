"""The claim path, the reaper and the promoter use their partial indexes (PostgreSQL plans).

A multi-queue claim written as ``queue = ANY(…) ORDER BY created_at`` cannot use an index's
order and measured 6-8x slower; these tests pin the plans so a refactor cannot bring it back.
"""

import pytest
from django.db import connection
from django.utils import timezone

from tests.factories import EndpointFactory, UserFactory
from todos import transitions
from todos.models import Todo

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
    Todo.objects.bulk_create(
        Todo(endpoint=endpoint, queue=f"q{i % 4}", title="t", state=states[i % 10],
             lease_expires_at=now, created_at=now, updated_at=now)
        for i in range(5000)
    )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE todos_todo")
    return endpoint


def plan(sql, params):
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in cursor.fetchall())


def test_claim_next_over_several_queues_probes_each_queue_by_index(backlog):
    params = {"endpoint_id": backlog.pk}
    text = plan(transitions.claim_candidate_sql(params, ["q0", "q1", "q2"]), params)
    assert "todo_claim_by_queue" in text, text
    assert "Seq Scan on todos_todo" not in text, text


def test_claim_next_over_all_queues_scans_in_index_order(backlog):
    params = {"endpoint_id": backlog.pk}
    text = plan(transitions.claim_candidate_sql(params, None), params)
    assert "todo_claim_any_queue" in text, text
    assert "Sort" not in text, text


@pytest.mark.parametrize("sql, index", [
    (transitions.lapsed_leases_sql, "todo_reaper"),
    (transitions.due_retries_sql, "todo_retry_promoter"),
])
def test_sweeps_use_their_partial_index(backlog, sql, index):
    text = plan(sql(), {"now": timezone.now(), "limit": 500})
    assert index in text, text
