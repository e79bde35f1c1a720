"""Every transition and every refusal of the todo lifecycle (CONTRACT §4), on the configured
database (PostgreSQL in CI; the SQLite run of .ci covers the embedded path)."""

from datetime import timedelta

import pytest
from django.utils import timezone

from switchboard import json_input
from tests.factories import EndpointFactory
from todos import queries, sweeps, transitions
from todos.models import State, Todo, TodoEvent
from todos.transitions import Caller, Refusal

pytestmark = pytest.mark.django_db


def refusal_code(call, *args, **kwargs):
    with pytest.raises(Refusal) as info:
        call(*args, **kwargs)
    return info.value.code


def history(todo):
    return list(
        TodoEvent.objects.filter(todo=todo).order_by("id").values_list("action", "from_state", "to_state")
    )


# -- create and idempotency ---------------------------------------------------------------------


def test_create_makes_a_pending_todo_with_its_event(agent, make_todo):
    todo = make_todo("inbox", "  fix   the\nbuild  ", payload={"n": 1}, kind="issues.opened")
    assert todo.state == State.PENDING
    assert todo.title == "fix the build"  # one line
    assert todo.payload == {"n": 1}
    assert todo.max_attempts == agent.endpoint.max_attempts
    assert history(todo) == [("create", None, "pending")]


def test_same_idempotency_key_returns_the_live_todo(endpoint, make_todo):
    first = make_todo(idempotency_key="hook:1")
    again, created = transitions.create_todo(
        endpoint=endpoint, queue="inbox", title="again", actor="t", idempotency_key="hook:1"
    )
    assert not created and again.pk == first.pk
    assert Todo.objects.count() == 1


def test_idempotency_key_is_per_endpoint(endpoint, make_todo):
    other = EndpointFactory(slug="other", owner=endpoint.owner)
    a = make_todo(idempotency_key="k")
    b = make_todo(idempotency_key="k", on=other)
    assert a.pk != b.pk


@pytest.mark.parametrize("finish", ["complete", "dead_letter"])
def test_key_is_free_again_once_done_or_dead(agent, endpoint, make_todo, finish):
    endpoint.max_attempts = 1
    endpoint.save()
    first = make_todo(idempotency_key="k")
    transitions.claim_todo(agent, first.pk)
    if finish == "complete":
        transitions.complete_todo(agent, first.pk)
    else:
        assert transitions.fail_todo(agent, first.pk).is_dead_letter
    second = make_todo(idempotency_key="k")
    assert second.pk != first.pk and second.state == State.PENDING


def test_key_stays_taken_while_failed_waiting_to_retry(agent, make_todo):
    first = make_todo(idempotency_key="k")
    transitions.claim_todo(agent, first.pk)
    transitions.fail_todo(agent, first.pk, error="flaky")
    assert make_todo(idempotency_key="k").pk == first.pk


# -- claim ---------------------------------------------------------------------------------------


def test_claim_sets_a_fresh_lease_and_counts_an_attempt(agent, make_todo):
    now = timezone.now()
    todo = transitions.claim_todo(agent, make_todo().pk, now=now)
    assert todo.state == State.CLAIMED
    assert todo.attempts == 1
    assert todo.lease_owner == "session-a"
    assert len(todo.lease_id) >= 16
    assert todo.lease_expires_at == now + timedelta(seconds=300)


def test_claim_uses_lease_ttl_or_the_endpoint_default(agent, endpoint, make_todo):
    now = timezone.now()
    assert transitions.claim_todo(agent, make_todo().pk, lease_ttl_seconds=5, now=now
                                  ).lease_expires_at == now + timedelta(seconds=5)
    endpoint.default_lease_seconds = 42
    endpoint.save()
    assert transitions.claim_todo(agent, make_todo().pk, now=now
                                  ).lease_expires_at == now + timedelta(seconds=42)


@pytest.mark.parametrize("ttl", [0, 0.5, -1, 86401, "60", True, None.__class__, float("nan"),
                                 float("inf"), 10**30])
