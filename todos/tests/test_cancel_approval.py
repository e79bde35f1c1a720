"""Cancel and the approval gate: the transitions, their events, and what each leaves visible."""

import threading
from collections import Counter
from datetime import timedelta

import pytest
from django.db import connections
from django.utils import timezone

from tests.factories import EndpointFactory, UserFactory
from todos import queries, sweeps, transitions
from todos.models import State, Todo, TodoEvent
from todos.transitions import Caller, Refusal

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice(endpoint):
    return Caller.operator(endpoint, "alice")


@pytest.fixture
def commits(django_capture_on_commit_callbacks):
    """``with commits():`` runs what the block registered to happen after commit (the test's
    own transaction never commits)."""
    return lambda: django_capture_on_commit_callbacks(execute=True)


def events_of(todo_id):
    return list(TodoEvent.objects.filter(todo_id=todo_id).order_by("id")
                .values_list("action", "from_state", "to_state", "actor", "detail"))


# -- cancel --------------------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["awaiting_approval", "pending", "failed", "claimed"])
def test_cancel_ends_a_todo_from_each_live_state(agent, alice, make_todo, state, published,
                                                commits):
    todo = make_todo(requires_approval=state == "awaiting_approval")
    if state in ("failed", "claimed"):
        transitions.claim_todo(agent, todo.pk)
    if state == "failed":
        transitions.fail_todo(agent, todo.pk)
    now = timezone.now()
    with commits():
        cancelled = transitions.cancel_todo(alice, todo.pk, reason="  not  needed ", now=now)
    assert (cancelled.state, cancelled.cancelled_at) == (State.CANCELLED, now)
    assert (cancelled.lease_id, cancelled.lease_owner, cancelled.lease_expires_at,
            cancelled.retry_at) == (None, None, None, None)
    action, from_state, to_state, actor, detail = events_of(todo.pk)[-1]
    assert (action, from_state, to_state, actor) == ("cancel", state, "cancelled", "alice")
    assert detail["reason"] == "not needed"
    assert published[-1]["action"] == "cancel"
    assert queries.todo_as_dict(cancelled)["cancelled_at"] == now.isoformat().replace(
        "+00:00", "Z")


def test_cancelling_a_claimed_todo_overrides_the_lease_and_every_fenced_call_is_lease_lost(
        agent, alice, make_todo):
    held = transitions.claim_todo(agent, make_todo().pk)
    transitions.cancel_todo(alice, held.pk)
    detail = events_of(held.pk)[-1][-1]
    assert detail["override"] is True
    assert detail["overridden_lease"] == {"lease_id": held.lease_id[:8], "lease_owner": "session-"}
    before = TodoEvent.objects.count()
    for verb in (transitions.heartbeat_todo, transitions.complete_todo, transitions.fail_todo,
                 transitions.release_todo):
        for lease in ({"lease_id": held.lease_id}, {}):
            with pytest.raises(Refusal) as refused:
                verb(agent, held.pk, **lease)
            assert refused.value.code == "lease_lost"
            assert "cancelled" in refused.value.message
    assert TodoEvent.objects.count() == before
    assert Todo.objects.get(pk=held.pk).state == State.CANCELLED


def test_a_cancelled_todo_frees_its_idempotency_key_and_is_never_claimed(agent, alice, make_todo):
    first = make_todo(idempotency_key="k")
    assert make_todo(idempotency_key="k").pk == first.pk  # live: collapses
    transitions.cancel_todo(alice, first.pk)
    second = make_todo(idempotency_key="k")
    assert second.pk != first.pk and second.state == State.PENDING
    assert transitions.claim_next_todo(agent).pk == second.pk
    assert transitions.claim_next_todo(agent) is None


def test_a_todo_awaiting_approval_holds_its_idempotency_key(make_todo):
    gated = make_todo(idempotency_key="k", requires_approval=True)
    again, created = transitions.create_todo(endpoint=gated.endpoint, queue="inbox", title="t",
                                             actor="test", idempotency_key="k",
                                             requires_approval=True)
    assert (again.pk, created) == (gated.pk, False)


