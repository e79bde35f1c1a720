"""The doorbell heartbeat sweep (SPEC-0011 "Doorbell Heartbeat"), driven by a controllable clock
(``now=``), never by sleeping."""

import io
import json
import threading
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

from channels_push.doorbells import sweeps
from channels_push.sessions import transitions as session_transitions
from todos import ring_budget
from channels_push.models import McpSession
from channels_push.tests.conftest import make_ready_todo
from tests import plans
from tests.processes import DEADLINE_SECONDS
from tests.factories import credential_for, EndpointFactory, UserFactory
from todos.models import Todo

T0 = timezone.now().replace(microsecond=0) - timedelta(days=2)


@pytest.fixture(autouse=True)
def sessions_stay_attached(settings):
    """This module drives the ring schedule across simulated days: its sessions stay attached
    the whole time (what "attached" means is tested in test_attached.py)."""
    settings.SWITCHBOARD_ATTACH_WINDOW = timedelta(days=60)


def attach(endpoint, *, stream=False):
    session = session_transitions.open_session(endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25",
                                               now=T0)
    if stream:
        session_transitions.attach_stream(endpoint=endpoint, session_id=session.pk, now=T0)
        McpSession.objects.filter(pk=session.pk).update(stream_lease_until=T0 + timedelta(days=60))
    return session


def sweep(at):
    return sweeps.ring_due_todos(now=at)


def rings_of(todo):
    row = Todo.objects.get(pk=todo.pk)
    return row.ring_attempts, row.last_ringed_at


def test_the_ring_schedule_names_all_five_rings():
    assert len(sweeps.RING_SCHEDULE) == ring_budget.MAX_RING_ATTEMPTS == 5
    assert sweeps.RING_SCHEDULE[0] == timedelta(0)  # the creation ring, not the sweep's


def test_backoff_is_5m_20m_1h_6h_after_the_creation_ring_and_stops_at_five(
        endpoint, django_capture_on_commit_callbacks):
    attach(endpoint)
    with django_capture_on_commit_callbacks(execute=True):  # the creation ring
        todo = make_ready_todo(endpoint, now=T0)
    assert rings_of(todo) == (1, None)  # counted; the backoff still counts from creation
    assert sweep(T0 + timedelta(minutes=4, seconds=59)) == 0
    at = T0
    for interval in (timedelta(minutes=5), timedelta(minutes=20), timedelta(hours=1),
                     timedelta(hours=6)):
        assert sweep(at + interval - timedelta(seconds=1)) == 0  # not yet
        at = at + interval
        assert sweep(at) == 1
        assert rings_of(todo)[1] == at
    assert rings_of(todo) == (5, at)
    # Ring budget exhausted while connected: never again, still pending and visible.
    assert sweep(at + timedelta(hours=6)) == 0
    assert sweep(at + timedelta(days=30)) == 0
    assert rings_of(todo) == (5, at)
    assert Todo.objects.get(pk=todo.pk).state == "pending"


def test_a_todo_whose_creation_ring_reached_nobody_gets_five_sweep_rings(endpoint):
    todo = make_ready_todo(endpoint, now=T0)  # nobody attached: nothing spent
    attach(endpoint)
    at = T0
    for interval in (timedelta(minutes=5), timedelta(minutes=5), timedelta(minutes=20),
                     timedelta(hours=1), timedelta(hours=6)):
        assert sweep(at + interval - timedelta(seconds=1)) == 0
        at = at + interval
        assert sweep(at) == 1
    assert rings_of(todo) == (5, at)
    assert sweep(at + timedelta(days=30)) == 0