def test_lease_ttl_outside_one_second_to_a_day_is_refused(agent, make_todo, ttl):
    todo = make_todo()
    assert refusal_code(transitions.claim_todo, agent, todo.pk, lease_ttl_seconds=ttl) == "invalid_argument"
    assert refusal_code(transitions.claim_next_todo, agent, lease_ttl_seconds=ttl) == "invalid_argument"
    assert Todo.objects.get(pk=todo.pk).state == State.PENDING


@pytest.mark.parametrize("ttl", [1, 86400])
def test_lease_ttl_bounds_are_inclusive(agent, make_todo, ttl):
    assert transitions.claim_todo(agent, make_todo().pk, lease_ttl_seconds=ttl).state == State.CLAIMED


def test_claim_of_claimed_or_done_todo_is_not_claimable(agent, make_todo):
    todo = make_todo()
    transitions.claim_todo(agent, todo.pk)
    other = Caller.agent(agent.endpoint, "session-b")
    assert refusal_code(transitions.claim_todo, other, todo.pk) == "not_claimable"
    transitions.complete_todo(agent, todo.pk)
    assert refusal_code(transitions.claim_todo, other, todo.pk) == "not_claimable"


@pytest.mark.parametrize("todo_id", [999999, "nope", -3, None, 2**70, " 1", "\u0661", "1.0", True,
                                     "9" * 30])
def test_unknown_todo_is_not_found(agent, todo_id):
    assert refusal_code(transitions.claim_todo, agent, todo_id) == "not_found"
    assert refusal_code(transitions.complete_todo, agent, todo_id) == "not_found"


def test_todo_outside_endpoint_or_scope_looks_missing(agent, endpoint, make_todo):
    other = EndpointFactory(slug="other", owner=endpoint.owner)
    foreign = make_todo(on=other)
    assert refusal_code(transitions.claim_todo, agent, foreign.pk) == "not_found"
    endpoint.scope = ["inbox"]
    endpoint.save()
    narrow = Caller.agent(endpoint, "s")
    hidden = make_todo("secret-queue")
    assert refusal_code(transitions.claim_todo, narrow, hidden.pk) == "not_found"
    assert refusal_code(transitions.complete_todo, narrow, hidden.pk) == "not_found"
    assert transitions.claim_next_todo(narrow) is None


def test_claim_next_takes_oldest_first_across_granted_queues(agent, make_todo):
    now = timezone.now()
    b = make_todo("b", now=now - timedelta(seconds=5))
    a = make_todo("a", now=now - timedelta(seconds=10))
    c = make_todo("c", now=now - timedelta(seconds=1))
    order = [transitions.claim_next_todo(agent).pk for _ in range(3)]
    assert order == [a.pk, b.pk, c.pk]
    assert transitions.claim_next_todo(agent) is None


def test_claim_next_with_a_list_of_queues_keeps_age_order(endpoint, make_todo):
    endpoint.scope = ["a", "b", "c"]
    endpoint.save()
    caller = Caller.agent(endpoint, "s")
    now = timezone.now()
    ids = {}
    for i, queue in enumerate(["b", "a", "c", "a", "b"]):
        ids[i] = make_todo(queue, f"t{i}", now=now + timedelta(seconds=i)).pk
    got = [transitions.claim_next_todo(caller).pk for _ in range(5)]
    assert got == [ids[i] for i in range(5)]


def test_claim_next_subset_and_out_of_scope_queues(endpoint, make_todo):
    endpoint.scope = ["a", "b"]
    endpoint.save()
    caller = Caller.agent(endpoint, "s")
    make_todo("a")
    only_b = make_todo("b")
    assert transitions.claim_next_todo(caller, queues=["b"]).pk == only_b.pk
    assert refusal_code(transitions.claim_next_todo, caller, queues=["b", "zzz"]) == "not_in_scope"
    assert refusal_code(transitions.claim_next_todo, caller, queues=[]) == "invalid_argument"
    assert refusal_code(transitions.claim_next_todo, caller, queues="a") == "invalid_argument"


