"""A one-route delivery on PostgreSQL is ONE autocommit statement (issue 17): its delivery
event, replay-ledger entry, log record, todo and todo event, or nothing at all. These tests run
outside the test transaction (``transaction=True``), as production does, and race real threads
on their own connections: whatever the statement cannot decide on its own (a duplicate, a
replay) it leaves to the transaction path, with nothing of its own kept."""

import contextlib
import re
import tempfile
import threading
import time
from collections import Counter

import psycopg
import pytest
from django.db import connection, connections
from django.db.backends.signals import connection_created
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from psycopg import _queries as psycopg_queries

from channels_push.bus import publish
from ingest import transitions
from ingest.models import Connection, DeliveryEvent, DeliveryRecord, ReplayLedgerEntry
from tests.processes import DEADLINE_SECONDS
from todos import statements as todo_statements
from todos import transitions as todo_transitions
from todos.models import Todo, TodoEvent

from . import signing
from .conftest import SECRETS
from .test_views import ISSUE, numbered_issue, deliver, post_hook

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "postgresql",
                       reason="SQLite has no data-modifying CTEs: it keeps the transaction path"),
]

THREADS = 12


@pytest.fixture(autouse=True)
def generous_rate_limits(settings):
    # Repeats are charged to the sender's address (§12): not what these tests are about.
    settings.SWITCHBOARD_INGEST_RATE_PER_MINUTE = 10_000
    settings.SWITCHBOARD_INGEST_FAILURES_PER_MINUTE = 10_000


def github_post(webhook, body, delivery):
    return post_hook(webhook.slug, body, signing.github(SECRETS["github"], body, delivery=delivery))


def run_threads(count, target):
    barrier = threading.Barrier(count)
    results, errors = [None] * count, []

    def run(i):
        try:
            barrier.wait(timeout=DEADLINE_SECONDS)
            results[i] = target(i)
        except BaseException as exc:  # surface a thread's failure in the test
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a delivery hung"
    assert not errors, errors
    return results


def test_one_route_delivery_is_two_statements_in_autocommit(make_webhook):
    webhook = make_webhook("github")
    assert github_post(webhook, signing.body_of(ISSUE), "warm-up").status_code == 202
    body = signing.body_of(numbered_issue(2))
    with CaptureQueriesContext(connection) as captured:
        answer = github_post(webhook, body, "d-2")
    assert answer.status_code == 202 and answer.json()["todos"][0]["duplicate"] is False
    sql = [query["sql"] for query in captured.captured_queries]
    # The webhook lookup, then the delivery: no BEGIN, no COMMIT, one round trip for the
    # writes; then, after commit, the doorbell's fresh read of the endpoint.
    assert len(sql) == 3, sql
    assert all(table in sql[1] for table in ("ingest_deliveryevent", "ingest_replayledgerentry",
                                             "ingest_deliveryrecord", "todos_todo",
                                             "todos_todoevent"))
    assert sql[2].startswith("SELECT") and "endpoints_endpoint" in sql[2]
    todo = Todo.objects.get(pk=answer.json()["todos"][0]["id"])
    record = DeliveryRecord.objects.get(delivery_event_id=todo.delivery_event_id)
    assert (record.outcome, record.status, record.delivery_id) == ("accepted", 202, "d-2")
    assert list(TodoEvent.objects.filter(todo=todo).values_list("action", "detail")) == [
        ("create", {"delivery_event": todo.delivery_event_id})]
    assert ReplayLedgerEntry.objects.filter(delivery_event_id=todo.delivery_event_id).count() == 1


@pytest.mark.parametrize("source, writes_back", [("github", False), ("unsigned", False),
                                                 ("github", True)])
