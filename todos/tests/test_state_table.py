"""The transition functions take exactly the edges written down in todos.models.EDGES."""

from datetime import timedelta

import pytest
from django.utils import timezone

from todos import sweeps, transitions
from todos.models import EDGES, TodoEvent
from todos.transitions import Caller, Refusal

pytestmark = pytest.mark.django_db


def recorded_edges():
    return {(a, f, t) for a, f, t in TodoEvent.objects.values_list("action", "from_state", "to_state")}


def test_every_edge_is_taken_and_no_other(agent, endpoint, make_todo):
    endpoint.max_attempts = 2
    endpoint.save()
    operator = Caller.operator(endpoint, "alice")
    now = timezone.now()

    done = make_todo(write_back="status")
    transitions.claim_todo(agent, done.pk, now=now)
    transitions.heartbeat_todo(agent, done.pk, now=now)
    transitions.post_update_todo(agent, done.pk, text="half way", now=now)  # progress
    transitions.complete_todo(agent, done.pk, now=now)

    released = make_todo()
    transitions.claim_todo(agent, released.pk, now=now)
    transitions.release_todo(agent, released.pk, now=now)

    retried = make_todo()
    transitions.claim_todo(agent, retried.pk, now=now)
    transitions.fail_todo(agent, retried.pk, now=now)                 # fail
    sweeps.promote_due_retries(now=now + timedelta(hours=1))           # retry
    transitions.claim_todo(agent, retried.pk, now=now)
    transitions.fail_todo(agent, retried.pk, now=now)                 # dead_letter
    transitions.requeue_todo(operator, retried.pk, now=now)           # requeue

    promoted = make_todo(trust="unverified")
    transitions.promote_todo(operator, promoted.pk, now=now)            # promote
    gated_promoted = make_todo(trust="unverified", requires_approval=True)
    transitions.promote_todo(operator, gated_promoted.pk, now=now)      # promote, still gated

    lapsed = make_todo()
    for _ in range(2):
        transitions.claim_todo(agent, lapsed.pk, lease_ttl_seconds=1, now=now)
        now += timedelta(seconds=5)
        sweeps.expire_lapsed_leases(now=now)                           # lapse, then lapse to dead

    ordered = make_todo()
    transitions.set_priority_todo(operator, ordered.pk, 5, now=now)    # prioritize (pending)
    transitions.set_priority_todo(operator, retried.pk, 0, now=now)    # (requeued: pending)
    transitions.claim_todo(agent, ordered.pk, now=now)
    transitions.fail_todo(agent, ordered.pk, now=now)
    transitions.set_priority_todo(operator, ordered.pk, -5, now=now)   # prioritize (failed)

    waiting = make_todo(not_before=now + timedelta(hours=1))
    transitions.run_now_todo(operator, waiting.pk, now=now)            # run_now
    later = make_todo(not_before=now + timedelta(minutes=1))
    sweeps.release_due_scheduled_todos(now=now + timedelta(minutes=2))  # due

    approved = make_todo(requires_approval=True)                       # create, gated
    transitions.set_priority_todo(operator, approved.pk, 9, now=now)   # prioritize (gated)
    transitions.approve_todo(operator, approved.pk, now=now)           # approve
    transitions.cancel_todo(operator, approved.pk, now=now)            # cancel from pending
    transitions.reject_todo(operator, make_todo(requires_approval=True).pk, now=now)  # reject
    transitions.cancel_todo(operator, make_todo(requires_approval=True).pk, now=now)
    claimed = transitions.claim_todo(agent, make_todo().pk, now=now)
    transitions.cancel_todo(operator, claimed.pk, now=now)             # cancel from claimed
    transitions.cancel_todo(operator, lapsed.pk, now=now)              # cancel from failed

    def fold(todo):
        assert transitions.add_followup(
            todo.pk, delivery_event=None, kind="k", title="t", actor="octocat", trust="signed",
            payload={}, now=now) is not None

    for todo in (make_todo(), make_todo(requires_approval=True)):
        fold(todo)                                                     # followup (waiting)
    failed = make_todo()
    transitions.claim_todo(agent, failed.pk, now=now)
    fold(failed)                                                       # followup (claimed)
    transitions.fail_todo(agent, failed.pk, now=now)
    fold(failed)                                                       # followup (failed)
    asked = transitions.claim_todo(agent, make_todo().pk, now=now)
    transitions.request_cancel(asked.pk, actor="alice", now=now)       # cancel_request

    assert recorded_edges() == set(EDGES)