def test_claim_next_empty_is_none_not_an_error(agent):
    assert transitions.claim_next_todo(agent) is None


# -- fenced verbs --------------------------------------------------------------------------------


def test_heartbeat_extends_only_the_current_lease(agent, make_todo):
    now = timezone.now()
    todo = transitions.claim_todo(agent, make_todo().pk, now=now)
    later = now + timedelta(seconds=100)
    extended = transitions.heartbeat_todo(agent, todo.pk, lease_id=todo.lease_id,
                                          lease_ttl_seconds=600, now=later)
    assert extended.lease_expires_at == later + timedelta(seconds=600)
    assert extended.lease_id == todo.lease_id and extended.attempts == 1
    by_owner = transitions.heartbeat_todo(agent, todo.pk, now=later)  # no lease_id: by session
    assert by_owner.lease_expires_at == later + timedelta(seconds=600)  # the lease's own length
    stranger = Caller.agent(agent.endpoint, "session-b")
    assert refusal_code(transitions.heartbeat_todo, stranger, todo.pk) == "lease_lost"
    assert refusal_code(transitions.heartbeat_todo, agent, todo.pk, lease_id="forged") == "lease_lost"


def test_stale_holder_after_reaper_and_reclaim_gets_lease_lost(agent, make_todo):
    now = timezone.now()
    stale = transitions.claim_todo(agent, make_todo().pk, lease_ttl_seconds=10, now=now)
    assert sweeps.expire_lapsed_leases(now=now + timedelta(seconds=11)) == 1
    for verb in (transitions.heartbeat_todo, transitions.complete_todo, transitions.fail_todo,
                 transitions.release_todo):
        assert refusal_code(verb, agent, stale.pk, lease_id=stale.lease_id) == "lease_lost"
    other = Caller.agent(agent.endpoint, "session-b")
    fresh = transitions.claim_todo(other, stale.pk, now=now + timedelta(seconds=12))
    # Same session, old lease id: fenced by lease id.
    assert refusal_code(transitions.complete_todo, agent, stale.pk, lease_id=stale.lease_id) == "lease_lost"
    # Same session name without lease id would not match the new owner either.
    assert refusal_code(transitions.complete_todo, agent, stale.pk) == "lease_lost"
    assert transitions.complete_todo(other, fresh.pk, lease_id=fresh.lease_id).state == State.DONE


def test_heartbeat_without_a_ttl_never_shortens_the_lease(agent, endpoint, make_todo):
    """Issue 13.1: on a 60 s endpoint, heartbeat(ttl 3600) then heartbeat() moved expiry from
    +1 h to +60 s, and an agent heartbeating every 30 min lost its todo mid-flight."""
    endpoint.default_lease_seconds = 60
    endpoint.save()
    now = timezone.now()
    todo = transitions.claim_todo(agent, make_todo().pk, now=now)
    assert todo.lease_expires_at == now + timedelta(seconds=60)
    long = transitions.heartbeat_todo(agent, todo.pk, lease_ttl_seconds=3600, now=now)
    assert long.lease_expires_at == now + timedelta(hours=1)
    half_hour = now + timedelta(minutes=30)
    again = transitions.heartbeat_todo(agent, todo.pk, now=half_hour)
    assert again.lease_expires_at == half_hour + timedelta(hours=1)
    # Claimed for an hour: heartbeats without a ttl extend by the hour it was granted.
    claimed_long = transitions.claim_todo(agent, make_todo().pk, lease_ttl_seconds=3600, now=now)
    beat = transitions.heartbeat_todo(agent, claimed_long.pk, lease_id=claimed_long.lease_id,
                                      now=half_hour)
    assert beat.lease_expires_at == half_hour + timedelta(hours=1)
    # Asking for a shorter ttl is the one way to shorten it, and it becomes the lease's length.
    short = transitions.heartbeat_todo(agent, todo.pk, lease_ttl_seconds=10, now=half_hour)
    assert short.lease_expires_at == half_hour + timedelta(seconds=10)
    after = transitions.heartbeat_todo(agent, todo.pk, now=half_hour + timedelta(seconds=5))
    assert after.lease_expires_at == half_hour + timedelta(seconds=15)
    assert Todo.objects.get(pk=todo.pk).lease_expires_at == after.lease_expires_at


