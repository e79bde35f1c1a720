"""Concurrency caps (docs/work-control.md#caps): an endpoint's ``max_claimed`` and per-queue
``queue_limits`` bound how many of its todos are claimed at once, agents' and operators'
claims alike, and hold under concurrent claims on PostgreSQL."""

import random
import threading

import pytest
from django.core.exceptions import ValidationError
from django.db import connection, connections
from django.utils import timezone

from tests.factories import EndpointFactory, UserFactory
from todos import transitions
from todos.models import State, Todo
from todos.tests.test_concurrency import bulk_create_todos, run_threads


def capped(**caps):
    return EndpointFactory(owner=UserFactory(), **caps)


def make(endpoint, queue="inbox", count=1):
    return [transitions.create_todo(endpoint=endpoint, queue=queue, title=f"{queue} {i}",
                                    actor="test")[0] for i in range(count)]


def claimed_count(endpoint, queue=None):
    todos = Todo.objects.filter(endpoint=endpoint, state=State.CLAIMED)
    return (todos.filter(queue=queue) if queue else todos).count()


@pytest.mark.django_db
def test_claim_next_at_the_endpoints_cap_answers_at_capacity_and_claims_nothing():
    endpoint = capped(max_claimed=2)
    make(endpoint, count=3)
    agent = transitions.Caller.agent(endpoint, "s-1")
    first = transitions.claim_next_todo(agent)
    transitions.claim_next_todo(agent)
    with pytest.raises(transitions.Refusal) as refused:
        transitions.claim_next_todo(agent)
    assert refused.value.code == "at_capacity"
    assert claimed_count(endpoint) == 2
    # A claim that settles frees its slot.
    transitions.complete_todo(agent, first.pk, lease_id=first.lease_id)
    assert transitions.claim_next_todo(agent) is not None
    assert claimed_count(endpoint) == 2


@pytest.mark.django_db
def test_claim_next_with_nothing_pending_at_the_cap_is_plainly_empty():
    endpoint = capped(max_claimed=1)
    make(endpoint)
    agent = transitions.Caller.agent(endpoint, "s-1")
    transitions.claim_next_todo(agent)
    assert transitions.claim_next_todo(agent) is None


@pytest.mark.django_db
def test_a_full_queue_is_skipped_and_the_other_queues_still_hand_out_work():
    endpoint = capped(queue_limits={"deploys": 1})
    make(endpoint, "deploys", 2)
    make(endpoint, "inbox", 1)
    agent = transitions.Caller.agent(endpoint, "s-1")
    assert transitions.claim_next_todo(agent).queue == "deploys"  # oldest first
    assert transitions.claim_next_todo(agent).queue == "inbox"  # deploys is at its cap
    with pytest.raises(transitions.Refusal) as refused:
        transitions.claim_next_todo(agent)
    assert refused.value.code == "at_capacity"
    with pytest.raises(transitions.Refusal) as refused:
        transitions.claim_next_todo(agent, queues=["deploys"])
    assert refused.value.code == "at_capacity"
    assert claimed_count(endpoint, "deploys") == 1


@pytest.mark.django_db
def test_claim_by_id_at_the_cap_is_refused_at_capacity_and_operator_claims_count():
    endpoint = capped(max_claimed=1)
    first, second = make(endpoint, count=2)
    operator = transitions.Caller.operator(endpoint, "alice")
    transitions.claim_todo(operator, first.pk)
    agent = transitions.Caller.agent(endpoint, "s-1")
    with pytest.raises(transitions.Refusal) as refused:
        transitions.claim_todo(agent, second.pk)
    assert refused.value.code == "at_capacity"
    with pytest.raises(transitions.Refusal) as refused:
        transitions.claim_todo(operator, second.pk)
    assert refused.value.code == "at_capacity"
    assert Todo.objects.get(pk=second.pk).state == State.PENDING


@pytest.mark.django_db
def test_a_lapsed_lease_frees_its_slot():
    endpoint = capped(max_claimed=1)
    make(endpoint, count=2)
    agent = transitions.Caller.agent(endpoint, "s-1")
    now = timezone.now()
    held = transitions.claim_next_todo(agent, lease_ttl_seconds=1, now=now)
    later = now + timezone.timedelta(seconds=5)
    assert [t.pk for t in transitions.return_lapsed_leases(now=later, limit=10)] == [held.pk]
    assert transitions.claim_next_todo(agent, now=later) is not None


