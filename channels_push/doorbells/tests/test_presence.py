"""Held doorbells and digests (CONTRACT §8; SPEC-0011 as amended by SPEC-0022), with a
controllable clock and no sleeps."""

import threading
from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from django.db import connection
from django.utils import timezone

from tests.factories import credential_for
from channels_push.doorbells import sweeps
from channels_push.doorbells import doorbells
from channels_push.sessions import transitions as session_transitions
from channels_push.models import McpSession
from channels_push.tests.conftest import McpDriver, make_ready_todo
from channels_push.doorbells.tests.test_doorbells import close, next_doorbell, next_ring, open_stream, ring
from endpoints import transitions as endpoint_transitions
from endpoints.models import Endpoint
from todos.models import Todo

UTC = dt_timezone.utc
WEEKDAYS_9_TO_17 = [{"day": d, "start": "09:00", "end": "17:00"}
                    for d in ("mon", "tue", "wed", "thu", "fri", "sat", "sun")]


def at(*args):
    return datetime(*args, tzinfo=UTC)


def attach(endpoint, now=None):
    """A session with a notification stream held open across the simulated hours (its stream
    lease reaches past them; a digest to a streamless session is dropped, and what "attached"
    means is tested in test_attached.py)."""
    session = session_transitions.open_session(endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25",
                                               now=now)
    session_transitions.attach_stream(endpoint=endpoint, session_id=session.pk, now=now)
    McpSession.objects.filter(pk=session.pk).update(
        stream_lease_until=(now or timezone.now()) + timedelta(days=400))
    return session


@pytest.mark.django_db
def test_digest_carries_counts_not_content(endpoint, digests):
    now = timezone.now()
    for i in range(5):
        make_ready_todo(endpoint, "reviews", title=f"secret review {i}", now=now - timedelta(hours=2))
    for i in range(2):
        make_ready_todo(endpoint, "lane-m", title=f"secret lane {i}", now=now - timedelta(minutes=3))
    make_ready_todo(endpoint, "reviews", title="unsigned", trust="unverified")
    session = attach(endpoint)
    assert doorbells.send_digest(endpoint, "clock_in", now=now) == 1
    [(session_id, params)] = digests
    assert session_id == session.pk
    # What claim_next would hand: the unverified todo too, and the digest says so (issue 13.11).
    assert params["meta"] == {"kind": "digest", "pending": "8", "queues": "lane-m,reviews",
                              "reason": "clock_in", "unverified": "1"}
    assert "todo_id" not in params["meta"] and doorbells.is_digest(params)
    assert "secret" not in params["content"] and "unsigned" not in params["content"]
    assert "lane-m 2" in params["content"] and "reviews 6" in params["content"]
    assert "1 unverified" in params["content"]
    assert "2 h" in params["content"] and "\n" not in params["content"]
    # The counted todos are marked as rung without spending an attempt.
    counted = Todo.objects.filter(endpoint=endpoint)
    assert {(t.ring_attempts, t.last_ringed_at) for t in counted} == {(0, now)}


@pytest.mark.django_db
def test_nothing_pending_no_digest_and_no_session_no_digest(endpoint, digests):
    attach(endpoint)
    assert doorbells.send_digest(endpoint, "operator") == 0
    other = Endpoint.objects.create(slug="lonely", owner=endpoint.owner)
    todo = make_ready_todo(other)
    assert doorbells.send_digest(other, "operator") == 0  # nobody attached: nothing marked
    assert Todo.objects.get(pk=todo.pk).last_ringed_at is None
    assert digests == []


@pytest.mark.django_db(transaction=True)
def test_clocked_out_endpoint_is_not_rung_and_clock_in_sends_one_digest(vend):
    endpoint, credential = vend("off-duty")
    d = McpDriver(endpoint.slug, credential)
    d.initialize()
    assert d.call("clock_out")["result"]["structuredContent"] == {"presence": "out"}

    async def scenario():
        stream = await open_stream(d)
        held = await ring(endpoint, "inbox", title="while away")
        clocked = await database_sync_to_async(d.call, thread_sensitive=False)("clock_in")
        assert clocked["result"]["structuredContent"] == {"presence": "in"}
        params = await next_doorbell(stream)  # the first thing the stream sees
        assert params["meta"] == {"kind": "digest", "pending": "1", "queues": "inbox",
                                  "reason": "clock_in", "unverified": "0"}
        await close(stream)
        return held

    held = async_to_sync(scenario)()
    row = Todo.objects.get(pk=held.pk)
    assert row.ring_attempts == 0 and row.state == "pending"