@pytest.mark.parametrize("verb", ["heartbeat", "complete", "fail", "release"])
@pytest.mark.parametrize("by_lease_id", [True, False])
def test_a_lapsed_lease_is_lost_before_the_reaper_runs(agent, make_todo, verb, by_lease_id):
    """Issue 13.2: a claim of 1 s, 1.3 s later heartbeat revived it, complete marked it done
    and release refunded the attempt, all before the reaper ran."""
    now = timezone.now()
    todo = transitions.claim_todo(agent, make_todo().pk, lease_ttl_seconds=1, now=now)
    events = TodoEvent.objects.filter(todo=todo).count()
    call = getattr(transitions, f"{verb}_todo")
    lease = {"lease_id": todo.lease_id} if by_lease_id else {}
    with pytest.raises(Refusal) as refused:
        call(agent, todo.pk, now=now + timedelta(seconds=1.3), **lease)
    assert refused.value.code == "lease_lost" and "lapsed" in refused.value.message
    row = Todo.objects.get(pk=todo.pk)
    assert row.state == State.CLAIMED and row.attempts == 1  # untouched: the reaper moves it
    assert TodoEvent.objects.filter(todo=todo).count() == events
    # Exactly at expiry the lease is already gone (the reaper takes lease_expires_at <= now).
    with pytest.raises(Refusal):
        call(agent, todo.pk, now=now + timedelta(seconds=1), **lease)
    assert sweeps.expire_lapsed_leases(now=now + timedelta(seconds=2)) == 1
    assert history(todo)[-1] == ("lease_lapsed", "claimed", "pending")


def test_completing_twice_with_the_same_lease_is_already_done(agent, make_todo):
    """Issue 13.4: a complete retried after a network error was told lease_lost."""
    todo = transitions.claim_todo(agent, make_todo().pk)
    transitions.complete_todo(agent, todo.pk, lease_id=todo.lease_id, result={"n": 1})
    assert refusal_code(transitions.complete_todo, agent, todo.pk,
                        lease_id=todo.lease_id) == "already_done"
    assert refusal_code(transitions.complete_todo, agent, todo.pk) == "already_done"  # by session
    stranger = Caller.agent(agent.endpoint, "session-b")
    assert refusal_code(transitions.complete_todo, stranger, todo.pk) == "lease_lost"
    assert refusal_code(transitions.complete_todo, agent, todo.pk, lease_id="forged") == "lease_lost"
    assert refusal_code(transitions.heartbeat_todo, agent, todo.pk) == "lease_lost"
    assert Todo.objects.get(pk=todo.pk).result == {"n": 1}
    assert [a for a, *_ in history(todo)] == ["create", "claim", "complete"]


def test_a_done_todo_shows_no_lease_in_the_wire_shape(agent, make_todo):
    todo = transitions.claim_todo(agent, make_todo().pk)
    done = transitions.complete_todo(agent, todo.pk)
    shown = queries.todo_as_dict(done)
    assert shown["lease_id"] is None and shown["lease_owner"] is None
    assert shown["lease_expires_at"] is None


# -- operator overrides (issue 13.3) ----------------------------------------------------------


def override(verb, todo, **kwargs):
    operator = Caller.operator(todo.endpoint, "alice")
    call = getattr(transitions, f"{verb}_todo")
    return call(operator, todo.pk, overriding=transitions.HeldLease.of(todo), **kwargs)


@pytest.mark.parametrize("verb, state", [("release", State.PENDING), ("fail", State.FAILED),
                                         ("complete", State.DONE)])
