"""``GET /api/v1/endpoints/<slug>/stats`` (docs/work-control.md#stats): the exact shape, the
counts per queue, the live sessions without their ids, auth and ownership like the hand-over,
a pinned number of statements however many endpoints exist, and index plans only."""

import json
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone

from channels_push.sessions import transitions as session_transitions
from endpoints import transitions as endpoint_transitions
from ingest import transitions
from tests import plans
from tests.factories import UserFactory, credential_for
from todos import transitions as todo_transitions
from todos.models import State, Todo, Trust

pytestmark = pytest.mark.django_db

QUEUE_KEYS = {"queue", "pending", "scheduled", "awaiting_approval", "claimed", "retrying", "dead",
              "done_24h", "cancelled_24h", "oldest_pending_seconds"}


@pytest.fixture
def owner(db):
    return UserFactory(username="alice")


@pytest.fixture
def endpoint(owner):
    return endpoint_transitions.vend_endpoint(slug="builds", owner=owner,
                                              scope=["inbox", "deploys", "quiet"])[0]


@pytest.fixture
def token(owner):
    return transitions.mint_operator_token(user=owner, name="script")[1]


def stats(client, slug, token=None):
    meta = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    return client.get(f"/api/v1/endpoints/{slug}/stats", **meta)


def finish(endpoint, queue, at):
    """A todo done at ``at`` through the real transitions (the day's counts read their events)."""
    todo, _ = todo_transitions.create_todo(endpoint=endpoint, queue=queue, title=queue,
                                           actor="test", trust=Trust.OPERATOR, now=at)
    caller = todo_transitions.Caller.operator(endpoint, "alice")
    todo_transitions.claim_todo(caller, todo.pk, now=at)
    todo_transitions.complete_todo(caller, todo.pk, now=at)


def make(endpoint, queue, state, **fields):
    todo, _ = todo_transitions.create_todo(endpoint=endpoint, queue=queue, title=queue,
                                           actor="test", trust=Trust.OPERATOR)
    if state != State.PENDING or fields:
        # Test setup only: put a row straight into the state the counts read.
        Todo.objects.filter(pk=todo.pk).update(state=state, **fields)
    return todo


def test_stats_count_every_state_per_queue_and_list_empty_scope_queues(client, endpoint, token):
    now = timezone.now()
    make(endpoint, "inbox", State.PENDING, created_at=now - timedelta(minutes=10))
    make(endpoint, "inbox", State.PENDING)
    make(endpoint, "inbox", State.CLAIMED, lease_owner="x" * 43)
    make(endpoint, "inbox", State.FAILED, retry_at=now + timedelta(minutes=1))
    make(endpoint, "inbox", State.FAILED, dead_lettered_at=now)
    finish(endpoint, "inbox", now - timedelta(hours=1))
    finish(endpoint, "inbox", now - timedelta(hours=30))  # older than a day
    finish(endpoint, "deploys", now - timedelta(minutes=5))
    answer = stats(client, "builds", token)
    assert answer.status_code == 200, answer.content
    data = answer.json()
    assert set(data) == {"endpoint", "queues", "sessions", "spend"} and data["endpoint"] == "builds"
    assert [row["queue"] for row in data["queues"]] == ["deploys", "inbox", "quiet"]
    assert all(set(row) == QUEUE_KEYS for row in data["queues"])
    inbox = data["queues"][1]
    assert {k: inbox[k] for k in QUEUE_KEYS - {"queue", "oldest_pending_seconds"}} == {
        "pending": 2, "scheduled": 0, "awaiting_approval": 0, "claimed": 1, "retrying": 1,
        "dead": 1, "done_24h": 1, "cancelled_24h": 0}
    assert 600 <= inbox["oldest_pending_seconds"] < 3600
    assert data["queues"][0]["done_24h"] == 1 and data["queues"][0]["oldest_pending_seconds"] is None
    assert data["queues"][2] == {"queue": "quiet", **{k: 0 for k in QUEUE_KEYS - {"queue"}},
                                 "oldest_pending_seconds": None}


def test_stats_list_live_sessions_by_client_never_by_id(client, endpoint, token):
    session = session_transitions.open_session(endpoint=endpoint, protocol_version="2025-11-25",
                                               client_name="claude-code", client_version="2.1",
                                               credential_id=credential_for(endpoint))
    answer = stats(client, "builds", token)
    sessions = answer.json()["sessions"]
    assert [(row["client"], row["streaming"]) for row in sessions] == [("claude-code 2.1", False)]
    assert set(sessions[0]) == {"client", "streaming", "last_seen_at"}
    assert sessions[0]["last_seen_at"].endswith("Z")
    assert session.pk not in answer.content.decode()