@pytest.mark.django_db(transaction=True)
def test_an_unclaimed_todo_gets_exactly_five_doorbells_the_creation_ring_included(endpoint):
    """Rung on creation, then by the sweep over its whole schedule and well past it: five
    doorbells reach the session in all (SPEC-0011 "rung 5 times … not rung again"). The
    session's channel-layer group is joined here as its stream would join it (real Redis), and
    a control todo rung at the end shows that nothing else was on its way."""
    import asyncio

    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    from channels_push.bus import groups
    from channels_push.bus import publish

    session = attach(endpoint, stream=True)
    # A sweep a minute apart through the first two hours, then hourly for two days.
    times = ([T0 + timedelta(minutes=m) for m in range(1, 121)]
             + [T0 + timedelta(hours=h) for h in range(3, 49)])

    def create_and_sweep():
        todo = make_ready_todo(endpoint, title="nobody claims me", now=T0)
        rung = sum(sweep(at) for at in times)
        control = make_ready_todo(endpoint, title="control")
        assert publish.wait_for_sends(DEADLINE_SECONDS)
        connection.close()
        return todo, rung, control

    async def scenario():
        layer = get_channel_layer()
        channel = await layer.new_channel()
        await layer.group_add(groups.session_group(session.pk), channel)
        todo, rung, control = await asyncio.to_thread(create_and_sweep)
        heard = []
        while True:
            message = await asyncio.wait_for(layer.receive(channel), DEADLINE_SECONDS)
            todo_id = message["params"]["meta"]["todo_id"]
            if todo_id == str(control.pk):
                return todo, rung, heard
            heard.append(todo_id)

    todo, rung, heard = async_to_sync(scenario)()
    assert heard == [str(todo.pk)] * 5
    assert rung == 4  # the creation ring was the first of the five
    assert Todo.objects.get(pk=todo.pk).ring_attempts == 5


def test_interval_counts_from_last_ringed_at_when_a_digest_marked_it(endpoint):
    """A digest sets last_ringed_at without spending an attempt: ring_attempts 0 still means the
    5 min step, counted from the mark, not from creation."""
    attach(endpoint)
    todo = make_ready_todo(endpoint, now=T0)
    mark = T0 + timedelta(hours=15)
    Todo.objects.filter(pk=todo.pk).update(last_ringed_at=mark)
    assert sweep(mark + timedelta(minutes=4)) == 0
    assert sweep(mark + timedelta(minutes=5)) == 1
    assert rings_of(todo) == (1, mark + timedelta(minutes=5))


def test_no_attached_session_keeps_the_full_ring_budget(endpoint):
    todo = make_ready_todo(endpoint, now=T0)
    assert sweep(T0 + timedelta(hours=15)) == 0
    assert rings_of(todo) == (0, None)
    gone = attach(endpoint)
    session_transitions.terminate_session(endpoint=endpoint, session_id=gone.pk)
    assert sweep(T0 + timedelta(hours=16)) == 0  # a terminated session is not attached
    assert rings_of(todo) == (0, None)


def test_an_attached_session_with_no_open_stream_still_receives_sweeps(
        endpoint, django_capture_on_commit_callbacks):
    session = attach(endpoint, stream=False)
    todo = make_ready_todo(endpoint, now=T0)
    # The sweep hands its doorbells to on_commit; run them so the whole path is exercised.
    with django_capture_on_commit_callbacks(execute=True):
        assert sweep(T0 + timedelta(minutes=5)) == 1
    assert rings_of(todo) == (1, T0 + timedelta(minutes=5))
    # The ring went to that streamless session (and was dropped at the transport): counted.
    from channels_push.models import McpSession

    assert McpSession.objects.get(pk=session.pk).last_doorbell_at is not None


def test_unverified_claimed_and_inactive_endpoint_todos_are_not_rung(endpoint, operator):
    attach(endpoint)
    unsigned = make_ready_todo(endpoint, trust="unverified", now=T0)
    unattributed = make_ready_todo(endpoint, attributed=False, now=T0)
    claimed = make_ready_todo(endpoint, now=T0)
    Todo.objects.filter(pk=claimed.pk).update(state="claimed")
    off = EndpointFactory(owner=operator, active=False)
    attach(off)
    inactive = make_ready_todo(off, now=T0)
    assert sweep(T0 + timedelta(hours=1)) == 0
    for todo in (unsigned, unattributed, claimed, inactive):
        assert rings_of(todo) == (0, None)


