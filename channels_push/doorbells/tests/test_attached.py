"""Who is rung (CONTRACT §7, issue 13 items 9, 10, 13, 16): "attached" means an open stream now
or a request within the attach window; a digest wakes one worker per waiting todo; a todo back
to pending from a lapsed lease or a release rings like a new one; every ring that reaches no
stream is logged and counted. Clock driven with ``now=``, never by sleeping."""

import ast
import asyncio
import logging
from datetime import timedelta
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from django.utils import timezone

from tests.factories import credential_for
from channels_push.sessions import notify as session_notify
from channels_push.doorbells import sweeps
from channels_push.doorbells import doorbells
from switchboard import metrics
from channels_push.sessions import transitions as session_transitions
from channels_push.doorbells import rings
from channels_push.models import McpSession
from channels_push.tests.conftest import McpDriver, make_ready_todo
from channels_push.doorbells.tests.test_doorbells import close, next_doorbell, next_ring, open_stream, ring
from endpoints import transitions as endpoint_transitions
from tests.processes import DEADLINE_SECONDS
from todos import sweeps as todo_sweeps
from todos.models import Todo


def open_session(endpoint, now, *, stream=False):
    session = session_transitions.open_session(endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25",
                                               now=now)
    if stream:
        session_transitions.attach_stream(endpoint=endpoint, session_id=session.pk, now=now)
    return session


# -- 13.9: attached = an open stream now, or a request within the attach window -----------------


@pytest.mark.django_db
def test_a_client_that_vanished_without_delete_is_no_receiver_after_the_attach_window(
        endpoint, settings, digests):
    settings.SWITCHBOARD_ATTACH_WINDOW = timedelta(seconds=120)
    now = timezone.now()
    vanished = open_session(endpoint, now - timedelta(seconds=121))  # its last request
    todo = make_ready_todo(endpoint, now=now - timedelta(hours=1))
    # Not attached: the todo doorbell, the sweep and the digest all pass it by.
    assert rings.choose_doorbell_session(
        endpoint_id=endpoint.pk, todo_id=todo.pk, now=now) is None
    assert sweeps.ring_due_todos(now=now) == 0
    assert (Todo.objects.get(pk=todo.pk).ring_attempts, McpSession.objects.get(
        pk=vanished.pk).last_doorbell_at) == (0, None)
    endpoint_transitions.clock(endpoint, "out", reason="operator", now=now)
    assert doorbells.send_digest(endpoint, "operator", now=now) == 0 and digests == []
    # A request inside the window attaches it again.
    assert session_transitions.touch_session(endpoint=endpoint, session_id=vanished.pk, now=now)
    assert rings.choose_doorbell_session(
        endpoint_id=endpoint.pk, todo_id=todo.pk, now=now + timedelta(seconds=119)) == (
        vanished.pk, False)


@pytest.mark.django_db
def test_overnight_with_a_client_that_just_disappears(endpoint):
    """SPEC-0011 "agent offline overnight" without a DELETE: the agent's last request was at
    17:55, a todo arrives at 18:00, sweeps run all night: no ring budget is spent."""
    evening = timezone.now().replace(microsecond=0) - timedelta(days=1)
    open_session(endpoint, evening - timedelta(minutes=5))  # never DELETEd (Claude Code)
    todo = make_ready_todo(endpoint, now=evening)
    for minutes in range(5, 15 * 60, 10):  # sweeps all night (the idle expiry is an hour away)
        assert sweeps.ring_due_todos(now=evening + timedelta(minutes=minutes)) == 0
    row = Todo.objects.get(pk=todo.pk)
    assert (row.ring_attempts, row.last_ringed_at, row.state) == (0, None, "pending")


@pytest.mark.django_db
def test_an_open_stream_counts_only_while_a_lease_runs(endpoint):
    """A keep-alive does not write the session row: an open stream counts while the lease its
    attach granted runs, or while the process holding it renews its host lease (one row for
    all its streams); a count left by a process that died stops counting when both ran out."""
    from channels_push.sessions import queries

    now = timezone.now()
    opened = now - timedelta(hours=1)
    session_transitions.register_stream_host(host_id="proc", now=opened)
    streaming = open_session(endpoint, opened)
    assert session_transitions.attach_stream(endpoint=endpoint, session_id=streaming.pk,
                                             host_id="proc", now=opened)
    todo = make_ready_todo(endpoint, now=now - timedelta(hours=2))
    lease_end = opened + queries.stream_lease()
    assert rings.choose_doorbell_session(
        endpoint_id=endpoint.pk, todo_id=todo.pk, now=lease_end - timedelta(seconds=1)) == (
        streaming.pk, True)
    assert rings.choose_doorbell_session(
        endpoint_id=endpoint.pk, todo_id=todo.pk, now=lease_end) is None  # its process died
    assert session_transitions.renew_stream_host(host_id="proc", now=now)  # ... or not
    assert rings.choose_doorbell_session(
        endpoint_id=endpoint.pk, todo_id=todo.pk, now=now + timedelta(minutes=4)) == (
        streaming.pk, True)