@pytest.mark.django_db
def test_clocked_out_endpoint_keeps_its_ring_budget_in_sweeps(endpoint):
    attach(endpoint)
    now = timezone.now()
    todo = make_ready_todo(endpoint, now=now - timedelta(hours=1))
    endpoint_transitions.clock(endpoint, "out", reason="operator", now=now - timedelta(minutes=30))
    assert sweeps.ring_due_todos(now=now) == 0
    row = Todo.objects.get(pk=todo.pk)
    assert (row.ring_attempts, row.last_ringed_at) == (0, None)
    assert doorbells.ring_todo(row) is None  # held
    endpoint_transitions.clock(endpoint, "in", reason="operator", now=now)
    assert sweeps.ring_due_todos(now=now + timedelta(minutes=6)) == 1


@pytest.mark.django_db
def test_agent_offline_overnight(endpoint):
    """Todo at 18:00, no session; the agent reconnects at 09:00: ring_attempts is still 0 and
    the first sweep ring waits its backoff from the reconnect digest."""
    evening = at(2026, 11, 30, 18)
    todo = make_ready_todo(endpoint, now=evening)
    for minutes in range(5, 15 * 60, 30):  # sweeps all night
        sweeps.ring_due_todos(now=evening + timedelta(minutes=minutes))
    morning = at(2026, 12, 1, 9)
    assert Todo.objects.get(pk=todo.pk).ring_attempts == 0
    session = attach(endpoint, now=morning)
    frames = doorbells.reconnect_frames(endpoint_id=endpoint.pk, session_id=session.pk, now=morning)
    assert [p["meta"]["reason"] for p, _ in frames] == ["reconnect"]
    row = Todo.objects.get(pk=todo.pk)
    assert (row.ring_attempts, row.last_ringed_at) == (0, morning)
    assert sweeps.ring_due_todos(now=morning + timedelta(minutes=4)) == 0
    assert sweeps.ring_due_todos(now=morning + timedelta(minutes=5)) == 1
    assert Todo.objects.get(pk=todo.pk).ring_attempts == 1


@pytest.mark.django_db(transaction=True)
def test_reconnect_digest_replaces_individual_rings(vend):
    endpoint, credential = vend("back-again")
    todos = [make_ready_todo(endpoint, "reviews", title=f"w{i}") for i in range(3)]
    d = McpDriver(endpoint.slug, credential)
    d.initialize()

    async def scenario():
        stream = await open_stream(d)
        params = await next_doorbell(stream)
        assert params["meta"] == {"kind": "digest", "pending": "3", "queues": "reviews",
                                  "reason": "reconnect", "unverified": "0"}
        control = await ring(endpoint, "reviews", title="control")
        assert (await next_ring(stream))["meta"]["todo_id"] == str(control.pk)  # no rings
        await close(stream)

    async_to_sync(scenario)()
    assert all(Todo.objects.get(pk=t.pk).ring_attempts == 0 for t in todos)


@pytest.mark.django_db
def test_clocked_out_reconnect_gets_nothing(endpoint):
    make_ready_todo(endpoint)
    session = attach(endpoint)
    endpoint_transitions.clock(endpoint, "out", reason="operator")
    assert doorbells.reconnect_frames(endpoint_id=endpoint.pk, session_id=session.pk) == []


def berlin_shift(endpoint, *, boundary_at=None):
    endpoint.shift_timezone, endpoint.shift_schedule = "Europe/Berlin", WEEKDAYS_9_TO_17
    endpoint.presence_boundary_at = boundary_at
    endpoint.save()