def test_a_sweep_rings_at_most_three_round_robin_across_endpoints(db):
    owner = UserFactory()
    endpoints = [EndpointFactory(owner=owner) for _ in range(4)]
    for endpoint in endpoints:
        attach(endpoint)
    # The first endpoint is flooded with the oldest work; the others have one todo each.
    flood = [make_ready_todo(endpoints[0], now=T0 + timedelta(seconds=i)) for i in range(6)]
    singles = [make_ready_todo(e, now=T0 + timedelta(minutes=1)) for e in endpoints[1:]]
    at = T0 + timedelta(hours=1)
    assert sweep(at) == 3
    first = set(Todo.objects.filter(last_ringed_at=at).values_list("endpoint_id", flat=True))
    assert len(first) == 3  # three different endpoints, one todo each
    assert sweep(at + timedelta(seconds=1)) == 3
    assert sweep(at + timedelta(seconds=2)) == 3
    # Every endpoint's single todo got its ring within the first sweeps despite the flood.
    assert all(rings_of(t)[0] == 1 for t in singles)
    assert sum(rings_of(t)[0] for t in flood) == 9 - len(singles)


def test_overlapping_sweeps_do_not_ring_one_todo_twice(db, django_db_blocker):
    owner = UserFactory()
    endpoints = [EndpointFactory(owner=owner) for _ in range(3)]
    for endpoint in endpoints:
        attach(endpoint)
    todos = [make_ready_todo(e, now=T0 + timedelta(seconds=i)) for e in endpoints for i in range(3)]
    at = T0 + timedelta(hours=1)
    assert sweep(at) + sweep(at) + sweep(at) == 9  # same clock: each run finds what is left
    assert all(rings_of(t) == (1, at) for t in todos)


@pytest.mark.django_db(transaction=True)
def test_concurrent_sweeps_share_the_work_without_double_rings():
    owner = UserFactory()
    endpoints = [EndpointFactory(owner=owner) for _ in range(6)]
    for endpoint in endpoints:
        attach(endpoint)
    todos = [make_ready_todo(e, now=T0 + timedelta(seconds=i)) for e in endpoints for i in range(2)]
    created = {t.pk: rings_of(t)[0] for t in todos}  # their creation rings
    at = T0 + timedelta(hours=1)
    counts, barrier = [], threading.Barrier(6)

    def run():
        barrier.wait()
        try:
            counts.append(sweep(at))
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    rung = [rings_of(t)[0] - created[t.pk] for t in todos]
    assert sum(counts) == sum(rung)  # every counted ring happened once
    assert all(attempts <= 1 for attempts in rung)


def test_sweep_doorbells_command_prints_rung(endpoint):
    attach(endpoint)
    make_ready_todo(endpoint, now=timezone.now() - timedelta(minutes=6))
    out = io.StringIO()
    call_command("sweep_doorbells", "--json", stdout=out)
    assert json.loads(out.getvalue()) == {"rung": 1}


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL plans")
def test_sweep_reads_its_partial_index(endpoint):
    from ingest.models import DeliveryEvent

    attach(endpoint)
    now = timezone.now()
    # Each from its own delivery, attributed as a webhook's are: with no delivery events at all
    # the planner rightly starts from that empty table, and the index is never asked for.
    events = DeliveryEvent.objects.bulk_create(
        DeliveryEvent(trust="signed", received_at=now, attributed_to=endpoint.owner)
        for _ in range(5000))
    Todo.objects.bulk_create(
        Todo(endpoint=endpoint, queue="inbox", title="t", state="done" if i % 10 else "pending",
             trust="signed", created_at=now, updated_at=now, delivery_event=event)
        for i, event in enumerate(events))
    with connection.cursor() as cursor:
        plans.analyze_every_table(cursor)
        cursor.execute("SELECT obj_description('todo_doorbell_due'::regclass, 'pg_class')")
        assert "ring_due_todos" in cursor.fetchone()[0]
        cursor.execute("SET enable_seqscan = off")  # tiny tables: ask which index it would use
        # The very statement the sweep runs (its selecting part: EXPLAIN must not write).
        sql, params = ring_budget.sweep_rings_sql(
            receivers={endpoint.pk: None}, schedule=sweeps.RING_SCHEDULE,
            limit=sweeps.RINGS_PER_SWEEP, now=now, select_only=True)
        cursor.execute("EXPLAIN " + sql, params)
        text = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("SET enable_seqscan = on")
    assert "todo_doorbell_due" in text, text