@pytest.mark.parametrize("reason, message", [
    (5, "reason must be a string"),
    ("x" * 501, "reason must be at most 500 characters"),
    ("a\x00b", "reason contains a NUL character"),
])
def test_a_bad_reason_is_refused_naming_it_and_writes_nothing(alice, make_todo, reason, message):
    todo = make_todo()
    before = TodoEvent.objects.count()
    for verb in (transitions.cancel_todo, transitions.reject_todo):
        with pytest.raises(Refusal) as refused:
            verb(alice, todo.pk, reason=reason)
        assert (refused.value.code, refused.value.message.split(" (")[0]) == (
            "invalid_argument", message)
    assert TodoEvent.objects.count() == before
    assert Todo.objects.get(pk=todo.pk).state == State.PENDING


def test_unknown_and_foreign_todos_are_not_found_for_every_operator_verb(alice, make_todo):
    other = EndpointFactory(slug="other", owner=UserFactory(username="bob"))
    foreign, _ = transitions.create_todo(endpoint=other, queue="inbox", title="t", actor="t",
                                         requires_approval=True)
    for verb in (transitions.cancel_todo, transitions.approve_todo, transitions.reject_todo):
        for todo_id in (foreign.pk, 999_999, "x"):
            with pytest.raises(Refusal) as refused:
                verb(alice, todo_id)
            assert refused.value.code == "not_found"
    assert Todo.objects.get(pk=foreign.pk).state == State.AWAITING_APPROVAL
    assert TodoEvent.objects.filter(todo_id=foreign.pk).count() == 1


def test_agents_cannot_cancel_approve_or_reject(agent, make_todo):
    todo = make_todo(requires_approval=True)
    for verb in (transitions.cancel_todo, transitions.approve_todo, transitions.reject_todo):
        with pytest.raises(Refusal) as refused:
            verb(agent, todo.pk)
        assert refused.value.code == "verb_not_allowed"
    assert Todo.objects.get(pk=todo.pk).state == State.AWAITING_APPROVAL


# -- the approval gate ---------------------------------------------------------------------------


def test_a_gated_todo_waits_unclaimable_unlisted_and_unrung(agent, make_todo, published,
                                                            commits):
    with commits():
        gated = make_todo(requires_approval=True)
    assert gated.state == State.AWAITING_APPROVAL
    assert events_of(gated.pk)[0][:3] == ("create", None, "awaiting_approval")
    assert transitions.claim_next_todo(agent) is None
    with pytest.raises(Refusal) as refused:
        transitions.claim_todo(agent, gated.pk)
    assert refused.value.code == "awaiting_approval"
    assert queries.list_todos(agent)[0] == []
    assert queries.list_todos(agent, state="awaiting_approval")[0] == []
    # Announced to the board, but as a todo no doorbell or long poll acts on.
    assert [(c["action"], c["state"]) for c in published] == [("create", "awaiting_approval")]


def test_approve_makes_it_pending_ready_and_rung(agent, alice, make_todo, published, commits):
    gated = make_todo(requires_approval=True, trust="signed")
    with commits():
        approved = transitions.approve_todo(alice, gated.pk)
    assert (approved.state, approved.trust, approved.ring_attempts) == ("pending", "signed", 0)
    assert events_of(gated.pk)[-1] == ("approve", "awaiting_approval", "pending", "alice", {})
    from channels_push.bus import publish

    assert published[-1]["action"] == "approve" and "approve" in publish.READY_ACTIONS
    assert transitions.claim_next_todo(agent).pk == gated.pk


def test_an_approved_scheduled_todo_stays_scheduled_until_it_comes_due(agent, alice, make_todo,
                                                                       published, commits):
    now = timezone.now()
    gated = make_todo(requires_approval=True, not_before=now + timedelta(minutes=5), now=now)
    with commits():
        approved = transitions.approve_todo(alice, gated.pk, now=now)
    assert approved.state == "pending" and approved.not_before is not None
    assert published[-1]["action"] == "approve" and published[-1]["scheduled"] is True
    assert transitions.claim_next_todo(agent, now=now) is None
    assert sweeps.release_due_scheduled_todos(now=now + timedelta(minutes=6)) == 1
    assert transitions.claim_next_todo(agent, now=now).pk == gated.pk


