"""The holder's side of threads (docs/work-control.md#threads): follow-ups handed over by claim
and heartbeat once per lease, the agent's own cancel, and a lapsed lease asked to stop."""

import threading
from collections import Counter
from datetime import timedelta

import pytest
from django.db import connections
from django.utils import timezone

from tests.factories import EndpointFactory, UserFactory
from todos import queries, sweeps, transitions
from todos.models import State, Todo, TodoEvent

pytestmark = pytest.mark.django_db


def add_followup(todo_id, title="also handle the empty case", *, now=None):
    """One follow-up of ``todo_id``, as ingest folds a delivery into it."""
    return transitions.add_followup(todo_id, delivery_event=None, kind="issue_comment",
                                    title=title, actor="reviewer", trust="unverified",
                                    payload={"body": title}, now=now or timezone.now())


def on_thread(todo, thread):
    Todo.objects.filter(pk=todo.pk).update(thread=thread)
    todo.refresh_from_db()
    return todo


def seqs(followups):
    return [followup.seq for followup in followups]


def new_since(todo):
    """What a heartbeat hands over: the given ones past where the lease stood."""
    return [f.seq for f in queries.given_followups(todo) if f.seq > todo.prior_followups_given]


def test_a_claim_hands_over_every_follow_up_and_a_heartbeat_only_the_new_ones(agent, make_todo):
    todo = on_thread(make_todo(), "octo/repo#12")
    add_followup(todo.pk)
    claimed = transitions.claim_todo(agent, todo.pk)
    assert claimed.followups_given == 1 and seqs(queries.given_followups(claimed)) == [1]
    beat = transitions.heartbeat_todo(agent, todo.pk)
    assert new_since(beat) == []
    add_followup(todo.pk, "second")
    add_followup(todo.pk, "third")
    beat = transitions.heartbeat_todo(agent, todo.pk, lease_id=claimed.lease_id)
    assert new_since(beat) == [2, 3] and beat.followups_given == 3
    assert new_since(transitions.heartbeat_todo(agent, todo.pk)) == []
    wire = queries.todo_as_dict(beat, followups=queries.given_followups(beat))
    assert [f["id"] for f in wire["followups"]] == [f"{todo.pk}.1", f"{todo.pk}.2", f"{todo.pk}.3"]
    assert wire["followups"][1] == {
        "id": f"{todo.pk}.2", "kind": "issue_comment", "title": "second", "actor": "reviewer",
        "trust": "unverified", "payload": {"body": "second"},
        "at": wire["followups"][1]["at"]}
    assert wire["thread"] == "octo/repo#12" and wire["followup_count"] == 3
    assert wire["cancel_requested"] is False


def test_a_later_claimer_gets_them_all_and_its_heartbeat_none_again(agent, endpoint, make_todo):
    todo = make_todo()
    transitions.claim_todo(agent, todo.pk)
    add_followup(todo.pk)
    transitions.heartbeat_todo(agent, todo.pk)
    transitions.release_todo(agent, todo.pk)
    add_followup(todo.pk)
    other = transitions.Caller.agent(endpoint, "session-b")
    claimed = transitions.claim_todo(other, todo.pk)
    assert seqs(queries.given_followups(claimed)) == [1, 2]
    assert new_since(transitions.heartbeat_todo(other, todo.pk)) == []


def test_an_operators_extension_hands_nothing_over(agent, endpoint, make_todo):
    todo = transitions.claim_todo(agent, make_todo().pk)
    add_followup(todo.pk)
    operator = transitions.Caller.operator(endpoint, "op")
    transitions.heartbeat_todo(operator, todo.pk, overriding=transitions.HeldLease.of(todo))
    assert new_since(transitions.heartbeat_todo(agent, todo.pk)) == [1]


def test_a_todo_without_follow_ups_costs_no_query_to_answer(agent, make_todo,
                                                           django_assert_num_queries):
    todo = transitions.claim_todo(agent, make_todo().pk)
    with django_assert_num_queries(0):
        assert queries.given_followups(todo) == []


def test_heartbeat_says_cancel_requested(agent, make_todo):
    todo = transitions.claim_todo(agent, make_todo().pk)
    assert transitions.heartbeat_todo(agent, todo.pk).cancel_requested_at is None
    Todo.objects.filter(pk=todo.pk).update(cancel_requested_at=timezone.now())
    beat = transitions.heartbeat_todo(agent, todo.pk)
    assert queries.todo_as_dict(beat)["cancel_requested"] is True


