"""Long-poll claim_next (CONTRACT §6) through the real ASGI application, in-process: the
answer over SSE (or JSON), the deadline, every kind of readiness waking a waiter, keep-alives
and progress, and a client that leaves claiming nothing. Wake-ups travel over the real channel
layer (Redis when REDIS_URL is set), so these tests commit (transaction=True).

Across real daphne processes: tests/test_long_poll_e2e.py."""

import json
import time
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import ApplicationCommunicator, HttpCommunicator
from django.utils import timezone

from channels_push.bus import publish
from channels_push.mcp import longpoll
from channels_push.tests.conftest import McpDriver, application, make_ready_todo
from tests.processes import DEADLINE_SECONDS
from todos import transitions
from todos.models import State, Todo

pytestmark = pytest.mark.django_db(transaction=True)

ACCEPT_JSON_ONLY = "application/json"


class Call:
    """One tools/call claim_next POST in flight, read chunk by chunk."""

    def __init__(self, driver: McpDriver, arguments: dict, *, accept=None, meta=None,
                 request_id=7):
        params = {"name": "claim_next", "arguments": arguments}
        if meta is not None:
            params["_meta"] = meta
        self.body = json.dumps({"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                                "params": params}).encode()
        overrides = {"accept": accept} if accept else {}
        headers = [(k.encode(), v.encode()) for k, v in driver.headers(**overrides).items()]
        self.communicator = ApplicationCommunicator(application, {
            "type": "http", "http_version": "1.1", "method": "POST",
            "path": f"/mcp/{driver.slug}", "query_string": b"", "headers": headers})
        self.chunks = []  # (monotonic time, bytes)

    async def start(self):
        await self.communicator.send_input({"type": "http.request", "body": self.body})
        return self

    async def response(self, timeout=DEADLINE_SECONDS):
        start = await self.communicator.receive_output(timeout)
        assert start["type"] == "http.response.start"
        self.status = start["status"]
        self.headers = {k.decode(): v.decode() for k, v in start["headers"]}
        while True:
            chunk = await self.communicator.receive_output(timeout)
            self.chunks.append((time.monotonic(), chunk["body"]))
            if not chunk.get("more_body"):
                return self

    @property
    def text(self) -> str:
        return b"".join(body for _, body in self.chunks).decode()

    def messages(self) -> list[dict]:
        """The JSON-RPC messages of an SSE answer, in order."""
        return [json.loads(line[len("data: "):]) for line in self.text.splitlines()
                if line.startswith("data: ")]

    def result(self) -> dict:
        if self.headers["content-type"] == "application/json":
            return json.loads(self.text)
        return self.messages()[-1]


def run(scenario):
    return async_to_sync(scenario)()


async def waiting(endpoint_id, count=1, deadline_seconds=DEADLINE_SECONDS):
    """Until ``count`` waiters of the endpoint are parked in this loop's wait room."""
    import asyncio

    end = time.monotonic() + deadline_seconds
    while len(longpoll.room().waiters.get(endpoint_id, [])) < count:
        assert time.monotonic() < end, "the long poll never started waiting"
        await asyncio.sleep(0.01)  # poll interval, bounded by the deadline above


@pytest.fixture
def agent(mcp):
    mcp.initialize()
    return mcp


def claimed_id(result) -> str:
    return result["result"]["structuredContent"]["todo"]["id"]


@pytest.mark.parametrize("wait_seconds", [-1, 60.5, 3600])
def test_wait_seconds_outside_0_to_60_is_an_invalid_argument(agent, wait_seconds):
    reply = agent.call("claim_next", {"wait_seconds": wait_seconds})
    assert reply["result"]["isError"] is True
    assert reply["result"]["structuredContent"]["error"]["code"] == "invalid_argument"
    assert "wait_seconds" in reply["result"]["structuredContent"]["error"]["message"]


def test_the_schema_and_instructions_offer_the_long_poll(agent):
    tools = agent.rpc("tools/list").json["result"]["tools"]
    schema = next(t for t in tools if t["name"] == "claim_next")["inputSchema"]
    assert schema["properties"]["wait_seconds"] | {"description": ""} == {
        "type": "number", "minimum": 0, "maximum": 60, "description": ""}
    instructions = agent.initialize().json["result"]["instructions"]
    assert "loop on claim_next with wait_seconds" in instructions
    assert len(instructions) <= 2048 and "repeat their values." in instructions  # not cut short


def test_a_ready_todo_is_claimed_at_once_without_waiting(agent):
    todo = make_ready_todo(agent.endpoint)
    started = time.monotonic()
    reply = agent.call("claim_next", {"wait_seconds": 60})
    # Well inside the wait, however loaded the machine: it did not wait for a wake-up.
    assert claimed_id(reply) == str(todo.pk) and time.monotonic() - started < 30


def test_nothing_ready_answers_empty_at_the_deadline_over_sse(agent):
    async def scenario():
        started = time.monotonic()
        # Long enough that a slow first claim attempt (a loaded machine) leaves most of it.
        call = await (await Call(agent, {"wait_seconds": 3}).start()).response()
        return call, time.monotonic() - started

    call, took = run(scenario)
    assert call.status == 200 and call.headers["content-type"] == "text/event-stream"
    assert call.headers["mcp-session-id"] == agent.session_id
    assert call.result() == {"jsonrpc": "2.0", "id": 7, "result": {
        "content": [{"type": "text", "text": '{"empty": true}'}],
        "structuredContent": {"empty": True}, "isError": False}}
    assert 3 <= took < 30
    # The stream opened before the wait: its first bytes are a comment, long before the answer.
    assert call.chunks[0][1].startswith(b": ") and call.chunks[-1][0] - call.chunks[0][0] > 1


def test_a_client_that_accepts_only_json_waits_and_gets_json(agent):
    async def scenario():
        return await (await Call(agent, {"wait_seconds": 0.3},
                                 accept=ACCEPT_JSON_ONLY).start()).response()

    call = run(scenario)
    assert call.status == 200 and call.headers["content-type"] == "application/json"
    assert call.result()["result"]["structuredContent"] == {"empty": True}


def _claimed_elsewhere(endpoint, **kwargs):
    todo = make_ready_todo(endpoint)
    other = transitions.Caller.agent(endpoint, "another-session")
    return transitions.claim_todo(other, todo.pk, **kwargs), other


def _failed_elsewhere(endpoint):
    todo, other = _claimed_elsewhere(endpoint)
    return transitions.fail_todo(other, todo.pk, error="boom")


# Each: (set up a todo that is not ready, make it ready) — CONTRACT §4's readiness list.
READINESS = {
    "create": (lambda endpoint: None,
               lambda endpoint, _: make_ready_todo(endpoint)),
    "release": (lambda endpoint: _claimed_elsewhere(endpoint),
                lambda endpoint, held: transitions.release_todo(held[1], held[0].pk)),
    "lease lapse": (lambda endpoint: _claimed_elsewhere(endpoint, lease_ttl_seconds=1),
                    lambda endpoint, held: transitions.return_lapsed_leases(
                        now=timezone.now() + timedelta(seconds=5), limit=10)),
    "retry promotion": (_failed_elsewhere,
                        lambda endpoint, failed: transitions.promote_due_retries(
                            now=timezone.now() + timedelta(hours=1), limit=10)),
    "requeue": (_failed_elsewhere,
                lambda endpoint, failed: transitions.requeue_todo(
                    transitions.Caller.operator(endpoint, "alice"), failed.pk)),
    # A todo created awaiting approval wakes nobody; its approval does.
    "approval": (lambda endpoint: make_ready_todo(endpoint, requires_approval=True),
                 lambda endpoint, gated: transitions.approve_todo(
                     transitions.Caller.operator(endpoint, "alice"), gated.pk)),
}


@pytest.mark.parametrize("readiness", list(READINESS))
def test_a_todo_that_becomes_ready_during_the_wait_is_claimed(agent, readiness):
    set_up, make_ready = READINESS[readiness]
    before = set_up(agent.endpoint)

    async def scenario():
        call = await Call(agent, {"wait_seconds": 60}).start()
        await waiting(agent.endpoint.pk)
        made_ready_at = time.monotonic()
        await database_sync_to_async(make_ready)(agent.endpoint, before)
        await call.response()
        return call, call.chunks[-1][0] - made_ready_at

    call, latency = run(scenario)
    todo = Todo.objects.get(endpoint=agent.endpoint)
    assert claimed_id(call.result()) == str(todo.pk)
    assert todo.state == State.CLAIMED and todo.lease_owner == agent.session_id
    assert latency < 30  # woken by the change, not by the 60 s deadline
    # The woken claim answers its todo token too (docs/security.md#the-todo-token).
    assert call.result()["result"]["structuredContent"]["todo_token"].startswith("sbt_")


def test_keep_alives_and_progress_notifications_while_waiting(agent, settings):
    settings.SWITCHBOARD_LONG_POLL_KEEPALIVE_SECONDS = 0.1

    async def scenario():
        # The wait counts from the request's arrival, so a first claim attempt that is slow
        # on a loaded machine eats into it: 3 s leaves room for 4 keep-alives however slow.
        return await (await Call(agent, {"wait_seconds": 3},
                                 meta={"progressToken": "tok-1"}).start()).response()

    call = run(scenario)
    assert call.text.count(": keep-alive\n\n") >= 4
    progress = [m["params"] for m in call.messages() if m.get("method") == "notifications/progress"]
    assert len(progress) >= 4 and all(p["progressToken"] == "tok-1" and p["total"] == 3
                                      for p in progress)
    assert [p["progress"] for p in progress] == sorted({p["progress"] for p in progress})
    assert call.result()["id"] == 7 and call.result()["result"]["structuredContent"] == {
        "empty": True}


def test_no_progress_notification_without_a_progress_token(agent, settings):
    settings.SWITCHBOARD_LONG_POLL_KEEPALIVE_SECONDS = 0.1

    async def scenario():
        return await (await Call(agent, {"wait_seconds": 1.5}).start()).response()

    call = run(scenario)
    assert ": keep-alive" in call.text
    assert [m for m in call.messages() if "method" in m] == []


def test_a_client_that_disconnects_mid_wait_claims_nothing(agent):
    async def scenario():
        call = await Call(agent, {"wait_seconds": 20}).start()
        await waiting(agent.endpoint.pk)
        await call.communicator.send_input({"type": "http.disconnect"})
        # The todo commits right behind the disconnect: the woken waiter must see it gone.
        todo = await database_sync_to_async(make_ready_todo)(agent.endpoint)
        await call.communicator.wait(timeout=DEADLINE_SECONDS)  # the application returned
        return todo

    todo = run(scenario)
    assert Todo.objects.get(pk=todo.pk).state == State.PENDING


def test_a_client_gone_between_the_claim_and_its_answer_gets_the_claim_released(agent,
                                                                               monkeypatch):
    from channels_push.mcp.shell import McpEndpoint

    claim_then_leave = McpEndpoint._retry_long_poll
    calls = []

    async def retry_and_client_leaves(self, request, answer):
        retried = await claim_then_leave(self, request, answer)
        if retried.long_poll is None:  # this retry claimed: the client leaves right now
            await calls[0].communicator.send_input({"type": "http.disconnect"})
        return retried

    monkeypatch.setattr(McpEndpoint, "_retry_long_poll", retry_and_client_leaves)

    async def scenario():
        calls.append(await Call(agent, {"wait_seconds": 20}).start())
        await waiting(agent.endpoint.pk)
        todo = await database_sync_to_async(make_ready_todo)(agent.endpoint)
        await calls[0].communicator.wait(timeout=DEADLINE_SECONDS)  # the application returned
        return todo

    todo = run(scenario)
    todo.refresh_from_db()
    assert todo.state == State.PENDING and todo.attempts == 0  # claimed, then given back
    assert list(todo.events.values_list("action", flat=True)) == ["create", "claim", "release"]


def test_a_terminated_session_gets_its_refusal_not_a_lease(agent):
    async def scenario():
        call = await Call(agent, {"wait_seconds": 20}).start()
        await waiting(agent.endpoint.pk)
        headers = [(k.encode(), v.encode()) for k, v in agent.headers().items()]
        ended = await HttpCommunicator(application, "DELETE", f"/mcp/{agent.slug}",
                                       headers=headers).get_response(timeout=DEADLINE_SECONDS)
        assert ended["status"] == 204
        await database_sync_to_async(make_ready_todo)(agent.endpoint)
        return await call.response()

    call = run(scenario)
    assert call.result()["id"] == 7 and "error" in call.result()
    assert Todo.objects.get().state == State.PENDING


def test_a_lost_wake_up_costs_latency_not_the_todo(agent, monkeypatch):
    monkeypatch.setattr(longpoll, "RECHECK_SECONDS", 0.5)

    async def scenario():
        call = await Call(agent, {"wait_seconds": 60}).start()
        await waiting(agent.endpoint.pk)
        # The announcement is lost (a Redis blip): only the re-check can find this todo.
        with monkeypatch.context() as patched:
            patched.setattr(publish, "deliver", lambda todo, change: None)
            todo = await database_sync_to_async(make_ready_todo)(agent.endpoint)
        await call.response()
        return call, todo

    call, todo = run(scenario)
    assert claimed_id(call.result()) == str(todo.pk)


def test_waiters_on_one_endpoint_each_get_a_different_todo_or_time_out(agent):
    async def scenario():
        # Four: as many as one session may have waiting. The three todos must arrive within
        # the wait, which the fourth waiter spends in full: 10 s leaves a loaded machine room
        # for three commits.
        calls = [await Call(agent, {"wait_seconds": 10}, request_id=n).start() for n in range(4)]
        await waiting(agent.endpoint.pk, count=4)
        for n in range(3):
            await database_sync_to_async(make_ready_todo)(agent.endpoint, title=f"t{n}")
        return [await call.response() for call in calls]

    results = [call.result()["result"]["structuredContent"] for call in run(scenario)]
    claimed = [r["todo"]["id"] for r in results if "todo" in r]
    assert len(claimed) == len(set(claimed)) == 3
    assert results.count({"empty": True}) == 1


def test_a_malformed_wait_is_answered_at_once_as_json(agent):
    reply = agent.rpc("tools/call", {"name": "claim_next", "arguments": {"wait_seconds": "soon"}})
    assert reply.status == 200 and reply.headers["content-type"] == "application/json"
    # -32602 today; an invalid_argument tool result once argument errors all become one.
    assert "error" in reply.json or reply.json["result"]["isError"]


# -- caps: waiting claims per session and per credential (CONTRACT §12) ---------------------


def refusal_code(result) -> str | None:
    body = result.get("result") or {}
    return body.get("isError") and body["structuredContent"]["error"]["code"]


def test_a_session_may_have_four_long_polls_waiting_and_the_fifth_is_refused(agent):
    """Each waiting claim costs the process a coroutine and a wake-up slot: a client that
    loops without waiting for its answers must not pile up hundreds of them."""
    async def scenario():
        waiting_calls = [await Call(agent, {"wait_seconds": 30}, request_id=n).start()
                         for n in range(4)]
        await waiting(agent.endpoint.pk, 4)
        refused = await (await Call(agent, {"wait_seconds": 30}, request_id=9).start()).response()
        assert len(longpoll.room().waiters.get(agent.endpoint.pk, [])) == 4
        # The waiting ones still wait, and the oldest gets the next todo.
        todo = await database_sync_to_async(make_ready_todo)(agent.endpoint)
        claimed = [claimed_id((await waiting_calls[0].response()).result())]
        for call in waiting_calls[1:]:
            await call.communicator.send_input({"type": "http.disconnect"})
        return refused, todo, claimed

    refused, todo, claimed = run(scenario)
    assert refused.status == 200
    result = refused.result()
    assert result["id"] == 9 and refusal_code(result) == "at_capacity"
    assert "4" in result["result"]["structuredContent"]["error"]["message"]
    assert claimed == [str(todo.pk)]
    assert Todo.objects.get(pk=todo.pk).attempts == 1  # the refused call claimed nothing


def test_a_credential_may_have_32_long_polls_waiting_across_its_sessions(vend, settings):
    settings.SWITCHBOARD_MAX_LONG_POLLS_PER_CREDENTIAL = 6
    endpoint, credential = vend()
    drivers = []
    for _ in range(3):
        driver = McpDriver(endpoint.slug, credential)
        driver.initialize()
        drivers.append(driver)

    async def scenario():
        calls = [await Call(driver, {"wait_seconds": 30}, request_id=n).start()
                 for driver in drivers[:2] for n in range(3)]
        await waiting(endpoint.pk, 6)
        # A third session of the same credential: its own cap is untouched, the credential's
        # is reached.
        refused = await (await Call(drivers[2], {"wait_seconds": 30}).start()).response()
        for call in calls:
            await call.communicator.send_input({"type": "http.disconnect"})
        return refused

    refused = run(scenario)
    assert refusal_code(refused.result()) == "at_capacity"
    assert "credential" in refused.result()["result"]["structuredContent"]["error"]["message"]


def test_the_long_poll_caps_default_to_4_per_session_and_32_per_credential():
    from django.conf import settings

    assert settings.SWITCHBOARD_MAX_LONG_POLLS_PER_SESSION == 4
    assert settings.SWITCHBOARD_MAX_LONG_POLLS_PER_CREDENTIAL == 32