@pytest.mark.parametrize("verb, edges", [
    ("heartbeat", {("heartbeat", "claimed", "claimed")}),
    ("complete", {("complete", "claimed", "done")}),
    ("fail", {("fail", "claimed", "failed")}),
    ("release", {("release", "claimed", "pending")}),
])
def test_operator_overrides_take_the_same_edges_marked_override(agent, make_todo, verb, edges):
    held = transitions.claim_todo(agent, make_todo().pk)
    before = TodoEvent.objects.count()
    getattr(transitions, f"{verb}_todo")(Caller.operator(agent.endpoint, "alice"), held.pk,
                                         overriding=transitions.HeldLease.of(held))
    new = TodoEvent.objects.order_by("id")[before:]
    assert {(e.action, e.from_state, e.to_state) for e in new} == edges <= set(EDGES)
    assert [(e.actor, e.detail["override"]) for e in new] == [("alice", True)]


# The refusals a fenced verb answers instead of taking an edge: (situation, verb) -> code.
FENCED = ("heartbeat", "complete", "fail", "release")
REFUSALS = {
    **{("lease lapsed, reaper not yet run", verb): "lease_lost" for verb in FENCED},
    **{("another lease holds it", verb): "lease_lost" for verb in FENCED},
    **{("an operator released it", verb): "lease_lost" for verb in FENCED},
    **{("completed by this lease", verb): "lease_lost" for verb in FENCED},
    ("completed by this lease", "complete"): "already_done",
    **{("the override's lease changed", verb): "lease_lost" for verb in FENCED},
}


def situation(name, agent, make_todo, now):
    """A claimed-then-something todo; returns (caller, todo id, kwargs) for the refused call."""
    operator = Caller.operator(agent.endpoint, "alice")
    held = transitions.claim_todo(agent, make_todo().pk, lease_ttl_seconds=1, now=now)
    lease = {"lease_id": held.lease_id, "now": now}
    if name == "lease lapsed, reaper not yet run":
        return agent, held.pk, {**lease, "now": now + timedelta(seconds=2)}
    if name == "another lease holds it":
        transitions.release_todo(agent, held.pk, now=now)
        transitions.claim_todo(Caller.agent(agent.endpoint, "session-b"), held.pk, now=now)
        return agent, held.pk, lease
    if name == "an operator released it":
        transitions.release_todo(operator, held.pk, overriding=transitions.HeldLease.of(held),
                                 now=now)
        return agent, held.pk, lease
    if name == "completed by this lease":
        transitions.complete_todo(agent, held.pk, now=now, **{"lease_id": held.lease_id})
        return agent, held.pk, lease
    if name == "the override's lease changed":
        transitions.heartbeat_todo(agent, held.pk, now=now)  # same lease: still overridable
        transitions.release_todo(agent, held.pk, now=now)
        transitions.claim_todo(agent, held.pk, now=now)  # a new lease of the same session
        return operator, held.pk, {"overriding": transitions.HeldLease.of(held), "now": now}
    raise AssertionError(name)


@pytest.mark.parametrize("name, verb", sorted(REFUSALS))
def test_fenced_refusals_match_the_table_and_record_nothing(agent, make_todo, name, verb):
    caller, todo_id, kwargs = situation(name, agent, make_todo, timezone.now())
    before = TodoEvent.objects.count()
    with pytest.raises(Refusal) as refused:
        getattr(transitions, f"{verb}_todo")(caller, todo_id, **kwargs)
    assert refused.value.code == REFUSALS[(name, verb)]
    assert TodoEvent.objects.count() == before


# Work control's refusals: (situation, transition) -> code; each records nothing.
WORK_CONTROL_REFUSALS = {
    ("scheduled, not yet due", "claim"): "scheduled",
    ("claimed", "set_priority"): "not_claimable",
    ("done", "set_priority"): "not_claimable",
    ("ready (not scheduled)", "run_now"): "not_claimable",
    ("claimed", "run_now"): "not_claimable",
}