# -- 13.10: a digest wakes one worker per waiting todo --------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("pending, woken", [(1, 1), (2, 2), (5, 3)])
def test_presence_digest_goes_to_min_pending_attached_sessions(endpoint, digests, pending, woken):
    now = timezone.now()
    sessions = [open_session(endpoint, now, stream=True) for _ in range(3)]
    for i in range(pending):
        make_ready_todo(endpoint, title=f"t{i}")
    assert doorbells.send_digest(endpoint, "clock_in", now=now) == woken
    assert len(digests) == woken
    assert len({session_id for session_id, _ in digests}) == woken
    assert {session_id for session_id, _ in digests} <= {s.pk for s in sessions}


@pytest.mark.django_db
def test_digest_prefers_open_streams_and_rotates(endpoint, digests):
    now = timezone.now()
    streamless = open_session(endpoint, now)
    a = open_session(endpoint, now, stream=True)
    b = open_session(endpoint, now, stream=True)
    make_ready_todo(endpoint)
    first = doorbells.send_digest(endpoint, "operator", now=now)
    second = doorbells.send_digest(endpoint, "operator", now=now + timedelta(seconds=1))
    assert (first, second) == (1, 1)
    assert {digests[0][0], digests[1][0]} == {a.pk, b.pk}  # in turn, never the streamless one
    assert streamless.pk not in {session_id for session_id, _ in digests}


# -- 13.13: a lapsed lease or a release rings like a retry ---------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("how", ["lease_lapsed", "release"])
def test_a_todo_back_to_pending_rings_again(vend, how):
    endpoint, credential = vend("again")
    d = McpDriver(endpoint.slug, credential)
    d.initialize()
    worker = McpDriver(endpoint.slug, credential)
    worker.initialize()

    async def scenario():
        stream = await open_stream(d)
        todo = await ring(endpoint, title="comes back")
        assert (await next_ring(stream))["meta"]["todo_id"] == str(todo.pk)
        call = database_sync_to_async(worker.call, thread_sensitive=False)
        claimed = await call("claim", {"todo_id": str(todo.pk), "lease_ttl_seconds": 1})
        assert not claimed["result"]["isError"], claimed
        if how == "release":
            assert not (await call("release", {"todo_id": str(todo.pk)}))["result"]["isError"]
        else:
            reap = database_sync_to_async(todo_sweeps.expire_lapsed_leases, thread_sensitive=False)
            assert await reap(now=timezone.now() + timedelta(seconds=2)) == 1
        params = await next_doorbell(stream)  # rung again, exactly like a new todo
        assert params["meta"]["todo_id"] == str(todo.pk)
        await close(stream)
        return todo

    todo = async_to_sync(scenario)()
    assert Todo.objects.get(pk=todo.pk).state == "pending"


@pytest.mark.django_db
def test_a_lapse_on_the_last_attempt_rings_nobody(endpoint, agent):
    from todos import transitions

    session = open_session(endpoint, timezone.now(), stream=True)
    todo = make_ready_todo(endpoint)
    Todo.objects.filter(pk=todo.pk).update(max_attempts=1)
    rung_at = McpSession.objects.get(pk=session.pk).last_doorbell_at
    claimed = transitions.claim_todo(agent, todo.pk, lease_ttl_seconds=1)
    [dead] = transitions.return_lapsed_leases(now=claimed.lease_expires_at, limit=10)
    assert dead.state == "failed"
    doorbells.ring_ready_todo(dead, {"action": "lease_lapsed"})
    assert McpSession.objects.get(pk=session.pk).last_doorbell_at == rung_at


# -- 13.16: every ring that reaches no stream is logged and counted -------------------------------