@pytest.mark.django_db(transaction=True)
def test_shift_start_on_a_dst_day_yields_exactly_one_digest_with_overlapping_sweeps(
        endpoint, digests):
    # 2026-03-29: Berlin springs forward; the 09:00 shift starts at 07:00 UTC (not 08:00).
    berlin_shift(endpoint)
    attach(endpoint)
    make_ready_todo(endpoint, "reviews", now=at(2026, 3, 28, 20))
    assert sweeps.announce_presence_boundaries(now=at(2026, 3, 29, 6, 59)) == 0
    start = at(2026, 3, 29, 7, 0, 20)
    counts, barrier = [], threading.Barrier(4)

    def sweep():
        barrier.wait()
        try:
            counts.append(sweeps.announce_presence_boundaries(now=start))
        finally:
            connection.close()

    threads = [threading.Thread(target=sweep) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(counts) == 1
    assert sweeps.announce_presence_boundaries(now=start + timedelta(seconds=30)) == 0
    assert [p["meta"]["reason"] for _, p in digests] == ["shift_start"]
    assert Endpoint.objects.get(pk=endpoint.pk).presence_boundary_at == at(2026, 3, 29, 7)
    # The shift's end is a boundary too, announced to nobody (presence turned out).
    assert sweeps.announce_presence_boundaries(now=at(2026, 3, 29, 15, 0, 10)) == 0
    assert len(digests) == 1


@pytest.mark.django_db
def test_shift_start_with_nothing_pending_sends_no_digest(endpoint, digests):
    berlin_shift(endpoint)
    attach(endpoint)
    assert sweeps.announce_presence_boundaries(now=at(2026, 3, 30, 7, 0, 10)) == 0
    assert digests == []


@pytest.mark.django_db
def test_override_ending_yields_override_end(endpoint, digests):
    attach(endpoint)
    now = timezone.now()
    make_ready_todo(endpoint, now=now)
    endpoint_transitions.clock(endpoint, "out", reason="operator", until=now + timedelta(hours=1), now=now)
    assert sweeps.announce_presence_boundaries(now=now + timedelta(minutes=59)) == 0
    assert sweeps.announce_presence_boundaries(now=now + timedelta(hours=1, seconds=10)) == 1
    assert [p["meta"]["reason"] for _, p in digests] == ["override_end"]
    assert sweeps.announce_presence_boundaries(now=now + timedelta(hours=1, seconds=40)) == 0


@pytest.mark.django_db
def test_operator_clock_in_sends_an_operator_digest(endpoint, digests,
                                                    django_capture_on_commit_callbacks):
    attach(endpoint)
    make_ready_todo(endpoint)
    endpoint_transitions.clock(endpoint, "out", reason="operator")
    with django_capture_on_commit_callbacks(execute=True):
        assert endpoint_transitions.clock(endpoint, "in", reason="operator") == "in"
        assert endpoint_transitions.clock(endpoint, "in", reason="operator") == "in"  # already in: none
    assert [p["meta"]["reason"] for _, p in digests] == ["operator"]


@pytest.mark.django_db
def test_clock_verbs_are_allowlist_gated(vend):
    endpoint, credential = vend("no-clock", verbs=["list_todos", "claim_next"])
    d = McpDriver(endpoint.slug, credential)
    d.initialize()
    result = d.call("clock_out")["result"]
    assert result["isError"] and result["structuredContent"]["error"]["code"] == "verb_not_allowed"
    assert Endpoint.objects.get(pk=endpoint.pk).presence_state == "in"


def test_every_todo_doorbell_fails_the_consumers_digest_rule_and_every_digest_passes():
    from types import SimpleNamespace

    for kind in ("digest", "DIGEST", "issues.opened", ""):
        todo = SimpleNamespace(pk=1, queue="q", title="t", kind=kind, source="s", trust="signed")
        assert not doorbells.is_digest(doorbells.todo_doorbell(todo))
    for reason in doorbells.DIGEST_REASONS:
        assert doorbells.is_digest(doorbells.digest_doorbell({"q": 1}, timedelta(minutes=3), reason))


@pytest.mark.django_db
def test_agent_clock_in_does_not_lift_an_operator_override(endpoint, digests,
                                                           django_capture_on_commit_callbacks):
    """Review C: an override out until T wins over the agent's clock_in (§8): still out, the
    override intact, no digest sent and no todo marked."""
    attach(endpoint)
    now = timezone.now()
    todo = make_ready_todo(endpoint, now=now)
    until = now + timedelta(hours=1)
    endpoint_transitions.clock(endpoint, "out", reason="operator", until=until, now=now)
    with django_capture_on_commit_callbacks(execute=True):
        assert endpoint_transitions.clock(endpoint, "in", reason="clock_in",
                               now=now + timedelta(minutes=1)) == "out"
    row = Endpoint.objects.get(pk=endpoint.pk)
    assert (row.presence_override, row.presence_override_until) == ("out", until)
    assert digests == []
    assert Todo.objects.get(pk=todo.pk).last_ringed_at is None


@pytest.mark.django_db
def test_reconnect_digest_has_a_cooldown(endpoint):
    """Review C: three reconnects in three seconds send one digest and move last_ringed_at
    once; a todo that arrives meanwhile, or the cooldown passing, lifts it."""
    session = attach(endpoint)
    now = timezone.now()
    first = make_ready_todo(endpoint, now=now - timedelta(minutes=10))

    def reconnect(at):
        return doorbells.reconnect_frames(endpoint_id=endpoint.pk, session_id=session.pk, now=at)

    assert len(reconnect(now)) == 1
    assert reconnect(now + timedelta(seconds=1)) == []
    assert reconnect(now + timedelta(seconds=2)) == []
    assert Todo.objects.get(pk=first.pk).last_ringed_at == now
    make_ready_todo(endpoint, now=now + timedelta(seconds=3))
    [(params, _)] = reconnect(now + timedelta(seconds=4))
    assert params["meta"]["pending"] == "2"
    assert reconnect(now + timedelta(seconds=5)) == []
    assert len(reconnect(now + timedelta(seconds=4 + 60))) == 1