@pytest.mark.parametrize("name, verb", sorted(WORK_CONTROL_REFUSALS))
def test_work_control_refusals_match_the_table_and_record_nothing(agent, make_todo, name, verb):
    now = timezone.now()
    operator = Caller.operator(agent.endpoint, "alice")
    if name == "scheduled, not yet due":
        todo = make_todo(not_before=now + timedelta(minutes=10))
    else:
        todo = make_todo()
    if name in ("claimed", "done"):
        transitions.claim_todo(agent, todo.pk, now=now)
    if name == "done":
        transitions.complete_todo(agent, todo.pk, now=now)
    calls = {
        "claim": lambda: transitions.claim_todo(agent, todo.pk, now=now),
        "set_priority": lambda: transitions.set_priority_todo(operator, todo.pk, 3, now=now),
        "run_now": lambda: transitions.run_now_todo(operator, todo.pk, now=now),
    }
    before = TodoEvent.objects.count()
    with pytest.raises(Refusal) as refused:
        calls[verb]()
    assert refused.value.code == WORK_CONTROL_REFUSALS[(name, verb)]
    assert TodoEvent.objects.count() == before


# What cancel, approve and reject answer from each state they do not take (-> code), and what
# claim answers for a todo awaiting approval. Every other (verb, state) pair is an edge above.
APPROVAL_REFUSALS = {
    ("cancel", "done"): "not_claimable",
    ("cancel", "cancelled"): "not_claimable",
    **{("approve", state): "not_claimable"
       for state in ("pending", "claimed", "failed", "done", "cancelled")},
    **{("reject", state): "not_claimable"
       for state in ("pending", "claimed", "failed", "done", "cancelled")},
    ("claim", "awaiting_approval"): "awaiting_approval",
}


def todo_in_state(state, agent, make_todo):
    operator = Caller.operator(agent.endpoint, "alice")
    todo = make_todo(requires_approval=state == "awaiting_approval")
    if state in ("claimed", "done", "failed"):
        transitions.claim_todo(agent, todo.pk)
    if state == "done":
        transitions.complete_todo(agent, todo.pk)
    if state == "failed":
        transitions.fail_todo(agent, todo.pk)
    if state == "cancelled":
        transitions.cancel_todo(operator, todo.pk)
    return todo.pk


@pytest.mark.parametrize("verb, state", sorted(APPROVAL_REFUSALS))
def test_approval_refusals_match_the_table_and_write_nothing(agent, make_todo, verb, state):
    from todos.models import State, Todo

    assert state in State.values
    todo_id = todo_in_state(state, agent, make_todo)
    caller = agent if verb == "claim" else Caller.operator(agent.endpoint, "alice")
    before = (TodoEvent.objects.count(), Todo.objects.get(pk=todo_id).updated_at)
    with pytest.raises(Refusal) as refused:
        getattr(transitions, f"{verb}_todo")(caller, todo_id)
    assert refused.value.code == APPROVAL_REFUSALS[(verb, state)]
    if refused.value.code == "not_claimable":
        assert refused.value.message.startswith(f"todo {todo_id} is {state}; ")
    assert (TodoEvent.objects.count(), Todo.objects.get(pk=todo_id).updated_at) == before


def test_every_state_is_covered_by_an_edge_or_a_refusal_of_each_approval_verb():
    from todos.models import State

    for verb, action in (("cancel", "cancel"), ("approve", "approve"), ("reject", "reject")):
        taken = {f for a, f, _ in EDGES if a == action}
        refused = {s for v, s in APPROVAL_REFUSALS if v == verb}
        assert taken | refused == set(State.values) and not taken & refused, verb


def test_a_refused_transition_records_no_event(agent, make_todo):
    todo = make_todo()
    before = TodoEvent.objects.count()
    for call in (transitions.complete_todo, transitions.heartbeat_todo, transitions.release_todo,
                 transitions.fail_todo):
        with pytest.raises(Refusal):
            call(agent, todo.pk)
    with pytest.raises(Refusal):
        transitions.requeue_todo(agent, todo.pk)
    assert TodoEvent.objects.count() == before
