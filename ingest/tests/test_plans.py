"""The write-back sender's claim walks the due index (PostgreSQL plans), as the queue's claims
do theirs (todos/tests/test_plans.py): the outbox keeps a row per todo and action for as long
as retention keeps the todo, nearly all of them sent, so a claim that scanned the table would
grow with history."""

from datetime import timedelta

import pytest
from django.db import connection as db
from django.utils import timezone

from ingest import connections, write_back
from ingest.models import WriteBack
from tests import plans
from tests.factories import EndpointFactory, UserFactory
from todos.models import Todo

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif("db.vendor != 'postgresql'",
                       reason="query plans are PostgreSQL's; SQLite runs the same SQL unplanned"),
]


@pytest.fixture
def outbox(github):
    owner = UserFactory()
    endpoint = EndpointFactory(owner=owner)
    held, free = (connections.create_connection(
        name=name, owner=owner, kind="github_token", secret=github.token,
        api_url=github.api_url)[0] for name in ("held", "free"))
    now = timezone.now()
    todos = Todo.objects.bulk_create(
        Todo(endpoint=endpoint, queue="q", title="t", state="done", created_at=now,
             updated_at=now) for _ in range(2500))
    # Nearly all sent; some waiting, some due, and a held connection's rows due at its hold.
    states = ["sent"] * 18 + ["pending", "failed"]
    WriteBack.objects.bulk_create(
        WriteBack(todo=todo, connection=held if i % 3 == 0 else free, action=action,
                  state=states[(i * 2 + j) % 20], created_at=now,
                  next_attempt_at=now + timedelta(seconds=(i % 7) * 10 - 30))
        for i, todo in enumerate(todos) for j, action in enumerate(("ack", "status")))
    write_back.hold_connection(held.pk, until=now + timedelta(minutes=1))
    with db.cursor() as cursor:
        plans.analyze_every_table(cursor)
    return now


def test_the_claim_walks_the_due_index_and_checks_the_hold_per_row(outbox):
    params = {"now": outbox, "until": outbox + write_back.SEND_LEASE}
    with db.cursor() as cursor:
        cursor.execute("EXPLAIN " + write_back.claim_due_sql(), params)
        text = "\n".join(row[0] for row in cursor.fetchall())
    assert "writeback_due" in text, text
    assert "Seq Scan on ingest_writeback" not in text, text
    assert "Sort" not in text, text  # due order comes off the index
    # The todo's other rows by the (todo, action) key, never a scan of the outbox.
    assert "writeback_todo_action" in text, text
