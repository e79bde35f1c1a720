"""End to end: the official mcp SDK client against a real daphne process (CONTRACT §6)."""

import asyncio
from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from channels_push.models import McpSession
from endpoints import transitions as endpoint_transitions
from tests.factories import UserFactory
from tests.mcp_clients import sdk_client
from tests.processes import poll
from todos import transitions
from todos.models import Todo

pytestmark = pytest.mark.django_db(transaction=True)


def vend(slug, **kwargs):
    owner = UserFactory(username=f"owner-{slug}")
    return endpoint_transitions.vend_endpoint(slug=slug, owner=owner, **kwargs)


def parse_time(text):
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def add_todos(endpoint, *titles, queue="inbox"):
    return [transitions.create_todo(endpoint=endpoint, queue=queue, title=title, actor="test")[0]
            for title in titles]


def test_initialize_and_tools_list_with_the_sdk(daphne_server):
    endpoint, credential = vend("e2e-init", default_lease_seconds=420)

    async def scenario():
        async with sdk_client(daphne_server.url, endpoint.slug, credential) as client:
            tools = await client.list_tools()
            return (client.protocol_version, client.server_info.name,
                    client.server_capabilities, client.instructions,
                    [tool.name for tool in tools.tools])

    version, name, capabilities, instructions, tools = asyncio.run(scenario())
    assert version == "2025-11-25"
    assert name == "switchboard"
    assert capabilities.tools is not None
    assert capabilities.experimental == {"claude/channel": {}}
    assert "420 seconds" in instructions and len(instructions) <= 2048
    assert tools == ["list_todos", "claim", "claim_next", "heartbeat", "complete", "fail",
                     "cancel", "release", "post_update", "repo_token", "read_secret", "clock_in",
                     "clock_out"]


def test_worker_loop_claim_next_heartbeat_complete_and_fail_then_retry(daphne_server):
    endpoint, credential = vend("e2e-worker")
    first, second = add_todos(endpoint, "first", "second")

    async def scenario():
        async with sdk_client(daphne_server.url, endpoint.slug, credential) as client:
            claimed = (await client.call_tool("claim_next", {})).structured_content["todo"]
            beat = await client.call_tool("heartbeat", {"todo_id": claimed["id"],
                                                        "lease_ttl_seconds": 120})
            done = await client.call_tool("complete", {"todo_id": claimed["id"],
                                                       "lease_id": claimed["lease_id"],
                                                       "result": {"summary": "ok"}})
            failing = (await client.call_tool("claim_next", {})).structured_content["todo"]
            failed = await client.call_tool("fail", {"todo_id": failing["id"],
                                                     "error": "flaky upstream"})
            empty = await client.call_tool("claim_next", {})
            return claimed, beat, done, failing, failed, empty

    claimed, beat, done, failing, failed, empty = asyncio.run(scenario())
    assert claimed["id"] == str(first.pk)
    assert not beat.is_error and beat.structured_content["todo"]["state"] == "claimed"
    assert done.structured_content["todo"]["state"] == "done"
    assert done.structured_content["todo"]["result"] == {"summary": "ok"}
    assert failing["id"] == str(second.pk)
    assert failed.structured_content["todo"]["state"] == "failed"
    assert failed.structured_content["todo"]["retry_at"] is not None
    assert empty.structured_content == {"empty": True}

    # The retry promoter (a sweep) brings the failed todo back once its backoff has passed.
    transitions.promote_due_retries(now=timezone.now() + timedelta(minutes=1), limit=10)

    async def retry():
        async with sdk_client(daphne_server.url, endpoint.slug, credential) as client:
            return (await client.call_tool("claim_next", {})).structured_content["todo"]

    retried = asyncio.run(retry())
    assert retried["id"] == str(second.pk) and retried["attempts"] == 2


def test_two_clients_get_different_todos_and_another_endpoint_sees_none(daphne_server):
    endpoint, credential = vend("e2e-pool")
    stranger, stranger_credential = vend("e2e-stranger")
    todos = add_todos(endpoint, *[f"t{i}" for i in range(6)])

    async def drain(slug, cred):
        got = []
        async with sdk_client(daphne_server.url, slug, cred) as client:
            while True:
                result = await client.call_tool("claim_next", {})
                if result.structured_content.get("empty"):
                    return got
                got.append(result.structured_content["todo"]["id"])

    async def scenario():
        async with sdk_client(daphne_server.url, stranger.slug, stranger_credential) as client:
            listed = await client.call_tool("list_todos", {})
            by_id = await client.call_tool("claim", {"todo_id": str(todos[0].pk)})
            nothing = await client.call_tool("claim_next", {})
        first, second = await asyncio.gather(drain(endpoint.slug, credential),
                                             drain(endpoint.slug, credential))
        return listed, by_id, nothing, first, second

    listed, by_id, nothing, first, second = asyncio.run(scenario())
    assert listed.structured_content == {"todos": [], "next_cursor": None, "has_more": False}
    assert by_id.is_error and by_id.structured_content["error"]["code"] == "not_found"
    assert nothing.structured_content == {"empty": True}
    assert not set(first) & set(second)
    assert sorted(first + second, key=int) == [str(t.pk) for t in todos]
    assert Todo.objects.filter(endpoint=endpoint, state="claimed").count() == 6


