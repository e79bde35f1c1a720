"""Priority and scheduled todos (docs/work-control.md): the transitions, the claim order, the
due sweep, and the refusals."""

from datetime import timedelta

import pytest
from django.utils import timezone

from todos import sweeps, transitions
from todos.models import Todo, TodoEvent
from todos.transitions import Caller, Refusal

pytestmark = pytest.mark.django_db


def test_claim_next_takes_the_highest_priority_first_then_the_oldest(agent, make_todo):
    now = timezone.now()
    low = make_todo(priority=-5, now=now)
    old = make_todo(now=now + timedelta(seconds=1))
    young = make_todo(now=now + timedelta(seconds=2))
    urgent = make_todo(priority=50, now=now + timedelta(seconds=3))
    order = [transitions.claim_next_todo(agent, now=now).pk for _ in range(4)]
    assert order == [urgent.pk, old.pk, young.pk, low.pk]


def test_claim_next_over_a_list_of_queues_merges_the_heads_by_priority(endpoint, make_todo):
    endpoint.scope = ["a", "b"]
    endpoint.save()
    agent = Caller.agent(endpoint, "session-a")
    now = timezone.now()
    a_old = make_todo("a", now=now)
    b_urgent = make_todo("b", priority=10, now=now + timedelta(seconds=1))
    a_urgent = make_todo("a", priority=10, now=now + timedelta(seconds=2))
    order = [transitions.claim_next_todo(agent, queues=["a", "b"], now=now).pk for _ in range(3)]
    assert order == [b_urgent.pk, a_urgent.pk, a_old.pk]


def test_a_scheduled_todo_is_pending_but_not_claimable_until_due(agent, make_todo):
    now = timezone.now()
    later = make_todo(not_before=now + timedelta(minutes=5), priority=100, now=now)
    assert later.state == "pending" and later.not_before == now + timedelta(minutes=5)
    assert transitions.claim_next_todo(agent, now=now) is None
    with pytest.raises(Refusal) as refused:
        transitions.claim_todo(agent, later.pk, now=now)
    assert refused.value.code == "scheduled"
    assert "not before" in refused.value.message


def test_a_due_todo_is_claimable_by_id_before_the_sweep_clears_it(agent, make_todo):
    now = timezone.now()
    todo = make_todo(not_before=now + timedelta(minutes=5), now=now)
    claimed = transitions.claim_todo(agent, todo.pk, now=now + timedelta(minutes=6))
    assert claimed.state == "claimed" and claimed.not_before is None


# Announcements leave after commit: real transactions.
@pytest.mark.django_db(transaction=True)
def test_the_due_sweep_readies_due_todos_once_and_announces_them_as_ready(
        agent, make_todo, published):
    now = timezone.now()
    due = make_todo(not_before=now + timedelta(seconds=30), now=now)
    not_yet = make_todo(not_before=now + timedelta(hours=2), now=now)
    assert [c["scheduled"] for c in published] == [True, True]
    assert sweeps.release_due_scheduled_todos(now=now + timedelta(seconds=31)) == 1
    assert sweeps.release_due_scheduled_todos(now=now + timedelta(seconds=32)) == 0
    assert published[-1] == {**published[-1], "action": "due", "todo_id": str(due.pk),
                             "state": "pending", "scheduled": False}
    due.refresh_from_db()
    assert due.not_before is None
    event = TodoEvent.objects.get(todo=due, action="due")
    assert (event.from_state, event.to_state, event.actor) == ("pending", "pending", "scheduler")
    assert transitions.claim_next_todo(agent, now=now).pk == due.pk
    assert transitions.claim_next_todo(agent, now=now) is None
    not_yet.refresh_from_db()
    assert not_yet.not_before is not None


# Announcements leave after commit: real transactions.
@pytest.mark.django_db(transaction=True)
def test_run_now_clears_not_before_and_announces_the_todo_ready(endpoint, make_todo, published):
    now = timezone.now()
    todo = make_todo(not_before=now + timedelta(days=2), now=now)
    operator = Caller.operator(endpoint, "alice")
    ran = transitions.run_now_todo(operator, todo.pk, now=now)
    assert ran.not_before is None and ran.state == "pending"
    assert published[-1]["action"] == "run_now" and not published[-1]["scheduled"]
    event = TodoEvent.objects.get(todo=todo, action="run_now")
    assert event.actor == "alice"
    with pytest.raises(Refusal) as refused:
        transitions.run_now_todo(operator, todo.pk, now=now)
    assert refused.value.code == "not_claimable"


# Announcements leave after commit: real transactions.
@pytest.mark.django_db(transaction=True)
def test_set_priority_changes_the_order_of_a_waiting_todo(agent, endpoint, make_todo, published):
    now = timezone.now()
    first = make_todo(now=now)
    second = make_todo(now=now + timedelta(seconds=1))
    operator = Caller.operator(endpoint, "alice")
    changed = transitions.set_priority_todo(operator, second.pk, 7, now=now)
    assert changed.priority == 7
    event = TodoEvent.objects.get(todo=second, action="prioritize")
    assert (event.from_state, event.to_state, event.actor, event.detail) == (
        "pending", "pending", "alice", {"priority": 7})
    assert published[-1]["action"] == "prioritize"
    assert transitions.claim_next_todo(agent, now=now).pk == second.pk
    assert transitions.claim_next_todo(agent, now=now).pk == first.pk