def test_the_delivery_statement_stays_within_what_psycopg_caches_the_parse_of(
        make_webhook, monkeypatch, operator, source, writes_back):
    """psycopg parses a statement's text once and caches it only up to a length and a number
    of parameters; past either, every delivery pays for the parse again (most of what
    write-back first added to a delivery's daphne CPU). With and without the ledger (a signed
    webhook, an unsigned one) and the outbox entry (a webhook with a connection), as the hook
    sends it."""
    webhook = make_webhook(source)
    if writes_back:
        webhook.connection = Connection.objects.create(
            name="ours", owner=operator, kind="github_token", secret="ghp_test",
            api_url="https://api.github.com", identity="switchboard-bot")
        webhook.save(update_fields=["connection"])
    executed = []

    def fetch_rows(sql, params):
        executed.append((sql, params))
        return real_fetch_rows(sql, params)

    real_fetch_rows = transitions.statements.fetch_rows
    monkeypatch.setattr(transitions.statements, "fetch_rows", fetch_rows)
    assert deliver(webhook).status_code == 202
    [(sql, params)] = [(sql, params) for sql, params in executed if "todos_todo" in sql]
    assert ("todos_outboxentry" in sql) is writes_back
    assert len(sql.encode()) <= psycopg_queries.MAX_CACHED_STATEMENT_LENGTH, len(sql.encode())
    assert len(params) <= psycopg_queries.MAX_CACHED_STATEMENT_PARAMS, sorted(params)


@pytest.mark.parametrize("source", ["linear", "slack", "sentry"])
def test_the_new_senders_take_the_same_one_statement(make_webhook, source):
    """Linear, Slack and Sentry answer inside their senders' deadlines because their hook waits
    on nothing but the delivery's own statement, as every other source's does."""
    webhook = make_webhook(source)

    def body(n):
        payload = {"type": "Issue", "action": "create", "event_id": f"Ev{n}", "n": n,
                   "data": {"identifier": f"ENG-{n}", "title": "Fix login"}}
        return (signing.linear_body(payload) if source == "linear"
                else signing.body_of(payload))

    warm = body(1)
    assert post_hook(webhook.slug, warm, signing.SIGNERS[source](SECRETS[source], warm)
                     ).status_code == 202
    measured = body(2)
    meta = signing.SIGNERS[source](SECRETS[source], measured)
    with CaptureQueriesContext(connection) as captured:
        answer = post_hook(webhook.slug, measured, meta)
    assert answer.status_code == 202 and answer.json()["todos"][0]["duplicate"] is False
    sql = [query["sql"] for query in captured.captured_queries]
    assert len(sql) == 3, sql
    assert all(table in sql[1] for table in ("ingest_deliveryevent", "ingest_replayledgerentry",
                                             "ingest_deliveryrecord", "todos_todo"))


def test_the_todo_is_announced_only_once_another_connection_can_read_it(make_webhook):
    """After-commit publishing still means after commit: the listener runs when the row is
    durable, seen here from a connection of its own."""
    webhook = make_webhook("github")
    settings_dict = connection.settings_dict
    seen = []

    def listener(todo, change):
        with psycopg.connect(dbname=settings_dict["NAME"], user=settings_dict["USER"],
                             password=settings_dict["PASSWORD"], host=settings_dict["HOST"],
                             port=settings_dict["PORT"] or None, autocommit=True) as other:
            (count,) = other.execute("SELECT count(*) FROM todos_todo WHERE id = %s",
                                     (todo.pk,)).fetchone()
        seen.append((change["action"], count))

    publish.add_listener(listener)
    try:
        assert github_post(webhook, signing.body_of(ISSUE), "d-1").status_code == 202
    finally:
        publish.remove_listener(listener)
    assert seen == [("create", 1)]


def test_a_redelivery_falls_back_and_keeps_nothing_of_its_own(make_webhook):
    webhook = make_webhook("github")
    body = signing.body_of(ISSUE)
    first = github_post(webhook, body, "d-1")
    again = github_post(webhook, body, "d-1")
    assert again.status_code == 202
    assert again.json()["todos"] == [{**first.json()["todos"][0], "duplicate": True}]
    # The statement saw the key taken and wrote nothing; the transaction path then answered
    # the duplicate and kept only its log line.
    assert Todo.objects.count() == 1 and TodoEvent.objects.count() == 1
    assert DeliveryEvent.objects.count() == 1
    assert ReplayLedgerEntry.objects.count() == 1
    assert sorted(DeliveryRecord.objects.values_list("outcome", flat=True)) == [
        "accepted", "duplicate"]