@pytest.mark.django_db
def test_a_sweep_ring_to_a_streamless_session_is_logged_and_counted(
        endpoint, caplog, django_capture_on_commit_callbacks):
    now = timezone.now()
    open_session(endpoint, now)  # attached by a request, no stream
    todo = make_ready_todo(endpoint, now=now - timedelta(minutes=6))
    caplog.set_level(logging.INFO, logger="switchboard.doorbell")
    dropped_before = metrics.read_doorbell_counts()["dropped|session_has_no_open_stream"]
    with django_capture_on_commit_callbacks(execute=True):
        assert sweeps.ring_due_todos(now=now) == 1
    [line] = [r for r in caplog.records if r.getMessage().startswith("doorbell dropped")]
    assert line.levelno == logging.INFO
    assert (line.endpoint, line.todo_id) == (endpoint.slug, str(todo.pk))
    assert (metrics.read_doorbell_counts()["dropped|session_has_no_open_stream"]
            == dropped_before + 1)


@pytest.mark.django_db
def test_a_ring_with_nobody_attached_is_logged_at_info(
        endpoint, caplog, django_capture_on_commit_callbacks):
    caplog.set_level(logging.INFO, logger="switchboard.doorbell")
    with django_capture_on_commit_callbacks(execute=True):
        todo = make_ready_todo(endpoint)
    [line] = [r for r in caplog.records if r.getMessage().startswith("doorbell dropped")]
    assert line.levelno == logging.INFO and line.todo_id == str(todo.pk)


def _doorbell_samples(values, outcome: str) -> float:
    """Every sample of switchboard_doorbells_<outcome>_total in a scrape, whatever its labels."""
    return sum(count for (name, _), count in values.items()
               if name == f"switchboard_doorbells_{outcome}_total")


@pytest.mark.django_db
def test_a_todo_claimed_before_its_ring_is_skipped_not_dropped(endpoint, agent, caplog, client):
    """Sessions are attached, and an agent claims the todo before its doorbell goes out: that
    is no drop and no missing session, and is counted apart."""
    from todos import transitions
    from console.tests.test_metrics import scrape, value

    now = timezone.now()
    open_session(endpoint, now, stream=True)
    todo = make_ready_todo(endpoint)  # its ring waits for a commit this test never runs
    transitions.claim_todo(agent, todo.pk)
    before = scrape(client)
    caplog.set_level(logging.INFO, logger="switchboard.doorbell")
    assert doorbells.ring_todo(todo, now=now) is None
    lines = [r for r in caplog.records if r.getMessage().startswith("doorbell")]
    assert [r.getMessage() for r in lines] == ["doorbell skipped: already claimed"]
    assert (lines[0].levelno, lines[0].todo_id) == (logging.INFO, str(todo.pk))
    after = scrape(client)
    assert _doorbell_samples(after, "dropped") == _doorbell_samples(before, "dropped")
    assert (value(after, "switchboard_doorbells_skipped_total", reason="already_claimed")
            - value(before, "switchboard_doorbells_skipped_total", reason="already_claimed")) == 1


@pytest.mark.django_db
def test_a_todo_cancelled_before_its_ring_is_skipped_as_cancelled(endpoint, caplog):
    from todos import transitions

    open_session(endpoint, timezone.now(), stream=True)
    todo = make_ready_todo(endpoint)
    transitions.cancel_todo(transitions.Caller.operator(endpoint, "alice"), todo.pk)
    caplog.set_level(logging.INFO, logger="switchboard.doorbell")
    assert doorbells.ring_todo(todo) is None
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("doorbell")] \
        == ["doorbell skipped: cancelled"]