# -- delivery from short-lived processes (review C) ---------------------------------------------


def test_a_command_waits_for_its_in_flight_sends_before_exiting(tmp_path):
    """A command publishes from the background loop's daemon thread; without the atexit flush
    the process exits before the send leaves, while the ring is already recorded."""
    import subprocess

    from tests.processes import PYTHON, ROOT, child_env

    marker = tmp_path / "sent"
    script = (
        "import asyncio, django; django.setup()\n"
        "from channels_push.bus import publish\n"
        "async def slow_send():\n"
        "    await asyncio.sleep(0.5)  # a Redis round trip that takes a while\n"
        f"    open({str(marker)!r}, 'w').write('sent')\n"
        "publish._sender.submit(slow_send, {})\n"
    )
    subprocess.run([PYTHON, "-c", script], cwd=ROOT, env=child_env(), check=True,
                   timeout=DEADLINE_SECONDS)
    assert marker.read_text() == "sent"


@pytest.fixture
def in_memory_layer_without_server(settings):
    from channels.layers import channel_layers

    from channels_push.bus import publish

    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    channel_layers.backends.clear()
    bound, publish._sender._server_loop = publish._sender._server_loop, None
    yield
    publish._sender._server_loop = bound
    channel_layers.backends.clear()


def test_can_reach_streams_only_with_a_shared_layer_or_inside_the_server(
        in_memory_layer_without_server):
    import asyncio

    from channels_push.bus import publish

    assert publish.can_reach_streams() is False
    loop = asyncio.new_event_loop()
    try:
        publish.bind_server_loop(loop)
        assert publish.can_reach_streams() is True
    finally:
        loop.close()
    assert publish.can_reach_streams() is False  # a closed loop is no server


def test_sweep_command_on_the_in_memory_layer_records_nothing_and_says_so(
        endpoint, in_memory_layer_without_server):
    attach(endpoint)
    todo = make_ready_todo(endpoint, now=timezone.now() - timedelta(minutes=6))
    out, err = io.StringIO(), io.StringIO()
    call_command("sweep_doorbells", "--json", stdout=out, stderr=err)
    assert json.loads(out.getvalue()) == {"rung": 0}
    assert "scheduler" in err.getvalue()
    assert rings_of(todo) == (0, None)


def test_digest_on_the_in_memory_layer_outside_the_server_marks_nothing(
        endpoint, in_memory_layer_without_server):
    from channels_push.doorbells import doorbells

    attach(endpoint)
    todo = make_ready_todo(endpoint, now=T0)
    assert doorbells.send_digest(endpoint, "operator", now=T0 + timedelta(minutes=1)) == 0
    assert rings_of(todo) == (0, None)


def test_sweep_rings_only_todos_in_the_endpoints_scope(endpoint):
    """Review C: out-of-scope todos neither take the sweep's 3 rings nor spend their budget."""
    endpoint.scope = ["reviews"]
    endpoint.save()
    attach(endpoint)
    outside = [make_ready_todo(endpoint, "elsewhere", now=T0 + timedelta(seconds=i))
               for i in range(3)]
    inside = make_ready_todo(endpoint, "reviews", now=T0 + timedelta(seconds=10))
    assert sweep(T0 + timedelta(hours=1)) == 1
    assert rings_of(inside)[0] == 1
    assert [rings_of(todo)[0] for todo in outside] == [0, 0, 0]