@contextlib.contextmanager
def errors_answered_by_postgresql():
    """The SQLSTATE of every error PostgreSQL answered to the connections this thread checks
    out while the block runs: what PostgreSQL's own log records as ERROR lines. Read from
    libpq's trace of each connection's protocol (one file each: libpq buffers its writes)."""
    traces, errors = [], []

    def trace(sender, connection, **kwargs):
        trace_file = tempfile.TemporaryFile()
        pgconn = connection.connection.pgconn
        pgconn.trace(trace_file.fileno())
        traces.append((pgconn, trace_file))

    connection.close()  # each request checks a connection out of the pool: traced from here
    connection_created.connect(trace)
    try:
        yield errors
    finally:
        connection_created.disconnect(trace)
        for pgconn, trace_file in traces:
            pgconn.untrace()  # flushes the trace
            trace_file.seek(0)
            errors += re.findall(r'\tErrorResponse\t.* C "(\w+)"',
                                 trace_file.read().decode(errors="replace"))
            trace_file.close()
        connection.close()


def test_the_error_trace_sees_what_postgresql_refuses(make_webhook):
    # The helper below is what the next test stands on: it must see an ERROR when there is one.
    with errors_answered_by_postgresql() as errors:
        with pytest.raises(Exception), connection.cursor() as cursor:
            cursor.execute("SELECT 1 / 0")
    assert errors == ["22012"]


@pytest.mark.parametrize("source", ["github", "stripe"])
def test_a_redelivery_or_a_replay_is_seen_before_anything_is_written(make_webhook, source):
    """A sender's redelivery (its todo still live) and a replay (the fingerprint held under
    another delivery id), or an exact repeat of a timestamped delivery, are the ordinary ways
    a delivery creates nothing. The statement sees them as it starts and writes nothing, so
    no statement fails: PostgreSQL logs no ERROR (the fallback's division by zero is for the
    race alone, above) and nothing is written twice."""
    webhook = make_webhook(source)
    body = signing.body_of(ISSUE)
    if source == "github":
        first_meta = signing.github(SECRETS["github"], body, delivery="d-1")
        repeats = [(first_meta, 202), (signing.github(SECRETS["github"], body, delivery="d-2"), 409)]
    else:
        first_meta = signing.stripe(SECRETS["stripe"], body)
        repeats = [(first_meta, 202)]  # the same signed request again: a duplicate
    first = post_hook(webhook.slug, body, first_meta)
    assert first.status_code == 202
    with errors_answered_by_postgresql() as errors:
        answers = [post_hook(webhook.slug, body, meta) for meta, _ in repeats]
    assert [answer.status_code for answer in answers] == [status for _, status in repeats]
    assert answers[0].json()["todos"] == [{**first.json()["todos"][0], "duplicate": True}]
    assert errors == []
    assert Todo.objects.count() == 1 and TodoEvent.objects.count() == 1
    assert DeliveryEvent.objects.count() == 1
    assert ReplayLedgerEntry.objects.count() == 1