def test_the_holder_cancels_its_todo_with_a_reason_whether_or_not_it_was_asked(agent, endpoint,
                                                                              make_todo):
    asked = transitions.claim_todo(agent, make_todo().pk)
    transitions.request_cancel(asked.pk, actor="octocat", reason="source_closed")
    done = transitions.cancel_held_todo(agent, asked.pk, lease_id=asked.lease_id,
                                        reason="the PR was closed")
    assert done.state == State.CANCELLED and done.cancelled_at and done.lease_id is None
    event = TodoEvent.objects.get(todo_id=asked.pk, action="cancel")
    assert (event.from_state, event.to_state, event.actor) == ("claimed", "cancelled", "session-a")
    assert event.detail == {"reason": "the PR was closed", "cancel_requested": True,
                            "by_holder": True}
    unasked = transitions.claim_todo(agent, make_todo().pk)
    transitions.cancel_held_todo(agent, unasked.pk)
    assert TodoEvent.objects.get(todo_id=unasked.pk, action="cancel").detail == {"by_holder": True}
    with pytest.raises(transitions.Refusal) as again:
        transitions.cancel_held_todo(agent, unasked.pk)
    assert again.value.code == "lease_lost"


def test_only_the_holder_may_cancel(agent, endpoint, make_todo):
    todo = transitions.claim_todo(agent, make_todo().pk)
    other = transitions.Caller.agent(endpoint, "session-b")
    for attempt in (lambda: transitions.cancel_held_todo(other, todo.pk),
                    lambda: transitions.cancel_held_todo(agent, todo.pk, lease_id="not-it"),
                    lambda: transitions.cancel_held_todo(agent, make_todo().pk)):
        with pytest.raises(transitions.Refusal) as refused:
            attempt()
        assert refused.value.code == "lease_lost"
    with pytest.raises(transitions.Refusal) as bad:
        transitions.cancel_held_todo(agent, todo.pk, reason=7)
    assert bad.value.code == "invalid_argument"
    assert Todo.objects.get(pk=todo.pk).state == State.CLAIMED


def test_a_lapsed_lease_asked_to_stop_is_cancelled_never_retried(agent, endpoint, make_todo):
    now = timezone.now()
    stopping = transitions.claim_todo(agent, make_todo().pk, lease_ttl_seconds=5, now=now)
    last_try = make_todo()
    Todo.objects.filter(pk=last_try.pk).update(max_attempts=1)
    last_try = transitions.claim_todo(agent, last_try.pk, lease_ttl_seconds=5, now=now)
    plain = transitions.claim_todo(agent, make_todo().pk, lease_ttl_seconds=5, now=now)
    Todo.objects.filter(pk__in=[stopping.pk, last_try.pk]).update(cancel_requested_at=now)
    assert sweeps.expire_lapsed_leases(now=now + timedelta(seconds=10)) == 3
    states = {todo.pk: todo for todo in Todo.objects.filter(pk__in=[stopping.pk, last_try.pk,
                                                                    plain.pk])}
    for pk in (stopping.pk, last_try.pk):
        assert states[pk].state == State.CANCELLED and states[pk].cancelled_at is not None
        assert states[pk].dead_lettered_at is None and states[pk].retry_at is None
        event = TodoEvent.objects.get(todo_id=pk, to_state=State.CANCELLED)
        assert (event.action, event.actor, event.detail) == (
            "cancel", "reaper", {"reason": "cancel_requested"})
    assert states[plain.pk].state == State.PENDING
    assert TodoEvent.objects.get(todo_id=plain.pk, action="lease_lapsed").detail == {}


