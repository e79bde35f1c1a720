"""Scheduled todos and priority at the push edge (docs/work-control.md): a scheduled todo is
not rung, digested or handed to a long poll until it comes due, then it is ready exactly as a
new todo; the MCP tools show and refuse it."""

import asyncio
from datetime import timedelta

import jsonschema
import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from django.utils import timezone

from channels_push.mcp import longpoll
from channels_push.mcp import schemas as mcp_schemas
from channels_push.mcp import tools as mcp_tools
from channels_push.tests.conftest import make_ready_todo
from channels_push.doorbells.tests.test_doorbells import close, next_doorbell, next_ring, open_stream, ring
from channels_push.doorbells.tests.test_doorbells import driver  # noqa: F401 (fixture)
from todos import ring_budget
from todos import sweeps as todo_sweeps
from todos import transitions as todo_transitions
from todos.models import Todo

pytestmark = pytest.mark.django_db(transaction=True)


def later(**delta):
    return timezone.now() + timedelta(**delta)


@pytest.mark.parametrize("becomes_ready", ["due", "run_now"])
def test_a_scheduled_todo_rings_only_when_it_becomes_ready(driver, becomes_ready):  # noqa: F811
    d = driver()

    def make_ready(todo):
        if becomes_ready == "due":
            assert todo_sweeps.release_due_scheduled_todos(now=later(hours=2)) == 1
        else:
            todo_transitions.run_now_todo(
                todo_transitions.Caller.operator(d.endpoint, "alice"), todo.pk)

    async def scenario():
        stream = await open_stream(d)
        scheduled = await ring(d.endpoint, title="tonight", not_before=later(hours=1))
        control = await ring(d.endpoint, title="now")
        # The first doorbell is the control's: the scheduled todo rang nothing.
        assert (await next_ring(stream))["meta"]["todo_id"] == str(control.pk)
        await database_sync_to_async(make_ready, thread_sensitive=False)(scheduled)
        params = await next_ring(stream)
        await close(stream)
        return scheduled, params

    scheduled, params = async_to_sync(scenario)()
    assert params["meta"]["todo_id"] == str(scheduled.pk)
    row = Todo.objects.get(pk=scheduled.pk)
    assert row.not_before is None


def test_digests_and_the_ring_sweep_leave_scheduled_todos_out(
        driver, settings):  # noqa: F811
    settings.SWITCHBOARD_ATTACH_WINDOW = timedelta(days=1)
    d = driver()
    now = timezone.now()
    scheduled = make_ready_todo(d.endpoint, title="later", not_before=now + timedelta(hours=1),
                                now=now - timedelta(hours=1))
    ready = make_ready_todo(d.endpoint, title="ready", now=now - timedelta(hours=1))
    statement = ring_budget.sweep_rings_sql(
        receivers={d.endpoint.pk: None}, schedule=(timedelta(minutes=5), timedelta(minutes=20)),
        limit=10, now=now, select_only=True)
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(*statement)
        picked = {row[0] for row in cursor.fetchall()}
    assert picked == {ready.pk}
    counted = ring_budget.record_digest(endpoint=d.endpoint, now=now)
    assert len(counted) == 1
    assert Todo.objects.get(pk=scheduled.pk).ring_attempts == 0


def change(todo_id, **extra):
    return {"action": "create", "todo_id": str(todo_id), "endpoint_id": 1, "queue": "inbox",
            "state": "pending", **extra}


def test_a_scheduled_todo_wakes_no_long_poll_until_it_is_announced_ready():
    loop = asyncio.new_event_loop()
    try:
        room = longpoll.WaitRoom(loop, follow=False)
        room.following_since = loop.time() - 100
        waiter = room.add(1, None, started_at=loop.time())
        room.on_changes([change(10, scheduled=True)])
        assert waiter.idle and not room.unserved.get(1)
        room.on_changes([change(10, action="due", scheduled=False)])
        assert waiter.woken_for == "10"
        other = room.add(1, None, started_at=loop.time())
        room.on_changes([change(11, action="run_now", scheduled=False)])
        assert other.woken_for == "11"
    finally:
        loop.close()


def call(endpoint, name, arguments=None):
    return mcp_tools.call_tool(endpoint=endpoint, session_id="session-a",
                               params={"name": name, "arguments": arguments or {}})


def test_the_mcp_tools_show_priority_and_schedule_and_refuse_a_scheduled_claim(vend):
    endpoint, _ = vend("tools")
    at = later(hours=1)
    scheduled = make_ready_todo(endpoint, title="later", not_before=at, priority=5)
    ready = make_ready_todo(endpoint, title="ready", priority=-3)
    schemas = {tool.name: tool.output_schema for tool in mcp_schemas.tools_for(endpoint)}

    refused = call(endpoint, "claim", {"todo_id": str(scheduled.pk)})
    assert refused.is_error
    assert refused.structured_content["error"]["code"] == "scheduled"
    jsonschema.validate(refused.structured_content, schemas["claim"])

    listed = call(endpoint, "list_todos", {"scheduled": True}).structured_content
    jsonschema.validate(listed, schemas["list_todos"])
    assert [(t["id"], t["priority"]) for t in listed["todos"]] == [(str(scheduled.pk), 5)]
    assert listed["todos"][0]["not_before"] == at.isoformat().replace("+00:00", "Z")
    unscheduled = call(endpoint, "list_todos", {"scheduled": False}).structured_content
    assert [t["id"] for t in unscheduled["todos"]] == [str(ready.pk)]
    assert call(endpoint, "list_todos", {"scheduled": "yes"}).is_error

    claimed = call(endpoint, "claim_next").structured_content
    jsonschema.validate(claimed, schemas["claim_next"])
    assert claimed["todo"]["id"] == str(ready.pk) and claimed["todo"]["priority"] == -3
    assert call(endpoint, "claim_next").structured_content == {"empty": True}