def test_set_priority_of_a_failed_todo_is_kept_when_it_retries(agent, endpoint, make_todo):
    now = timezone.now()
    todo = make_todo(now=now)
    transitions.claim_todo(agent, todo.pk, now=now)
    transitions.fail_todo(agent, todo.pk, now=now)
    transitions.set_priority_todo(Caller.operator(endpoint, "alice"), todo.pk, -20, now=now)
    sweeps.promote_due_retries(now=now + timedelta(hours=1))
    todo.refresh_from_db()
    assert (todo.state, todo.priority) == ("pending", -20)


@pytest.mark.parametrize("priority", [101, -101, 1.5, True, "5", None])
def test_a_bad_priority_is_invalid_argument_and_writes_nothing(endpoint, make_todo, priority):
    todo = make_todo()
    before = (Todo.objects.count(), TodoEvent.objects.count())
    with pytest.raises(Refusal) as refused:
        transitions.set_priority_todo(Caller.operator(endpoint, "alice"), todo.pk, priority)
    assert refused.value.code == "invalid_argument" and "priority" in refused.value.message
    with pytest.raises(Refusal) as refused:
        make_todo(priority=priority)
    assert refused.value.code == "invalid_argument" and "priority" in refused.value.message
    assert (Todo.objects.count(), TodoEvent.objects.count()) == before
    todo.refresh_from_db()
    assert todo.priority == 0


NOW = timezone.now()


@pytest.mark.parametrize("arguments, field", [
    ({"not_before": (NOW - timedelta(minutes=2)).isoformat()}, "not_before"),
    ({"not_before": (NOW + timedelta(days=31)).isoformat()}, "not_before"),
    ({"not_before": "tomorrow"}, "not_before"),
    ({"not_before": "2030-01-01T09:00:00"}, "not_before"),  # no time zone
    ({"not_before": 12}, "not_before"),
    ({"delay_seconds": -1}, "delay_seconds"),
    ({"delay_seconds": 31 * 86400}, "delay_seconds"),
    ({"delay_seconds": "60"}, "delay_seconds"),
    ({"delay_seconds": True}, "delay_seconds"),
    ({"delay_seconds": 60, "not_before": (NOW + timedelta(hours=1)).isoformat()}, "delay_seconds"),
])
def test_a_bad_schedule_is_invalid_argument_naming_the_field(arguments, field):
    with pytest.raises(Refusal) as refused:
        transitions.resolve_not_before(now=NOW, **arguments)
    assert refused.value.code == "invalid_argument"
    assert field in refused.value.message


def test_a_schedule_resolves_to_a_time_or_to_ready_at_once():
    resolve = transitions.resolve_not_before
    assert resolve(now=NOW) is None
    assert resolve(delay_seconds=0, now=NOW) is None
    assert resolve(delay_seconds=90, now=NOW) == NOW + timedelta(seconds=90)
    assert resolve(not_before=(NOW - timedelta(seconds=30)).isoformat(), now=NOW) is None
    ahead = NOW + timedelta(days=29)
    assert resolve(not_before=ahead.isoformat().replace("+00:00", "Z"), now=NOW) == ahead


@pytest.mark.django_db(transaction=True)
def test_due_sweeps_run_now_and_claims_racing_ready_each_scheduled_todo_once(endpoint):
    """Two due sweeps, an operator's run now and claims by id race over the same scheduled
    todos: each becomes ready exactly once (one due or run_now event), and is claimed once."""
    import threading

    from django.db import connections

    now = timezone.now()
    todos = [transitions.create_todo(endpoint=endpoint, queue="inbox", title=f"t{n}",
                                     actor="test", not_before=now + timedelta(seconds=1),
                                     now=now)[0] for n in range(40)]
    after = now + timedelta(seconds=2)
    operator = Caller.operator(endpoint, "alice")
    errors, claimed = [], []

    def sweep():
        sweeps.release_due_scheduled_todos(now=after)

    def run_now():
        for todo in todos:
            try:
                transitions.run_now_todo(operator, todo.pk, now=after)
            except Refusal as refusal:
                assert refusal.code == "not_claimable"

    def claim(name):
        caller = Caller.agent(endpoint, name)
        for todo in reversed(todos):
            try:
                claimed.append(transitions.claim_todo(caller, todo.pk, now=after).pk)
            except Refusal as refusal:
                assert refusal.code == "not_claimable"

    def guarded(target, *args):
        try:
            target(*args)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=guarded, args=args) for args in
               [(sweep,), (sweep,), (run_now,), (claim, "w1"), (claim, "w2")]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    sweep()  # whatever every racer skipped
    readied = list(TodoEvent.objects.filter(action__in=["due", "run_now"])
                   .values_list("todo_id", flat=True))
    assert len(readied) == len(set(readied))
    assert len(claimed) == len(set(claimed))
    assert not Todo.objects.filter(not_before__isnull=False, state="pending").exists()
    # A todo claimed before any sweep reached it was never "readied": claim clears it itself.
    assert set(readied) | set(claimed) == {todo.pk for todo in todos}