@pytest.mark.django_db(transaction=True)
def test_a_drop_decided_in_another_process_reaches_this_processs_metrics(endpoint, client):
    """The heartbeat sweep runs in a Celery worker (here the same sweep, by manage.py in a
    process of its own): its drops must show on a web process's /metrics."""
    import subprocess

    from tests.processes import PYTHON, ROOT, child_env
    from console.tests.test_metrics import scrape, value

    now = timezone.now()
    open_session(endpoint, now)  # attached by a request, no stream: the ring is dropped
    make_ready_todo(endpoint, now=now - timedelta(minutes=6))
    before = scrape(client)
    done = subprocess.run([PYTHON, "manage.py", "sweep_doorbells", "--json"], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert '"rung": 1' in done.stdout, done.stdout + done.stderr
    after = scrape(client)
    assert _doorbell_samples(after, "dropped") - _doorbell_samples(before, "dropped") == 1
    reason = "session_has_no_open_stream"
    assert (value(after, "switchboard_doorbells_dropped_total", reason=reason)
            - value(before, "switchboard_doorbells_dropped_total", reason=reason)) == 1


# -- the shared piece has its own module (STYLE "Lessons": no import circles) --------------------


def _imports(module: str) -> set:
    tree = ast.parse((Path(__file__).resolve().parents[2] / f"{module}.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names.update(alias.name for alias in node.names)
            names.add(node.module or "")
    return names


def test_doorbells_transport_and_tools_do_not_import_each_other_in_a_circle():
    assert not {name for name in _imports("doorbells/doorbells") if "mcp" in name.split(".")}
    assert "doorbells" not in _imports("mcp/tools")
    # The sender (sessions/notify.py, which the doorbell calls) and the transport share only
    # the group names of bus/groups.py.
    assert {"channels_push.sessions", "notify"} <= _imports("doorbells/doorbells")
    assert "groups" in _imports("sessions/notify")
    assert "channels_push.bus.groups" in _imports("mcp/shell")


@pytest.mark.django_db
def test_clock_in_by_the_agent_wakes_one_worker_for_one_todo(
        endpoint, digests, django_capture_on_commit_callbacks):
    now = timezone.now()
    for _ in range(3):
        open_session(endpoint, now, stream=True)
    make_ready_todo(endpoint)
    endpoint_transitions.clock(endpoint, "out", reason="clock_in")
    with django_capture_on_commit_callbacks(execute=True):
        endpoint_transitions.clock(endpoint, "in", reason="clock_in")
    assert [params["meta"]["reason"] for _, params in digests] == ["clock_in"]


@pytest.mark.django_db(transaction=True)
def test_an_idle_stream_writes_nothing_and_its_process_renews_one_row(vend, settings):
    """Issue 17: a stream's keep-alives cost no write; the process's heartbeat renews its one
    StreamHost row for every stream it holds, which keeps the streams counting as open."""
    from channels_push.models import StreamAttachment, StreamHost

    from channels.routing import URLRouter
    from django.urls import re_path

    from channels_push.mcp import shell as mcp_shell

    settings.SWITCHBOARD_STREAM_LEASE_SECONDS = 1.0  # renewed every 0.4 s
    endpoint, credential = vend("renews")
    drivers = [McpDriver(endpoint.slug, credential) for _ in range(3)]
    for d in drivers:
        d.initialize()
    process = mcp_shell.McpEndpoint(keepalive_seconds=0.2)  # one process's streams
    app = URLRouter([re_path(mcp_shell.ROUTE_PATTERN, process)])

    def state():
        return (list(StreamHost.objects.values_list("pk", "lease_until")),
                sorted(StreamAttachment.objects.values_list("session_id", "host_id")),
                sorted(McpSession.objects.values_list("pk", "last_seen_at")))

    read_state = database_sync_to_async(state, thread_sensitive=False)

    async def state_when(predicate, deadline_seconds=DEADLINE_SECONDS):
        """The first state that satisfies ``predicate``, polled until a deadline."""
        deadline = asyncio.get_running_loop().time() + deadline_seconds
        while not predicate(found := await read_state()):
            assert asyncio.get_running_loop().time() < deadline, found
            await asyncio.sleep(0.05)  # poll interval, bounded by the deadline above
        return found

    async def scenario():
        streams = [await open_stream(d, app) for d in drivers]
        before = await state_when(lambda found: len(found[1]) == len(drivers))
        (_, first_lease), = before[0]
        # Two renewals later (a handful of keep-alives of every stream, each a re-check).
        renewed = await state_when(lambda found: found[0][0][1] > first_lease)
        after = await state_when(lambda found: found[0][0][1] > renewed[0][0][1])
        for stream in streams:
            await close(stream)
        return before, after

    before, after = async_to_sync(scenario)()
    (host, leased_before), = before[0]
    assert host == process.heartbeat.host_id
    assert before[1] == sorted((d.session_id, host) for d in drivers)
    (_, leased_after), = after[0]
    assert leased_after > leased_before  # the one row renewed
    assert after[1:] == before[1:]  # no session row written by the streams' keep-alives
    assert not StreamAttachment.objects.exists()  # closed: detached


@pytest.mark.django_db
def test_paused_and_override_answers_validate_against_the_output_schemas(endpoint):
    import jsonschema

    from channels_push.mcp import schemas as mcp_schemas

    paused = {"empty": True, "paused": ["*"]}
    override = {"presence": "out", "override_until": "2099-01-01T00:00:00Z"}
    jsonschema.validate(paused, mcp_schemas.OUTPUT_SCHEMAS["claim_next"])
    jsonschema.validate(override, mcp_schemas.OUTPUT_SCHEMAS["clock_in"])
    assert "paused" in mcp_schemas.OUTPUT_SCHEMAS["claim_next"]["properties"]