@pytest.mark.django_db
def test_a_cap_lowered_below_the_claimed_count_holds_claims_until_enough_settle():
    endpoint = capped(max_claimed=3)
    make(endpoint, count=4)
    agent = transitions.Caller.agent(endpoint, "s-1")
    held = [transitions.claim_next_todo(agent) for _ in range(3)]
    endpoint.max_claimed = 1
    endpoint.save()
    transitions.complete_todo(agent, held[0].pk, lease_id=held[0].lease_id)
    with pytest.raises(transitions.Refusal):
        transitions.claim_next_todo(agent)
    for todo in held[1:]:
        transitions.release_todo(agent, todo.pk, lease_id=todo.lease_id)
    assert transitions.claim_next_todo(agent) is not None
    assert claimed_count(endpoint) == 1


@pytest.mark.django_db
def test_a_cap_of_zero_holds_every_claim():
    endpoint = capped(queue_limits={"inbox": 0})
    make(endpoint)
    with pytest.raises(transitions.Refusal) as refused:
        transitions.claim_next_todo(transitions.Caller.agent(endpoint, "s-1"))
    assert refused.value.code == "at_capacity"


@pytest.mark.django_db
def test_uncapped_endpoints_claim_with_the_statement_unchanged():
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    endpoint = capped()
    make(endpoint)
    with CaptureQueriesContext(connection) as captured:
        assert transitions.claim_next_todo(transitions.Caller.agent(endpoint, "s-1")) is not None
    claims = [q["sql"] for q in captured.captured_queries if "todos_todo" in q["sql"]]
    assert claims and not any("endpoint_claim_fits" in sql or "c.state = 'claimed'" in sql
                              for sql in claims)


@pytest.mark.parametrize("field,caps", [
    ("max_claimed", {"max_claimed": -1}),
    ("queue_limits", {"queue_limits": {"deploys": -2}}),
    ("queue_limits", {"queue_limits": {"bad name!": 1}}),
    ("queue_limits", {"queue_limits": ["deploys"]}),
])
@pytest.mark.django_db
def test_a_bad_cap_is_refused_naming_its_field(field, caps):
    endpoint = EndpointFactory.build(owner=UserFactory(), **caps)
    with pytest.raises(ValidationError) as refused:
        endpoint.full_clean()
    assert field in refused.value.message_dict


# -- under concurrency (PostgreSQL) ---------------------------------------------------------------

THREADS = 16
CLAIMS_PER_THREAD = 500
CAP = 3


@pytest.mark.django_db(transaction=True)
# Eight thousand claims through one cap lock: beside a loaded parallel pass it outlasted the
# test timeout, so it runs in the serial pass, on its own.
@pytest.mark.serial
def test_sixteen_threads_claiming_500_times_never_hold_more_than_the_cap():
    """Agents claim_next, two threads are operators claiming by id; every claim is completed or
    released at once. A sampler counts the claimed todos throughout from its own connection,
    and each worker counts again right after each of its claims committed."""
    if connection.vendor != "postgresql":
        pytest.skip("the race is PostgreSQL's; SQLite's single writer serializes claims")
    endpoint = capped(max_claimed=CAP)
    bulk_create_todos(endpoint, THREADS * CLAIMS_PER_THREAD)
    done = threading.Event()
    samples, seen_after_claim, outcomes = [], [], {"claimed": 0, "at_capacity": 0}
    lock = threading.Lock()

    def sample():
        try:
            while not done.is_set():
                samples.append(claimed_count(endpoint))
        finally:
            connections.close_all()

    def work(i):
        operator = i < 2
        caller = (transitions.Caller.operator(endpoint, f"op-{i}") if operator
                  else transitions.Caller.agent(endpoint, f"worker-{i}"))
        rng = random.Random(i)
        for _ in range(CLAIMS_PER_THREAD):
            try:
                if operator:
                    offset = rng.randrange(16)
                    candidate = Todo.objects.filter(endpoint=endpoint, state=State.PENDING) \
                        .order_by("created_at", "id").values_list("pk", flat=True)[offset]
                    todo = transitions.claim_todo(caller, candidate)
                else:
                    todo = transitions.claim_next_todo(caller)
            except transitions.Refusal as refusal:
                assert refusal.code in ("at_capacity", "not_claimable"), refusal.code
                with lock:
                    outcomes["at_capacity"] += refusal.code == "at_capacity"
                continue
            assert todo is not None
            seen_after_claim.append(claimed_count(endpoint))
            with lock:
                outcomes["claimed"] += 1
            if rng.random() < 0.5:
                transitions.complete_todo(caller, todo.pk, lease_id=todo.lease_id)
            else:
                transitions.release_todo(caller, todo.pk, lease_id=todo.lease_id)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        run_threads(THREADS, work)
    finally:
        done.set()
        sampler.join()
    assert max(samples) <= CAP and max(seen_after_claim) <= CAP
    # The cap was reached and pressed against, not merely never approached.
    assert max(samples + seen_after_claim) == CAP
    assert outcomes["at_capacity"] > 0 and outcomes["claimed"] > THREADS
    assert claimed_count(endpoint) == 0