@pytest.mark.parametrize("trust", ["unverified", "signed", "operator"])
def test_approving_keeps_the_trust_the_todo_had(alice, make_todo, trust):
    gated = make_todo(requires_approval=True, trust=trust)
    approved = transitions.approve_todo(alice, gated.pk)
    assert (approved.state, approved.trust) == ("pending", trust)
    assert Todo.objects.get(pk=gated.pk).trust == trust
    assert events_of(gated.pk)[-1][0] == "approve"
    assert "from_trust" not in events_of(gated.pk)[-1][-1]


def test_reject_cancels_with_the_reason(alice, make_todo, published, commits):
    gated = make_todo(requires_approval=True)
    with commits():
        rejected = transitions.reject_todo(alice, gated.pk, reason="not on prod")
    assert rejected.state == State.CANCELLED and rejected.cancelled_at is not None
    assert events_of(gated.pk)[-1] == ("reject", "awaiting_approval", "cancelled", "alice",
                                       {"reason": "not on prod"})
    assert published[-1]["action"] == "reject"


def test_the_approval_timeout_sweep_cancels_only_stale_approvals(endpoint, alice, make_todo):
    endpoint.approval_timeout_seconds = 60
    endpoint.save()
    untimed = EndpointFactory(slug="untimed", owner=endpoint.owner)
    now = timezone.now()
    stale = make_todo(requires_approval=True, now=now - timedelta(seconds=61))
    fresh = make_todo(requires_approval=True, now=now - timedelta(seconds=30))
    pending = make_todo(now=now - timedelta(hours=1))
    forever, _ = transitions.create_todo(endpoint=untimed, queue="inbox", title="t", actor="t",
                                         requires_approval=True, now=now - timedelta(days=9))
    assert sweeps.cancel_stale_approvals(now=now) == 1
    assert sweeps.cancel_stale_approvals(now=now) == 0
    states = dict(Todo.objects.values_list("pk", "state"))
    assert [states[t.pk] for t in (stale, fresh, pending, forever)] == [
        "cancelled", "awaiting_approval", "pending", "awaiting_approval"]
    assert events_of(stale.pk)[-1] == ("cancel", "awaiting_approval", "cancelled",
                                       "approval-timeout", {"reason": "approval_timeout"})
    from switchboard import scheduler

    assert (sweeps.cancel_stale_approvals, 5.0) in scheduler.embedded_sweeps()


# -- races (PostgreSQL in the main run) ----------------------------------------------------------

RACES = 200


@pytest.mark.django_db(transaction=True)
def test_cancel_racing_complete_on_a_claimed_todo_exactly_one_wins_with_one_event():
    endpoint = EndpointFactory(owner=UserFactory(username="carol"))
    agent = Caller.agent(endpoint, "session-1")
    operator = Caller.operator(endpoint, "carol")
    winners = Counter()
    for _ in range(RACES):
        todo, _ = transitions.create_todo(endpoint=endpoint, queue="inbox", title="t", actor="t")
        held = transitions.claim_todo(agent, todo.pk)
        start = threading.Barrier(2)
        outcomes = {}

        def race(name, call):
            start.wait(10)
            try:
                call()
                outcomes[name] = "won"
            except Refusal as refusal:
                outcomes[name] = refusal.code
            finally:
                connections.close_all()

        threads = [
            threading.Thread(target=race, args=("complete", lambda: transitions.complete_todo(
                agent, held.pk, lease_id=held.lease_id))),
            threading.Thread(target=race, args=("cancel", lambda: transitions.cancel_todo(
                operator, held.pk))),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        won = [name for name, outcome in outcomes.items() if outcome == "won"]
        assert len(won) == 1, outcomes
        loser = "cancel" if won == ["complete"] else "complete"
        assert outcomes[loser] == ("not_claimable" if loser == "cancel" else "lease_lost")
        ending = TodoEvent.objects.filter(todo_id=held.pk, action__in=["complete", "cancel"])
        assert ending.count() == 1
        assert Todo.objects.get(pk=held.pk).state == (
            State.DONE if won == ["complete"] else State.CANCELLED)
        winners[won[0]] += 1
    assert sum(winners.values()) == RACES