def test_an_operator_override_ends_the_agents_lease(agent, make_todo, verb, state):
    held = transitions.claim_todo(agent, make_todo().pk, lease_ttl_seconds=86400)
    changed = override(verb, held)
    assert changed.state == state
    event = TodoEvent.objects.filter(todo=held).order_by("-id").first()
    assert event.actor == "alice" and event.detail["override"] is True
    assert event.detail["overridden_lease"] == {"lease_id": held.lease_id[:8],
                                                "lease_owner": "session-"}
    for late in ("heartbeat", "complete", "fail", "release"):
        for lease in ({"lease_id": held.lease_id}, {}):
            assert refusal_code(getattr(transitions, f"{late}_todo"), agent, held.pk,
                                **lease) == "lease_lost", (late, lease)


def test_an_operator_extends_an_agents_lease_and_the_agent_keeps_it(agent, make_todo):
    now = timezone.now()
    held = transitions.claim_todo(agent, make_todo().pk, lease_ttl_seconds=60, now=now)
    extended = override("heartbeat", held, lease_ttl_seconds=3600, now=now)
    assert extended.lease_expires_at == now + timedelta(hours=1)
    assert extended.lease_id == held.lease_id and extended.lease_owner == "session-a"
    assert TodoEvent.objects.filter(todo=held).order_by("-id").first().detail["override"] is True
    assert transitions.complete_todo(agent, held.pk, lease_id=held.lease_id).state == State.DONE


def test_an_override_acts_on_the_lease_it_saw_or_on_nothing(agent, make_todo):
    seen = transitions.claim_todo(agent, make_todo().pk, lease_ttl_seconds=1)
    transitions.release_todo(agent, seen.pk)
    reclaimed = transitions.claim_todo(Caller.agent(agent.endpoint, "session-b"), seen.pk)
    with pytest.raises(Refusal) as refused:
        override("release", seen)  # the lease the operator saw is gone: a new one holds it
    assert refused.value.code == "lease_lost" and "the agent's lease" in refused.value.message
    assert "session" not in refused.value.message
    assert Todo.objects.get(pk=seen.pk).lease_id == reclaimed.lease_id


def test_an_override_frees_a_lapsed_lease_the_reaper_has_not_moved(agent, make_todo):
    now = timezone.now()
    stuck = transitions.claim_todo(agent, make_todo().pk, lease_ttl_seconds=1, now=now)
    released = override("release", stuck, now=now + timedelta(minutes=5))
    assert released.state == State.PENDING and released.attempts == 0


def test_only_an_operator_overrides(agent, make_todo):
    held = transitions.claim_todo(agent, make_todo().pk)
    other = Caller.agent(agent.endpoint, "session-b")
    with pytest.raises(ValueError):
        transitions.release_todo(other, held.pk, overriding=transitions.HeldLease.of(held))


def test_complete_stores_the_result(agent, make_todo):
    todo = transitions.claim_todo(agent, make_todo().pk)
    done = transitions.complete_todo(agent, todo.pk, lease_id=todo.lease_id, result={"pr": 7})
    assert done.state == State.DONE and done.result == {"pr": 7}
    assert refusal_code(transitions.complete_todo, agent, todo.pk) == "already_done"


def test_fail_schedules_retry_then_dead_letters(agent, endpoint, make_todo):
    endpoint.max_attempts = 2
    endpoint.save()
    now = timezone.now()
    todo = make_todo()
    transitions.claim_todo(agent, todo.pk, now=now)
    failed = transitions.fail_todo(agent, todo.pk, error="boom", result={"log": "x"}, now=now)
    assert failed.state == State.FAILED and failed.last_error == "boom"
    assert failed.retry_at == now + timedelta(seconds=30) and failed.dead_lettered_at is None
    assert sweeps.promote_due_retries(now=now + timedelta(seconds=29)) == 0
    assert sweeps.promote_due_retries(now=now + timedelta(seconds=30)) == 1
    transitions.claim_todo(agent, todo.pk, now=now)
    dead = transitions.fail_todo(agent, todo.pk, error="again", now=now)
    assert dead.is_dead_letter and dead.retry_at is None and dead.dead_lettered_at == now
    assert sweeps.promote_due_retries(now=now + timedelta(days=1)) == 0
    assert [a for a, *_ in history(todo)] == [
        "create", "claim", "fail", "retry", "claim", "dead_letter"]


