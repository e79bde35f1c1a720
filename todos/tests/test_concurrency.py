"""Races on purpose: many workers, separate connections, real database (PostgreSQL in the main
run, SQLite in the embedded run), and a worker process killed with SIGKILL mid-lease."""

import subprocess
import threading
import time
from collections import Counter

import pytest
from django.core.management import call_command
from django.db import connections
from django.utils import timezone

from tests.factories import EndpointFactory, UserFactory
from tests.processes import DEADLINE_SECONDS, PYTHON, ROOT, child_env
from todos import ring_budget, sweeps, transitions
from todos.models import State, Todo, TodoEvent

pytestmark = pytest.mark.django_db(transaction=True)

TODOS = 2000
WORKERS = 8


def bulk_create_todos(endpoint, count, queues=("inbox",)):
    now = timezone.now()
    Todo.objects.bulk_create(
        Todo(endpoint=endpoint, queue=queues[i % len(queues)], title=f"t{i}",
             max_attempts=endpoint.max_attempts, created_at=now, updated_at=now)
        for i in range(count)
    )


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
        thread.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert not errors, errors


def test_eight_workers_drain_2000_todos_each_exactly_once():
    endpoint = EndpointFactory(owner=UserFactory(), scope=["a", "b", "c"])
    bulk_create_todos(endpoint, TODOS, queues=("a", "b", "c"))
    claimed = [[] for _ in range(WORKERS)]

    def work(i):
        caller = transitions.Caller.agent(endpoint, f"worker-{i}")
        while (todo := transitions.claim_next_todo(caller)) is not None:
            claimed[i].append(todo.pk)
            transitions.complete_todo(caller, todo.pk, lease_id=todo.lease_id)

    run_threads(WORKERS, work)
    every_claim = [pk for worker in claimed for pk in worker]
    assert len(every_claim) == TODOS
    assert len(set(every_claim)) == TODOS, "a todo was handed out twice"
    assert Todo.objects.filter(state=State.DONE).count() == TODOS
    per_action = Counter(TodoEvent.objects.values_list("action", flat=True))
    assert per_action == {"claim": TODOS, "complete": TODOS}


def test_eight_racing_completes_of_one_lease_record_one_completion():
    """The fenced verbs find their todo by primary key and hold it to the guard (``_by_id``):
    racing retries of one complete still change the row once, and the others learn that their
    work was recorded."""
    endpoint = EndpointFactory(owner=UserFactory())
    transitions.create_todo(endpoint=endpoint, queue="inbox", title="t", actor="test")
    caller = transitions.Caller.agent(endpoint, "session-1")
    held = transitions.claim_next_todo(caller)
    start = threading.Barrier(WORKERS)
    outcomes = []

    def complete(i):
        start.wait(10)
        try:
            transitions.complete_todo(caller, held.pk, lease_id=held.lease_id, result={"by": i})
            outcomes.append("done")
        except transitions.Refusal as refusal:
            outcomes.append(refusal.code)

    run_threads(WORKERS, complete)
    assert Counter(outcomes) == {"done": 1, "already_done": WORKERS - 1}
    assert TodoEvent.objects.filter(todo_id=held.pk, action="complete").count() == 1
    assert Todo.objects.get(pk=held.pk).state == State.DONE


def test_twenty_concurrent_creates_with_one_key_make_one_todo():
    endpoint = EndpointFactory(owner=UserFactory())
    barrier = threading.Barrier(20)
    results = [None] * 20

    def create(i):
        barrier.wait()
        results[i] = transitions.create_todo(
            endpoint=endpoint, queue="inbox", title="dup", actor="t", idempotency_key="hook:42")

    run_threads(20, create)
    assert len({todo.pk for todo, _ in results}) == 1
    assert sum(created for _, created in results) == 1
    assert Todo.objects.filter(idempotency_key="hook:42").count() == 1

    # Once that todo is done, the same key makes a new one.
    caller = transitions.Caller.agent(endpoint, "s")
    first = results[0][0]
    transitions.claim_todo(caller, first.pk)
    transitions.complete_todo(caller, first.pk)
    again, created = transitions.create_todo(
        endpoint=endpoint, queue="inbox", title="dup", actor="t", idempotency_key="hook:42")
    assert created and again.pk != first.pk


