"""Opening a notification stream with work waiting: the reconnect digest under concurrency,
and the order in which a stream's first bytes leave (headers before the digest is computed).

Real PostgreSQL sessions on real threads: what is tested here is row locking."""

import json
import random
import threading
import time
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.db import connection
from django.utils import timezone

from channels_push.doorbells import rings
from channels_push.mcp import stream as mcp_stream
from channels_push.sessions import transitions as session_transitions
from tests.processes import DEADLINE_SECONDS
from todos.models import Todo

from tests.factories import credential_for

pytestmark = pytest.mark.django_db(transaction=True)

STREAMS = 12
PENDING = 1200
ROUNDS = 2
BACKLOG_MARKS = 2
# Processes do not all plan the statement alike: statistics refreshed by autovacuum in the
# middle of a burst of reconnects give some of them another join (rows visited in index order
# rather than table order). Half the streams plan as after such a refresh.
PLANS = ((), ("SET enable_hashjoin = off", "SET enable_seqscan = off"))


def pending_todos(endpoint, count, *, now):
    """``count`` pending todos in a table that has seen work: interleaved with as many done
    ones that the prune then deleted, so its free space lies scattered between live rows (as
    in any table that has run for a while) and a row's next version lands anywhere."""
    rng = random.Random(25)
    Todo.objects.bulk_create(
        Todo(endpoint=endpoint, queue=("inbox", "reviews", "deploys")[i % 3], title=f"t{i}",
             state="pending" if i % 2 else "done", trust="signed",
             created_at=now - timedelta(seconds=2 * count - i), updated_at=now)
        for i in range(2 * count))
    done = list(Todo.objects.filter(endpoint=endpoint, state="done").values_list("pk", flat=True))
    Todo.objects.filter(pk__in=rng.sample(done, len(done) // 2)).delete()
    Todo.objects.filter(endpoint=endpoint, state="done").update(state="pending")
    Todo.objects.filter(pk__in=rng.sample(
        list(Todo.objects.filter(endpoint=endpoint).values_list("pk", flat=True)),
        count // 2)).delete()
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        # Earlier digests have marked these rows many times over: each mark a new version of
        # every row, written wherever the table had room, so a row's current version lies in
        # no relation to its id (nor to where another snapshot finds its older one).
        for _ in range(BACKLOG_MARKS):
            Todo.objects.filter(endpoint=endpoint).update(last_ringed_at=now - timedelta(hours=1))
        # The planner sees the table as it is: the real plan for a table this size.
        cursor.execute("ANALYZE todos_todo")


def open_sessions(endpoint, count):
    return [session_transitions.open_session(
        endpoint=endpoint, credential_id=credential_for(endpoint),
        protocol_version="2025-11-25").pk for _ in range(count)]


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL row locks")
def test_a_dozen_streams_opening_together_over_a_long_queue_all_get_their_digest(endpoint):
    """Every stream of the endpoint computes its reconnect digest at the same moment, each
    marking the same 1,200 rows: whatever order its process's plan visits them in, none of
    them may deadlock another (a deadlock there loses that stream's digest)."""
    now = timezone.now()
    pending_todos(endpoint, PENDING, now=now)
    sessions = open_sessions(endpoint, STREAMS)
    failures, digests = [], []
    jitter = random.Random(11)
    for round_number in range(ROUNDS):
        barrier = threading.Barrier(STREAMS)

        def open_stream(session_id, delay, planner_settings):
            with connection.cursor() as cursor:
                for setting in planner_settings:
                    cursor.execute(setting)
            barrier.wait()
            # Streams open over a few tens of milliseconds, not in one instant: those that
            # start after an earlier digest committed read the rows' newer versions, which
            # lie elsewhere in the table (so a plan visits them in another order).
            time.sleep(delay)
            try:
                frames = mcp_stream.ring_reconnected_stream(endpoint.pk, session_id)
                digests.extend(frames)
            except Exception as exc:  # noqa: BLE001 - the failure is the finding
                failures.append(f"round {round_number}: {type(exc).__name__}: {exc}"
                                .splitlines()[0])
            finally:
                connection.close()

        # ring_reconnected_stream reads the clock itself: each round moves the previous
        # round's marks back past the cooldown, so every stream has all of them to mark.
        Todo.objects.filter(endpoint=endpoint).update(
            last_ringed_at=timezone.now() - 3 * rings.RECONNECT_COOLDOWN)
        threads = [threading.Thread(target=open_stream, args=(
            session_id, jitter.uniform(0, 0.05), PLANS[index % 2]))
            for index, session_id in enumerate(sessions)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert failures == []
    assert digests, "at least one stream of each round is handed the digest"


class RowHeld:
    """One pending todo's row locked by another connection (as a claim in progress holds it)
    until ``release()``: a digest that marks that row waits for it, for as long as the test
    says, without a clock."""

    def __init__(self, todo_id):
        self.todo_id = todo_id
        self.locked, self.done = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._hold)

    def _hold(self):
        from django.db import transaction

        try:
            with transaction.atomic():
                list(Todo.objects.select_for_update().filter(pk=self.todo_id))
                self.locked.set()
                self.done.wait(10)
        finally:
            connection.close()

    def __enter__(self):
        self.thread.start()
        assert self.locked.wait(10)
        return self

    def release(self):
        self.done.set()
        self.thread.join()

    def __exit__(self, *exc):
        self.release()


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL row locks")
def test_a_stream_sends_its_headers_and_retry_hint_before_its_digest_is_computed(mcp):
    """The digest reads every pending row of the endpoint (seconds on a long queue): the
    client must see its stream open at once, and the digest after that, never a response
    that hangs before its headers. Here the digest waits on a row another connection holds."""
    from channels.testing import ApplicationCommunicator

    from channels_push.doorbells import doorbells
    from channels_push.mcp.tests.test_stream import app, next_body, stream_scope

    mcp.initialize()
    pending_todos(mcp.endpoint, 200, now=timezone.now())
    held_todo = Todo.objects.filter(endpoint=mcp.endpoint, state="pending").order_by("pk").last()

    async def scenario():
        communicator = ApplicationCommunicator(app, stream_scope(mcp))
        await communicator.send_input({"type": "http.request", "body": b"", "more_body": False})
        with RowHeld(held_todo.pk) as held:
            start = await communicator.receive_output(timeout=DEADLINE_SECONDS)
            assert start["type"] == "http.response.start" and start["status"] == 200
            first = await next_body(communicator)
            assert first["body"].startswith(b": ")
            assert b"\nretry: 3000\n" in b"\n" + first["body"]
            held.release()
            # Then the digest, before any live event.
            frame = b""
            while b"data: " not in frame:
                frame = (await next_body(communicator))["body"]
        message = json.loads(frame.decode().split("data: ", 1)[1])
        assert doorbells.is_digest(message["params"])
        assert message["params"]["meta"]["pending"] == "200"
        await communicator.send_input({"type": "http.disconnect"})
        await communicator.wait(timeout=DEADLINE_SECONDS)

    async_to_sync(scenario)()