def test_backoff_doubles_from_30_seconds_and_caps_at_15_minutes(agent, endpoint, make_todo):
    endpoint.max_attempts = 9
    endpoint.save()
    todo = make_todo()
    now = timezone.now()
    backoffs = []
    for _ in range(8):
        transitions.claim_todo(agent, todo.pk, now=now)
        failed = transitions.fail_todo(agent, todo.pk, now=now)
        backoffs.append(int((failed.retry_at - now).total_seconds()))
        now = failed.retry_at
        assert sweeps.promote_due_retries(now=now) == 1
    assert backoffs == [30, 60, 120, 240, 480, 900, 900, 900]


def test_release_returns_to_pending_and_refunds_the_attempt(agent, make_todo):
    todo = transitions.claim_todo(agent, make_todo().pk)
    released = transitions.release_todo(agent, todo.pk, lease_id=todo.lease_id)
    assert released.state == State.PENDING and released.attempts == 0
    assert released.lease_id is None and released.lease_owner is None
    assert refusal_code(transitions.release_todo, agent, todo.pk) == "lease_lost"


def test_invalid_error_argument_is_refused(agent, make_todo):
    todo = transitions.claim_todo(agent, make_todo().pk)
    assert refusal_code(transitions.fail_todo, agent, todo.pk, error={"no": 1}) == "invalid_argument"
    assert Todo.objects.get(pk=todo.pk).state == State.CLAIMED


# -- reaper, promoter, requeue -------------------------------------------------------------------


def test_reaper_returns_lapsed_leases_and_records_the_lapse(agent, make_todo):
    now = timezone.now()
    todo = transitions.claim_todo(agent, make_todo().pk, lease_ttl_seconds=60, now=now)
    assert sweeps.expire_lapsed_leases(now=now + timedelta(seconds=59)) == 0
    assert sweeps.expire_lapsed_leases(now=now + timedelta(seconds=60)) == 1
    back = Todo.objects.get(pk=todo.pk)
    assert back.state == State.PENDING and back.attempts == 1 and back.lease_id is None
    assert history(todo)[-1] == ("lease_lapsed", "claimed", "pending")


def test_fifth_lapse_dead_letters_and_requeue_gives_a_fresh_budget(agent, make_todo):
    now = timezone.now()
    todo = make_todo()
    for attempt in range(1, 6):
        transitions.claim_todo(agent, todo.pk, lease_ttl_seconds=1, now=now)
        now += timedelta(seconds=2)
        assert sweeps.expire_lapsed_leases(now=now) == 1
    dead = Todo.objects.get(pk=todo.pk)
    assert dead.is_dead_letter and dead.attempts == 5 and dead.retry_at is None
    assert history(todo)[-1] == ("lease_lapsed", "claimed", "failed")
    assert refusal_code(transitions.claim_todo, agent, todo.pk) == "not_claimable"
    operator = Caller.operator(agent.endpoint, "alice")
    revived = transitions.requeue_todo(operator, todo.pk)
    assert revived.state == State.PENDING and revived.attempts == 0
    assert revived.dead_lettered_at is None
    assert refusal_code(transitions.requeue_todo, operator, todo.pk) == "not_claimable"


def test_requeue_of_a_dead_letter_whose_key_was_reused_is_a_conflict(agent, endpoint, make_todo):
    endpoint.max_attempts = 1
    endpoint.save()
    dead = make_todo(idempotency_key="k")
    transitions.claim_todo(agent, dead.pk)
    transitions.fail_todo(agent, dead.pk)
    make_todo(idempotency_key="k")
    operator = Caller.operator(endpoint, "alice")
    assert refusal_code(transitions.requeue_todo, operator, dead.pk) == "conflict"
    assert Todo.objects.get(pk=dead.pk).is_dead_letter