def spawn_worker(endpoint, *args):
    return subprocess.Popen(
        [PYTHON, "-m", "tests.drain_worker", endpoint.slug, *args],
        cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def read_until(process, marker, deadline_seconds=DEADLINE_SECONDS):
    lines = []
    deadline = time.monotonic() + deadline_seconds
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        line = line.strip()
        if line == marker:
            return lines
        if line.isdigit():
            lines.append(int(line))
    raise AssertionError(f"worker never printed {marker!r}: {process.stderr.read()[-2000:]}")


def test_sigkilled_worker_leases_lapse_and_survivors_finish_everything():
    endpoint = EndpointFactory(owner=UserFactory())
    bulk_create_todos(endpoint, 200)
    victim = spawn_worker(endpoint, "--mode", "hold", "--hold", "7", "--lease-seconds", "2")
    held = read_until(victim, "holding")
    assert len(held) == 7
    victim.kill()  # SIGKILL: no clean-up, the leases stay held
    victim.wait(timeout=DEADLINE_SECONDS)
    assert Todo.objects.filter(pk__in=held, state=State.CLAIMED).count() == 7

    # The surviving workers keep working until nothing is left, while the reaper runs beside
    # them as the scheduler runs it: the 7 dead leases come back and the survivors take them.
    survivors = [spawn_worker(endpoint, "--mode", "drain", "--until-settled") for _ in range(3)]
    stop_reaper = threading.Event()
    returned = []

    def reaper():
        while not stop_reaper.is_set():
            returned.append(sweeps.expire_lapsed_leases())
            stop_reaper.wait(0.5)
        connections.close_all()

    reaper_thread = threading.Thread(target=reaper)
    reaper_thread.start()
    try:
        finished = []
        for survivor in survivors:
            finished += read_until(survivor, "done")
            assert survivor.wait(timeout=DEADLINE_SECONDS) == 0
    finally:
        stop_reaper.set()
        reaper_thread.join(timeout=DEADLINE_SECONDS)
    assert sum(returned) == 7
    assert sorted(TodoEvent.objects.filter(action="lease_lapsed").values_list("todo_id", flat=True)) == sorted(held)
    assert sorted(finished) == sorted(Todo.objects.values_list("pk", flat=True))  # each once
    assert Todo.objects.filter(state=State.DONE).count() == 200
    # Attempts: one for every todo, one more for each of the 7 whose holder died.
    assert Counter(Todo.objects.values_list("attempts", flat=True)) == {1: 193, 2: 7}


def test_fifth_lapse_dead_letters_and_the_requeue_command_revives_it(capsys):
    endpoint = EndpointFactory(owner=UserFactory())
    bulk_create_todos(endpoint, 1)
    (todo,) = Todo.objects.filter(endpoint=endpoint)
    for attempt in range(5):
        victim = spawn_worker(endpoint, "--mode", "hold", "--hold", "1", "--lease-seconds", "1")
        assert read_until(victim, "holding") == [todo.pk]
        victim.kill()
        victim.wait(timeout=DEADLINE_SECONDS)
        deadline = time.monotonic() + DEADLINE_SECONDS
        while not sweeps.expire_lapsed_leases() and time.monotonic() < deadline:
            time.sleep(0.2)
    todo.refresh_from_db()
    assert todo.is_dead_letter and todo.attempts == 5

    call_command("requeue", "--dead-letters", "--endpoint", endpoint.slug, "--json")
    assert f'"requeued": ["{todo.pk}"]' in capsys.readouterr().out
    todo.refresh_from_db()
    assert todo.state == State.PENDING and todo.attempts == 0 and todo.dead_lettered_at is None


def test_a_todo_a_stamp_holds_for_a_moment_is_claimed_not_reported_empty(endpoint):
    """A digest or ring stamping last_ringed_at locks the row briefly; SKIP LOCKED skipped it
    and claim_next answered "empty" with the todo waiting. It must look again."""
    if connections["default"].vendor != "postgresql":
        pytest.skip("row locks are PostgreSQL's; SQLite's single writer serialises them")
    from django.db import transaction

    todo, _ = transitions.create_todo(endpoint=endpoint, queue="inbox", title="t", actor="test")
    locked, release = threading.Event(), threading.Event()

    def stamp_like_a_digest():
        with transaction.atomic():
            Todo.objects.filter(pk=todo.pk).update(last_ringed_at=timezone.now())
            locked.set()
            release.wait(5)
        connections["default"].close()

    holder = threading.Thread(target=stamp_like_a_digest)
    holder.start()
    try:
        assert locked.wait(5)
        threading.Timer(0.01, release.set).start()  # the stamp commits 10 ms later
        claimed = transitions.claim_next_todo(transitions.Caller.agent(endpoint, "s1"))
    finally:
        release.set()
        holder.join()
    assert claimed is not None and claimed.pk == todo.pk


# -- priority order while bookkeeping marks rows (docs/reference.md#doorbells) -------------------


def _postgres_only():
    if connections["default"].vendor != "postgresql":
        pytest.skip("row locks and SKIP LOCKED are PostgreSQL's; SQLite's single writer "
                    "serialises claims and digests")


def bulk_create_ranked(endpoint, *, high: int, low: int):
    """``high`` priority-100 todos, then ``low`` priority-0 ones: the better todos have the
    lower ids, the order in which a digest marks (and once locked) them."""
    now = timezone.now()
    Todo.objects.bulk_create(
        Todo(endpoint=endpoint, queue="inbox", title=f"t{i}", trust="signed",
             priority=100 if i < high else 0, max_attempts=endpoint.max_attempts,
             created_at=now, updated_at=now)
        for i in range(high + low))


class DigestsInALoop:
    """Threads that keep sending ``endpoint``'s digest (``record_digest`` marks every claimable
    todo) until stopped, each on its own connection."""

    def __init__(self, endpoint, threads: int = 2):
        self.endpoint, self.stop, self.rounds, self.errors = endpoint, threading.Event(), [], []
        self.threads = [threading.Thread(target=self._run) for _ in range(threads)]

    def _run(self):
        try:
            while not self.stop.is_set():
                self.rounds.append(len(ring_budget.record_digest(endpoint=self.endpoint)))
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            connections.close_all()

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        deadline = time.monotonic() + 30
        while not self.rounds and time.monotonic() < deadline:  # digests are under way
            time.sleep(0.001)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)
        assert not self.errors, self.errors