@pytest.mark.parametrize("by", ["holder", "operator"])
def test_releasing_a_todo_asked_to_stop_cancels_it(agent, endpoint, make_todo, published,
                                                   django_capture_on_commit_callbacks, by):
    held = transitions.claim_todo(agent, make_todo().pk)
    transitions.request_cancel(held.pk, actor="alice")
    operator = transitions.Caller.operator(endpoint, "alice")
    with django_capture_on_commit_callbacks(execute=True):
        if by == "holder":
            released = transitions.release_todo(agent, held.pk, lease_id=held.lease_id)
        else:
            released = transitions.release_todo(operator, held.pk,
                                                overriding=transitions.HeldLease.of(held))
    assert released.state == State.CANCELLED and released.cancelled_at is not None
    assert released.lease_id is None
    event = TodoEvent.objects.filter(todo_id=held.pk).latest("id")
    assert (event.action, event.from_state, event.to_state, event.detail["reason"]) == (
        "cancel", "claimed", "cancelled", "cancel_requested")
    assert published[-1]["action"] == "cancel"
    # Nobody takes it up again.
    with pytest.raises(transitions.Refusal):
        transitions.claim_todo(agent, held.pk)


def test_releasing_a_todo_not_asked_to_stop_still_returns_it(agent, make_todo):
    held = transitions.claim_todo(agent, make_todo().pk)
    released = transitions.release_todo(agent, held.pk, lease_id=held.lease_id)
    assert released.state == State.PENDING and released.cancelled_at is None
    assert TodoEvent.objects.filter(todo_id=held.pk).latest("id").detail == {}


def test_list_todos_filters_by_thread(agent, make_todo):
    ours = [on_thread(make_todo(), "octo/repo#12") for _ in range(3)]
    on_thread(make_todo(), "octo/repo#13")
    make_todo()
    page, cursor = queries.list_todos(agent, thread="octo/repo#12", limit=2)
    rest, end = queries.list_todos(agent, thread="octo/repo#12", limit=2, cursor=cursor)
    assert [t.pk for t in page + rest] == [t.pk for t in ours] and end is None
    with pytest.raises(ValueError):
        queries.list_todos(agent, limit=2, cursor=cursor)  # another listing's cursor
    assert [t.thread for t in queries.list_todos(agent)[0]].count(None) == 1


def run_threads(count, target):
    errors = []

    def guarded(i):
        try:
            target(i)
        except BaseException as exc:  # surface thread failures in the test
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors


@pytest.mark.django_db(transaction=True)
def test_follow_ups_added_while_two_heartbeats_race_are_each_given_once():
    endpoint = EndpointFactory(owner=UserFactory())
    agent = transitions.Caller.agent(endpoint, "holder")
    now = timezone.now()
    todo = Todo.objects.create(endpoint=endpoint, queue="inbox", title="t", created_at=now,
                               updated_at=now)
    claimed = transitions.claim_todo(agent, todo.pk)
    followups, given = 40, []
    added = threading.Event()

    def work(i):
        if i == 0:
            for n in range(followups):
                add_followup(todo.pk, f"f{n}")
            added.set()
            return
        while True:
            finished = added.is_set()
            beat = transitions.heartbeat_todo(agent, todo.pk, lease_id=claimed.lease_id)
            given.extend(new_since(beat))
            if finished:
                return

    run_threads(3, work)
    assert Counter(given) == {seq: 1 for seq in range(1, followups + 1)}


@pytest.mark.django_db(transaction=True)
def test_cancel_racing_complete_on_a_todo_asked_to_stop_has_one_winner():
    endpoint = EndpointFactory(owner=UserFactory())
    agent = transitions.Caller.agent(endpoint, "holder")
    winners = Counter()
    for round_ in range(10):
        now = timezone.now()
        todo = Todo.objects.create(endpoint=endpoint, queue="inbox", title=f"t{round_}",
                                   created_at=now, updated_at=now)
        lease = transitions.claim_todo(agent, todo.pk).lease_id
        Todo.objects.filter(pk=todo.pk).update(cancel_requested_at=now)
        barrier = threading.Barrier(2)
        outcomes = {}

        def settle(i):
            barrier.wait()
            verb = transitions.cancel_held_todo if i == 0 else transitions.complete_todo
            try:
                outcomes[i] = verb(agent, todo.pk, lease_id=lease).state
            except transitions.Refusal as refusal:
                outcomes[i] = refusal.code

        run_threads(2, settle)
        final = Todo.objects.get(pk=todo.pk).state
        assert sorted(outcomes.values()) in (["cancelled", "lease_lost"],
                                             ["done", "lease_lost"]), outcomes
        assert final in (State.CANCELLED, State.DONE)
        assert TodoEvent.objects.filter(todo_id=todo.pk,
                                        action__in=("cancel", "complete")).count() == 1
        winners[final] += 1
    assert sum(winners.values()) == 10