def test_operator_caller_sees_all_queues_of_its_endpoint(endpoint, make_todo):
    endpoint.scope = ["inbox"]
    endpoint.save()
    todo = make_todo("elsewhere")
    operator = Caller.operator(endpoint, "alice")
    claimed = transitions.claim_todo(operator, todo.pk)
    assert claimed.lease_owner == "alice"


def test_list_todos_filters_and_caps(agent, make_todo):
    for i in range(3):
        make_todo("a", f"a{i}")
    make_todo("b")
    transitions.claim_next_todo(agent)
    assert len(queries.list_todos(agent, queue="a")[0]) == 3
    assert len(queries.list_todos(agent, state="claimed")[0]) == 1
    assert len(queries.list_todos(agent, limit=2)[0]) == 2


def test_todo_as_dict_has_the_contract_shape(agent, make_todo):
    todo = transitions.claim_todo(agent, make_todo(payload={"x": 1}).pk)
    data = queries.todo_as_dict(todo)
    assert list(data) == [
        "id", "endpoint", "queue", "state", "title", "kind", "source", "trust", "payload",
        "priority", "not_before",
        "attempts", "max_attempts", "lease_id", "lease_owner", "lease_expires_at", "retry_at",
        "dead_lettered_at", "cancelled_at", "result", "last_error", "created_at", "updated_at",
        "usage", "traceparent", "thread", "followup_count", "followups", "cancel_requested"]
    assert data["id"] == str(todo.pk) and data["endpoint"] == "agent"
    assert data["traceparent"] is None  # made outside any delivery
    assert data["lease_expires_at"].endswith("Z")


# -- publishing after commit ---------------------------------------------------------------------


