"""Over a daily budget, doorbells and sweeps hold like a pause (docs/reference.md#usage-and-budgets);
the day's turn sends one digest (reason ``budget``) to an endpoint that was held, however many
sweeps overlap, and a raise does the same."""

from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from decimal import Decimal

import pytest

from channels_push.doorbells import doorbells, sweeps
from channels_push.sessions import transitions as session_transitions
from channels_push.tests.conftest import make_ready_todo
from endpoints.models import Endpoint
from tests.factories import credential_for
from todos import transitions, usage

pytestmark = pytest.mark.django_db

EVENING = datetime(2026, 12, 7, 22, 0, tzinfo=dt_timezone.utc)
NEXT_MORNING = datetime(2026, 12, 8, 0, 0, 20, tzinfo=dt_timezone.utc)


@pytest.fixture(autouse=True)
def sessions_stay_attached(settings):
    settings.SWITCHBOARD_ATTACH_WINDOW = timedelta(days=60)


def attached(endpoint, now):
    session = session_transitions.open_session(endpoint=endpoint, credential_id=credential_for(endpoint),
                                               protocol_version="2025-11-25", now=now)
    session_transitions.attach_stream(endpoint=endpoint, session_id=session.pk, now=now)
    return session


def spend(endpoint, cost, now):
    todo = make_ready_todo(endpoint, title="spent", now=now)
    agent = transitions.Caller.agent(endpoint, "worker")
    held = transitions.claim_todo(agent, todo.pk, now=now)
    transitions.complete_todo(agent, held.pk, lease_id=held.lease_id, now=now,
                              usage_reported={"cost_usd": cost})


def test_doorbells_and_sweeps_hold_over_budget_and_keep_the_ring_budget(endpoint):
    Endpoint.objects.filter(pk=endpoint.pk).update(budget_usd_per_day=Decimal("1"))
    endpoint.refresh_from_db()
    now = datetime.now(dt_timezone.utc)
    attached(endpoint, now)
    spend(endpoint, 1.0, now)
    held = make_ready_todo(endpoint, now=now - timedelta(minutes=10))
    assert doorbells.ring_todo(held, now=now) is None
    assert sweeps.ring_due_todos(now=now) == 0
    assert doorbells.send_digest(endpoint, "operator", now=now) == 0
    held.refresh_from_db()
    assert (held.ring_attempts, held.last_ringed_at) == (0, None)


def test_the_days_turn_sends_one_digest_to_a_held_endpoint_however_many_sweeps_run(
        endpoint, monkeypatch):
    sent = []
    monkeypatch.setattr(doorbells, "send_digest",
                        lambda endpoint, reason, now=None: sent.append((endpoint.slug, reason)) or 1)
    usage.set_endpoint_budget(endpoint, actor="alice", budget_usd_per_day=Decimal("1"))
    spend(endpoint, 1.5, EVENING)
    assert sweeps.announce_budget_day_turns(now=EVENING) == 0  # the day is only seen
    assert sweeps.announce_budget_day_turns(now=EVENING + timedelta(minutes=30)) == 0
    assert sent == []
    assert sweeps.announce_budget_day_turns(now=NEXT_MORNING) == 1
    assert sweeps.announce_budget_day_turns(now=NEXT_MORNING) == 0  # an overlapping sweep
    assert sweeps.announce_budget_day_turns(now=NEXT_MORNING + timedelta(seconds=30)) == 0
    assert sent == [("agent", "budget")]


def test_the_days_turn_sends_nothing_to_an_endpoint_that_stayed_under_budget(endpoint, monkeypatch):
    sent = []
    monkeypatch.setattr(doorbells, "send_digest",
                        lambda endpoint, reason, now=None: sent.append(reason) or 1)
    usage.set_endpoint_budget(endpoint, actor="alice", budget_usd_per_day=Decimal("1"))
    spend(endpoint, 0.5, EVENING)
    sweeps.announce_budget_day_turns(now=EVENING)
    assert sweeps.announce_budget_day_turns(now=NEXT_MORNING) == 0 and sent == []


def test_a_held_endpoints_digest_reaches_its_attached_session_on_raise(
        endpoint, django_capture_on_commit_callbacks, monkeypatch):
    now = datetime.now(dt_timezone.utc)
    usage.set_endpoint_budget(endpoint, actor="alice", budget_usd_per_day=Decimal("1"))
    attached(endpoint, now)
    spend(endpoint, 1.0, now)
    make_ready_todo(endpoint, title="waiting", now=now)
    rung = []
    monkeypatch.setattr(doorbells, "_ring_session",
                        lambda session_id, has_stream, params, context: rung.append(params["meta"]))
    with django_capture_on_commit_callbacks(execute=True):
        usage.set_endpoint_budget(endpoint, actor="alice", budget_usd_per_day=Decimal("5"))
    assert len(rung) == 1
    assert rung[0]["reason"] == "budget" and rung[0]["pending"] == "1"
    assert endpoint.events.filter(action="budget").count() == 2