def test_sixteen_cold_claimers_take_the_best_todos_while_digests_mark_them():
    """A digest marks every claimable todo of the endpoint; a claimer must not take it for a
    claim and skip the better todos (a cold pool of 16 claimed priority 0 with priority 100
    waiting). Only rows other claims hold may be passed over."""
    _postgres_only()
    endpoint = EndpointFactory(owner=UserFactory())
    bulk_create_ranked(endpoint, high=64, low=1500)
    workers, claims_each = 16, 4
    start = threading.Barrier(workers)
    claimed = [[] for _ in range(workers)]

    def claim(i):
        caller = transitions.Caller.agent(endpoint, f"worker-{i}")
        start.wait(30)
        for _ in range(claims_each):
            claimed[i].append(transitions.claim_next_todo(caller).priority)

    with DigestsInALoop(endpoint) as digests:
        run_threads(workers, claim)
    assert digests.rounds
    priorities = Counter(p for worker in claimed for p in worker)
    assert priorities == {100: workers * claims_each}, priorities


def test_max_claimed_one_goes_to_the_highest_priority_while_digests_mark_rows():
    """Four workers start together on an endpoint that lets one todo be claimed at a time: the
    slot goes to the priority-100 todo, round after round, whatever a digest holds."""
    _postgres_only()
    endpoint = EndpointFactory(owner=UserFactory(), max_claimed=1)
    wrong = []
    for round_number in range(10):
        Todo.objects.filter(endpoint=endpoint).delete()
        bulk_create_ranked(endpoint, high=1, low=400)
        start = threading.Barrier(4)
        got = []

        def claim(i):
            caller = transitions.Caller.agent(endpoint, f"worker-{i}")
            start.wait(30)
            try:
                todo = transitions.claim_next_todo(caller)
            except transitions.Refusal as refusal:
                assert refusal.code == "at_capacity", refusal.code
                return
            if todo is not None:
                got.append(todo.priority)

        with DigestsInALoop(endpoint, threads=1):
            run_threads(4, claim)
        assert len(got) == 1, got
        if got != [100]:
            wrong.append(round_number)
    assert not wrong, f"the slot went to a priority-0 todo in rounds {wrong}"