def test_stats_need_an_operator_and_hide_other_operators_endpoints(client, endpoint, token):
    assert stats(client, "builds").status_code == 401
    assert stats(client, "builds", "sbo_nope").status_code == 401
    mallory = transitions.mint_operator_token(user=UserFactory(username="mallory"))[1]
    assert stats(client, "builds", mallory).status_code == 404
    assert stats(client, "nowhere", token).status_code == 404
    assert client.post("/api/v1/endpoints/builds/stats",
                       HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 405
    # A signed-in session works as for the hand-over (a GET needs no CSRF token).
    browser = Client()
    browser.force_login(endpoint.owner)
    assert stats(browser, "builds").status_code == 200


def test_stats_cost_a_fixed_number_of_statements_with_100_endpoints(
        client, endpoint, token, django_assert_num_queries):
    owner = endpoint.owner
    for n in range(100):
        other = endpoint_transitions.vend_endpoint(slug=f"other-{n}", owner=owner)[0]
        make(other, "inbox", State.PENDING)
        make(other, f"q{n % 7}", State.DONE, updated_at=timezone.now())
    for queue in ("inbox", "deploys"):
        make(endpoint, queue, State.PENDING)
        make(endpoint, queue, State.CLAIMED)
    session_transitions.open_session(endpoint=endpoint, protocol_version="2025-11-25",
                                     client_name="runner", credential_id=credential_for(endpoint))
    # The token, its endpoint, the glance's counts and tallies, the sessions, the day's spend:
    # fixed, however many endpoints there are.
    with django_assert_num_queries(8):
        answer = stats(client, "builds", token)
    assert answer.status_code == 200
    assert sum(row["pending"] for row in answer.json()["queues"]) == 2


def test_stats_statements_read_indexes_not_the_table(endpoint):
    """With history and other endpoints in the table, no statement of the stats reads
    todos_todo sequentially (the glance folds events not yet tallied, a bounded tail)."""
    if connection.vendor != "postgresql":
        pytest.skip("query plans are PostgreSQL's; SQLite runs the same SQL unplanned")
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO todos_todo (endpoint_id, queue, state, title, kind, source, payload,"
            " trust, attempts, max_attempts, created_at, updated_at, ring_attempts, priority)"
            " SELECT %s, 'inbox', CASE WHEN g %% 50 = 0 THEN 'pending' ELSE 'done' END, 't', '',"
            " '', '{}', 'signed', 1, 5, now() - make_interval(hours => g %% 2000),"
            " now() - make_interval(hours => g %% 2000), 0, 0 FROM generate_series(1, 30000) g",
            [endpoint.pk])
        plans.analyze_every_table(cursor)
    from todos import queries
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as captured:
        queries.endpoint_queue_stats(endpoint, now=timezone.now())
    assert captured.captured_queries
    for query in captured.captured_queries:
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN (FORMAT JSON) " + query["sql"])
            plan = json.dumps(cursor.fetchone()[0])
        assert '"Seq Scan", "Parent Relationship": "Outer", "Parallel Aware": false, ' \
               '"Async Capable": false, "Relation Name": "todos_todo"' not in plan, plan
        assert '"Node Type": "Seq Scan", "Parallel Aware": false, "Async Capable": false, ' \
               '"Relation Name": "todos_todo"' not in plan, plan


def test_stats_show_todays_spend_against_the_budgets_and_over_budget(client, endpoint, token):
    from decimal import Decimal

    from todos import transitions, usage

    usage.set_endpoint_budget(endpoint, actor="alice", budget_usd_per_day=Decimal("0.5"),
                              budget_tokens_per_day=10_000)
    assert stats(client, "builds", token).json()["spend"] == {
        "usd_today": 0.0, "tokens_today": 0, "budget_usd_per_day": 0.5,
        "budget_tokens_per_day": 10_000, "over_budget": False}
    todo = make(endpoint, "inbox", State.PENDING)
    agent = transitions.Caller.agent(endpoint, "s-1")
    held = transitions.claim_todo(agent, todo.pk)
    transitions.complete_todo(agent, todo.pk, lease_id=held.lease_id, usage_reported={
        "cost_usd": 0.75, "input_tokens": 100, "output_tokens": 20})
    assert stats(client, "builds", token).json()["spend"] == {
        "usd_today": 0.75, "tokens_today": 120, "budget_usd_per_day": 0.5,
        "budget_tokens_per_day": 10_000, "over_budget": True}