def test_changes_are_published_only_after_commit(agent, make_todo, published,
                                                 django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        todo = make_todo()
        transitions.claim_todo(agent, todo.pk)
    assert published == []  # nothing leaves before commit
    for callback in callbacks:
        callback()
    assert [(c["action"], c["state"]) for c in published] == [("create", "pending"), ("claim", "claimed")]
    assert "payload" not in published[0]


def test_a_duplicate_create_publishes_nothing(endpoint, make_todo, published,
                                              django_capture_on_commit_callbacks):
    make_todo(idempotency_key="k")
    with django_capture_on_commit_callbacks(execute=True):
        make_todo(idempotency_key="k")
    assert published == []


def test_claim_is_one_statement_on_the_hot_path(agent, make_todo, django_assert_max_num_queries):
    from django.db import connection

    make_todo()
    # PostgreSQL: the UPDATE and its event are one statement. SQLite: UPDATE + INSERT, inside
    # a transaction (a SAVEPOINT pair here, since the test itself runs in one).
    postgres = connection.vendor == "postgresql"
    with django_assert_max_num_queries(1 if postgres else 4) as claimed:
        todo = transitions.claim_next_todo(agent)
    # SQLite's complete also deletes the todo's registered rows (operator secrets, CONTRACT
    # §12) as a statement of its own; PostgreSQL folds that into the one statement.
    with django_assert_max_num_queries(1 if postgres else 5) as completed:
        transitions.complete_todo(agent, todo.pk, lease_id=todo.lease_id)
    if postgres:
        # Exactly one, and it is the transition itself: the lean PostgreSQL path still shows
        # up in Django's query log (DEBUG, the test tools).
        for captured in (claimed, completed):
            assert [q["sql"][:28] for q in captured.captured_queries] == ["WITH t AS (UPDATE todos_todo"]


def test_transition_statements_are_prepared_once_per_connection_on_postgresql(agent, make_todo):
    """Planning a claim costs as much as running it; the transitions PREPARE their fixed
    statements (Django alone never would: it disables psycopg's prepared statements)."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("SQLite has no prepared statements to look for; the PostgreSQL pass checks this")
    for _ in range(3):
        make_todo()
        todo = transitions.claim_next_todo(agent)
        transitions.complete_todo(agent, todo.pk, lease_id=todo.lease_id)
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        prepared = [row[0] for row in cursor.fetchall()]
    claims = [sql for sql in prepared if "SET state = 'claimed'" in sql]
    completes = [sql for sql in prepared if "SET state = 'done'" in sql]
    assert len(claims) == 1 and len(completes) == 1, prepared


def test_transitions_return_todos_equal_to_what_the_orm_reads(agent, make_todo):
    """The transitions build their Todo rows on their own path (todos/transitions.py
    _todo_from_row; switchboard/db/statements.py fetch_rows): every field must match the ORM's reading of the row,
    aware datetimes and decoded JSON included, and the instance must behave like a loaded one."""
    from datetime import timezone as dt_timezone

    make_todo(payload={"n": 1, "nested": {"list": [1, "two", None]}})
    claimed = transitions.claim_next_todo(agent)
    done = transitions.complete_todo(agent, claimed.pk, lease_id=claimed.lease_id, result={"ok": True})
    for todo in (claimed, done):
        stored = Todo.objects.get(pk=todo.pk) if todo is done else None
        fields = Todo._meta.concrete_fields
        if stored is not None:
            assert {f.attname: getattr(todo, f.attname) for f in fields} == {
                f.attname: getattr(stored, f.attname) for f in fields}
        assert todo.created_at.utcoffset() == dt_timezone.utc.utcoffset(None)
        assert todo._state.adding is False and todo._state.db == "default"
    assert claimed.payload == {"n": 1, "nested": {"list": [1, "two", None]}}
    assert done.result == {"ok": True} and done.lease_expires_at is None
    assert done.endpoint == agent.endpoint  # related access works on the built instance


@pytest.mark.parametrize("bad, reason", [
    (float("nan"), "not finite"), ({"x": float("inf")}, "not finite"),
    ("nul\x00byte", "NUL"), ({"k\x00": 1}, "NUL"), (["\ud800"], "Unicode"),
])
def test_values_no_database_can_store_are_refused_before_writing(agent, endpoint, make_todo, bad, reason):
    with pytest.raises(Refusal, match=reason) as info:
        transitions.create_todo(endpoint=endpoint, queue="inbox", title="t", actor="t", payload={"v": bad})
    assert info.value.code == "invalid_argument"
    todo = transitions.claim_todo(agent, make_todo().pk)
    assert refusal_code(transitions.complete_todo, agent, todo.pk, result={"v": bad}) == "invalid_argument"
    assert refusal_code(transitions.fail_todo, agent, todo.pk, result=[bad]) == "invalid_argument"
    if isinstance(bad, str):
        assert refusal_code(transitions.fail_todo, agent, todo.pk, error=bad) == "invalid_argument"
    assert Todo.objects.get(pk=todo.pk).state == State.CLAIMED
    assert Todo.objects.count() == 1


def test_absurdly_deep_json_is_refused_not_walked(agent, make_todo):
    deep = []
    for _ in range(json_input.MAX_JSON_DEPTH + 5):
        deep = [deep]
    todo = transitions.claim_todo(agent, make_todo().pk)
    assert refusal_code(transitions.complete_todo, agent, todo.pk, result=deep) == "invalid_argument"


def test_heartbeat_and_overrides_stay_one_statement(agent, make_todo, django_assert_max_num_queries):
    """The amended fences (expiry, the stored lease length, the override's lease) live in the
    one guarded statement: no read before the write."""
    from django.db import connection

    postgres = connection.vendor == "postgresql"
    todo = transitions.claim_todo(agent, make_todo().pk)
    # SQLite reads the follow-up mark inside the write transaction (one more query), which
    # PostgreSQL reads under the row's lock in the same statement.
    with django_assert_max_num_queries(1 if postgres else 5):
        transitions.heartbeat_todo(agent, todo.pk)
    with django_assert_max_num_queries(1 if postgres else 5):
        transitions.heartbeat_todo(agent, todo.pk, lease_id=todo.lease_id, lease_ttl_seconds=60)
    with django_assert_max_num_queries(1 if postgres else 4):
        override("release", todo)