def test_a_key_taken_while_the_statement_runs_fails_it_and_nothing_of_it_is_kept(make_webhook,
                                                                                endpoint):
    """The race the statement cannot see as it starts: another delivery's todo holds the key,
    inserted but not yet committed. The statement passes its gate, waits on that row at its
    ON CONFLICT, inserts no todo once the other commits, and divides by zero on purpose:
    PostgreSQL undoes every row it wrote, and the transaction path answers the duplicate."""
    webhook = make_webhook("github")
    body = signing.body_of(ISSUE)
    key = transitions.idempotency_key_for(webhook, "d-1", transitions.body_digest(body))
    params = todo_transitions.create_todo_params(
        endpoint=endpoint, queue="inbox", title="the other delivery", actor="test",
        idempotency_key=key, trust="signed", now=timezone.now())
    settings_dict = connection.settings_dict
    other = psycopg.connect(dbname=settings_dict["NAME"], user=settings_dict["USER"],
                            password=settings_dict["PASSWORD"], host=settings_dict["HOST"],
                            port=settings_dict["PORT"] or None)
    try:
        (held_id,) = other.execute(
            f"WITH {todo_statements.create_todo_ctes()} SELECT id FROM t", params).fetchone()
        with errors_answered_by_postgresql() as errors:
            answers = []
            delivery = threading.Thread(
                target=lambda: answers.append(github_post(webhook, body, "d-1")))
            delivery.start()
            deadline = time.monotonic() + DEADLINE_SECONDS
            with connection.cursor() as cursor:
                while True:  # until the delivery's statement waits on the held row
                    cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname ="
                                   " current_database() AND wait_event_type = 'Lock'")
                    if cursor.fetchone()[0]:
                        break
                    assert time.monotonic() < deadline and delivery.is_alive(), \
                        "the delivery never waited on the held key"
                    time.sleep(0.01)
            other.commit()
            delivery.join(DEADLINE_SECONDS)
            assert not delivery.is_alive(), "the delivery hung"
    finally:
        other.close()
    assert errors == ["22012"]  # the statement's own guard, once
    [answer] = answers
    assert answer.status_code == 202
    assert answer.json()["todos"] == [{"id": str(held_id), "endpoint": endpoint.slug,
                                       "queue": "inbox", "duplicate": True}]
    assert list(Todo.objects.values_list("pk", flat=True)) == [held_id]
    assert DeliveryEvent.objects.count() == 0 and ReplayLedgerEntry.objects.count() == 0
    assert list(DeliveryRecord.objects.values_list("outcome", flat=True)) == ["duplicate"]


def test_concurrent_identical_deliveries_make_exactly_one_todo(make_webhook):
    webhook = make_webhook("github")
    body = signing.body_of(ISSUE)
    answers = run_threads(THREADS, lambda i: github_post(webhook, body, "same-delivery"))
    assert [answer.status_code for answer in answers] == [202] * THREADS
    todos = [answer.json()["todos"] for answer in answers]
    assert Counter(t[0]["duplicate"] for t in todos) == {False: 1, True: THREADS - 1}
    assert len({t[0]["id"] for t in todos}) == 1, "two todos for one delivery"
    assert Todo.objects.count() == 1 and TodoEvent.objects.count() == 1
    assert DeliveryEvent.objects.count() == 1
    assert ReplayLedgerEntry.objects.count() == 1
    outcomes = Counter(DeliveryRecord.objects.values_list("outcome", flat=True))
    assert outcomes["accepted"] == 1
    assert outcomes["accepted"] + outcomes["duplicate"] == THREADS


def test_concurrent_replays_of_one_body_make_one_todo_and_are_refused(make_webhook):
    """The same signed body under different delivery ids at once: the ledger lets one in, every
    other is a 409 replay, and none leaves a row but its log line."""
    webhook = make_webhook("github")
    body = signing.body_of(ISSUE)
    answers = run_threads(THREADS, lambda i: github_post(webhook, body, f"delivery-{i}"))
    statuses = Counter(answer.status_code for answer in answers)
    assert statuses == {202: 1, 409: THREADS - 1}, statuses
    assert Todo.objects.count() == 1 and TodoEvent.objects.count() == 1
    assert DeliveryEvent.objects.count() == 1
    assert ReplayLedgerEntry.objects.count() == 1
    outcomes = Counter(DeliveryRecord.objects.values_list("outcome", flat=True))
    assert outcomes == {"accepted": 1, "replay": THREADS - 1}


def test_concurrent_distinct_deliveries_each_make_their_todo(make_webhook):
    webhook = make_webhook("github")
    answers = run_threads(THREADS, lambda i: github_post(
        webhook, signing.body_of(numbered_issue(i)), f"delivery-{i}"))
    assert [answer.status_code for answer in answers] == [202] * THREADS
    assert Todo.objects.count() == THREADS and DeliveryEvent.objects.count() == THREADS
    assert DeliveryRecord.objects.filter(outcome="accepted").count() == THREADS