@pytest.mark.django_db(transaction=True)
def test_eight_threads_never_hold_more_than_a_queues_cap():
    if connection.vendor != "postgresql":
        pytest.skip("the race is PostgreSQL's; SQLite's single writer serializes claims")
    endpoint = capped(queue_limits={"deploys": 1, "inbox": 2})
    bulk_create_todos(endpoint, 1200, queues=("deploys", "inbox", "other"))
    done = threading.Event()
    samples = []

    def sample():
        try:
            while not done.is_set():
                samples.append((claimed_count(endpoint, "deploys"), claimed_count(endpoint, "inbox")))
        finally:
            connections.close_all()

    def work(i):
        caller = transitions.Caller.agent(endpoint, f"worker-{i}")
        for _ in range(150):
            try:
                todo = transitions.claim_next_todo(caller)
            except transitions.Refusal:
                continue
            if todo is not None:
                transitions.complete_todo(caller, todo.pk, lease_id=todo.lease_id)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        run_threads(8, work)
    finally:
        done.set()
        sampler.join()
    assert max(d for d, _ in samples) <= 1 and max(n for _, n in samples) <= 2
    assert Todo.objects.filter(endpoint=endpoint, state=State.DONE, queue="deploys").exists()


EMBEDDED_CAPS_SCRIPT = """
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from tests.factories import EndpointFactory, UserFactory
from todos import transitions

def refused(call):
    try:
        call()
    except transitions.Refusal as refusal:
        return refusal.code
    return "claimed"

endpoint = EndpointFactory(owner=UserFactory(), max_claimed=2, queue_limits={"deploys": 0})
for queue in ("inbox", "inbox", "inbox", "deploys"):
    transitions.create_todo(endpoint=endpoint, queue=queue, title=queue, actor="test")
agent = transitions.Caller.agent(endpoint, "s-1")
deploy = endpoint.todos.get(queue="deploys")
print(refused(lambda: transitions.claim_todo(agent, deploy.pk)))
print(refused(lambda: transitions.claim_next_todo(agent)))
print(refused(lambda: transitions.claim_next_todo(agent)))
print(refused(lambda: transitions.claim_next_todo(agent)))
print(endpoint.todos.filter(state="claimed").count())
"""


def test_caps_hold_on_the_embedded_sqlite_database(tmp_path):
    """The embedded mode's guard is a sub-select (SQLite's single writer serializes claims):
    the endpoint's cap and a queue's cap of 0 with nothing claimed yet both hold."""
    import subprocess

    from tests.processes import PYTHON, ROOT
    from tests.test_embedded import embedded_env

    env = embedded_env(tmp_path)
    env["DJANGO_SETTINGS_MODULE"] = "switchboard.settings"
    run = subprocess.run([PYTHON, "-c", EMBEDDED_CAPS_SCRIPT], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["at_capacity", "claimed", "claimed", "at_capacity", "2"]