def test_a_server_restart_between_two_tool_calls_keeps_the_session(daphne_server):
    endpoint, credential = vend("e2e-restart")
    add_todos(endpoint, "before", "after")

    async def scenario():
        async with sdk_client(daphne_server.url, endpoint.slug, credential) as client:
            before = await client.call_tool("claim_next", {})
            await asyncio.to_thread(daphne_server.restart)
            after = await client.call_tool("claim_next", {})
            listed = await client.call_tool("list_todos", {"state": "claimed"})
            return before, after, listed

    before, after, listed = asyncio.run(scenario())
    assert not before.is_error and not after.is_error
    owners = {t["lease_owner"] for t in listed.structured_content["todos"]}
    # Both claims were made by the same MCP session, across the restart: no 404, no
    # re-initialize (a second session would show up as a second row and a second owner).
    assert len(owners) == 1
    sessions = list(McpSession.objects.filter(endpoint=endpoint))
    # (Agents see owners as an 8-character hint, CONTRACT §12.)
    assert len(sessions) == 1 and sessions[0].pk[:8] in owners


def test_sdk_client_opens_the_stream_and_the_count_follows_it(daphne_server):
    endpoint, credential = vend("e2e-stream")

    def open_streams():
        row = McpSession.objects.filter(endpoint=endpoint).first()
        return row.open_streams if row else None

    async def scenario():
        async with sdk_client(daphne_server.url, endpoint.slug, credential) as client:
            await client.call_tool("list_todos", {})
            return await asyncio.to_thread(poll, lambda: open_streams() == 1)

    assert asyncio.run(scenario())
    assert poll(lambda: open_streams() == 0)
    assert McpSession.objects.get(endpoint=endpoint).terminated_at is not None  # DELETE on exit
    assert credential not in daphne_server.log_text()


def test_the_amended_agent_contract_through_the_sdk(daphne_server):
    """Issue 13 items 1, 2, 3, 4, 5, 6, 8 as an agent sees them through the official SDK
    client (which also validates every successful structuredContent against the tool's
    outputSchema)."""
    endpoint, credential = vend("e2e-contract", default_lease_seconds=60)
    todos = add_todos(endpoint, *[f"t{i}" for i in range(120)])

    async def scenario():
        async with sdk_client(daphne_server.url, endpoint.slug, credential) as client:
            seen = {}
            tools = {tool.name: tool for tool in (await client.list_tools()).tools}
            seen["annotations"] = {name: (tool.annotations.read_only_hint,
                                          tool.annotations.idempotent_hint,
                                          tool.output_schema is not None)
                                   for name, tool in tools.items()}
            # 13.5: the whole queue in pages.
            listed, cursor = [], None
            while True:
                page = (await client.call_tool(
                    "list_todos", {"limit": 50, **({"cursor": cursor} if cursor else {})}
                )).structured_content
                listed += [todo["id"] for todo in page["todos"]]
                cursor = page["next_cursor"]
                if not page["has_more"]:
                    break
            seen["listed"] = listed
            # 13.1: a long lease is not shortened by a heartbeat without a ttl.
            long = (await client.call_tool("claim", {"todo_id": int(todos[0].pk),
                                                     "lease_ttl_seconds": 3600})).structured_content
            seen["long"] = (await client.call_tool(
                "heartbeat", {"todo_id": long["todo"]["id"]})).structured_content["todo"]
            # 13.4: complete twice with the same lease.
            done = await client.call_tool("complete", {"todo_id": long["todo"]["id"],
                                                       "lease_id": long["todo"]["lease_id"]})
            again = await client.call_tool("complete", {"todo_id": long["todo"]["id"],
                                                        "lease_id": long["todo"]["lease_id"]})
            seen["done"], seen["again"] = done.structured_content["todo"], again
            # 13.2: a lapsed lease is lost before the reaper runs (no reaper here).
            short = (await client.call_tool("claim", {"todo_id": str(todos[1].pk),
                                                      "lease_ttl_seconds": 1})).structured_content
            lapsed = parse_time(short["todo"]["lease_expires_at"])
            while timezone.now() <= lapsed:
                await asyncio.sleep(0.05)  # waiting for the wall clock the lease runs on
            seen["lapsed"] = await client.call_tool("complete", {"todo_id": short["todo"]["id"]})
            # 13.3: an operator override ends the agent's lease; the next call is lease_lost.
            held = (await client.call_tool("claim", {"todo_id": str(todos[2].pk)})
                    ).structured_content["todo"]
            await asyncio.to_thread(override_release, endpoint, held["id"])
            seen["overridden"] = await client.call_tool("heartbeat", {"todo_id": held["id"]})
            # 13.6: a wrong type is a tool result the model sees.
            seen["bad"] = await client.call_tool("claim", {"todo_id": ["1"]})
            return seen

    def override_release(endpoint, todo_id):
        todo = Todo.objects.get(pk=todo_id)
        operator = transitions.Caller.operator(endpoint, "alice")
        transitions.release_todo(operator, todo_id, overriding=transitions.HeldLease.of(todo))

    seen = asyncio.run(scenario())
    assert seen["listed"] == [str(t.pk) for t in todos]
    assert seen["annotations"]["list_todos"] == (True, True, True)
    assert seen["annotations"]["claim"] == (False, False, True)
    assert (parse_time(seen["long"]["lease_expires_at"]) - timezone.now()).total_seconds() > 3500
    assert seen["done"]["state"] == "done" and seen["done"]["lease_id"] is None
    assert seen["again"].is_error
    assert seen["again"].structured_content["error"]["code"] == "already_done"
    assert seen["lapsed"].is_error
    assert seen["lapsed"].structured_content["error"]["code"] == "lease_lost"
    assert Todo.objects.get(pk=todos[1].pk).state == "claimed"  # the reaper moves it, later
    assert seen["overridden"].structured_content["error"]["code"] == "lease_lost"
    assert seen["bad"].is_error
    assert seen["bad"].structured_content["error"]["code"] == "invalid_argument"
    assert "todo_id" in seen["bad"].structured_content["error"]["message"]
