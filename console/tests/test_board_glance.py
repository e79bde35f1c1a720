"""The board's glance: counts per endpoint, queue and state (generic over the lifecycle), the
oldest pending todo, and the throughput tallies folded from the audit trail."""

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from tests.factories import EndpointFactory
from todos import queries, sweeps, transitions
from todos.models import State, ThroughputFold, ThroughputTally, TodoEvent

pytestmark = pytest.mark.django_db


def test_terminal_states_are_the_ones_no_edge_leaves():
    assert {"done", "cancelled"} <= set(queries.terminal_states())
    assert "failed" in queries.open_states() and "pending" in queries.open_states()
    columns = queries.glance_columns()
    assert columns[:2] == ["awaiting_approval", "pending"]  # in lifecycle order
    assert "cancelled_24h" in columns
    assert ("scheduled" in columns) == queries.has_scheduled_todos()
    assert {"claimed", "retrying", "dead", "done_24h"} <= set(columns)
    assert "failed" not in columns  # split into retrying and dead


def test_the_glance_counts_every_state_per_queue_and_the_oldest_pending(endpoint, agent,
                                                                         make_todo):
    now = timezone.now()
    oldest = make_todo(queue="inbox", now=now - timedelta(minutes=10))
    make_todo(queue="inbox")
    transitions.claim_todo(agent, make_todo(queue="inbox").pk)
    done = transitions.claim_todo(agent, make_todo(queue="deploys").pk)
    transitions.complete_todo(agent, done.pk)
    waiting = transitions.claim_todo(agent, make_todo(queue="deploys").pk)
    transitions.fail_todo(agent, waiting.pk, error="boom")
    endpoint.max_attempts = 1
    endpoint.save()
    dead = transitions.claim_todo(agent, make_todo(queue="deploys").pk)
    transitions.fail_todo(agent, dead.pk, error="gone")

    glance = queries.board_glance([endpoint.pk])[endpoint.pk]
    inbox, deploys = glance["queues"]["inbox"], glance["queues"]["deploys"]
    assert (inbox["pending"], inbox["claimed"]) == (2, 1)
    assert inbox["oldest_pending_at"] == queries.iso_time(oldest.created_at)
    assert (deploys["retrying"], deploys["dead"], deploys["done_24h"]) == (1, 1, 1)
    assert deploys["oldest_pending_at"] is None
    minute = glance["series"]["minute"]
    assert sum(minute["created"].values()) == 6
    assert sum(minute["done"].values()) == 1 and sum(minute["failed"].values()) == 2
    assert sum(glance["series"]["hour"]["created"].values()) == 6


def test_an_event_is_counted_once_before_and_after_it_is_folded(endpoint, agent, make_todo):
    now = timezone.now()
    for _ in range(3):
        transitions.complete_todo(agent, transitions.claim_todo(agent, make_todo().pk).pk)
    before = queries.board_glance([endpoint.pk], now=now)
    assert sweeps.fold_throughput(now=now) == 0  # nothing settled yet: all still in the tail
    later = now + 3 * sweeps.FOLD_SETTLE_TIME
    assert sweeps.fold_throughput(now=later) == 9  # 3 creates, 3 claims, 3 completes
    assert ThroughputFold.objects.get(pk=1).through_event_id == TodoEvent.objects.latest("id").pk
    assert sweeps.fold_throughput(now=later) == 0  # a second run finds nothing left
    after = queries.board_glance([endpoint.pk], now=now)
    assert after == before
    assert after[endpoint.pk]["queues"]["inbox"]["done_24h"] == 3
    assert ThroughputTally.objects.filter(span_seconds=60, measure="done").get().count == 3


def test_buckets_past_their_keep_are_dropped(endpoint, agent, make_todo):
    make_todo()
    now = timezone.now()
    sweeps.fold_throughput(now=now + 3 * sweeps.FOLD_SETTLE_TIME)
    assert set(ThroughputTally.objects.values_list("span_seconds", flat=True)) == {60, 3600}
    sweeps.fold_throughput(now=now + sweeps.KEEP_MINUTE_BUCKETS + timedelta(minutes=2))
    assert set(ThroughputTally.objects.values_list("span_seconds", flat=True)) == {3600}
    sweeps.fold_throughput(now=now + sweeps.KEEP_HOUR_BUCKETS + timedelta(hours=1, minutes=2))
    assert not ThroughputTally.objects.exists()
    # Out of the window, out of the chart: nothing of it is read back.
    assert queries.board_glance([endpoint.pk], now=now + timedelta(days=2))[endpoint.pk][
        "series"] == {"minute": {}, "hour": {}}


def test_the_glance_of_a_hundred_endpoints_costs_four_queries(operator):
    endpoints = [EndpointFactory(slug=f"e{i}", owner=operator) for i in range(100)]
    for endpoint in endpoints:
        todo, _ = transitions.create_todo(endpoint=endpoint, queue="inbox", title="t",
                                          actor="test")
    agent = transitions.Caller.agent(endpoints[-1], "session-a")
    transitions.complete_todo(agent, transitions.claim_todo(agent, todo.pk).pk)
    sweeps.fold_throughput(now=timezone.now() + 3 * sweeps.FOLD_SETTLE_TIME)
    ids = [endpoint.pk for endpoint in endpoints]
    with CaptureQueriesContext(connection) as queries_run:
        glance = queries.board_glance(ids)
    # open counts, the fold row, the tallies, the events after the fold
    assert len(queries_run) == 4, [q["sql"] for q in queries_run]
    assert sum(entry["queues"]["inbox"].get("pending", 0) for entry in glance.values()) == 99


def test_endpoint_queue_counts_is_the_glance_in_the_stats_shape(endpoint, agent, make_todo):
    now = timezone.now()
    make_todo(queue="inbox", now=now - timedelta(seconds=90))
    transitions.complete_todo(agent, transitions.claim_todo(agent, make_todo(queue="ci").pk).pk)
    rows = queries.endpoint_queue_counts(endpoint, now=now)
    assert [row["queue"] for row in rows] == ["ci", "inbox"]
    assert rows[0]["done_24h"] == 1 and rows[0]["oldest_pending_seconds"] is None
    assert rows[1]["pending"] == 1 and rows[1]["oldest_pending_seconds"] == 90
    assert set(queries.glance_columns()) <= set(rows[1])
