"""The todo token (docs/security.md#the-todo-token): a claim's bearer for one todo under one
lease, over the real MCP transport."""

import hashlib
import logging
from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

from channels_push.models import McpSession
from channels_push.mcp import schemas as mcp_schemas
from channels_push.sessions import queries as session_queries
from channels_push.tests.conftest import McpDriver, make_ready_todo
from ingest import sweeps as ingest_sweeps
from ingest.models import OperatorSecret
from todos import transitions
from todos.models import Todo, TodoToken

pytestmark = pytest.mark.django_db


def structured(reply: dict) -> dict:
    return reply["result"]["structuredContent"]


def refusal(reply: dict) -> str:
    assert reply["result"]["isError"] is True, reply
    return reply["result"]["structuredContent"]["error"]["code"]


def claim(mcp, todo) -> tuple[dict, str]:
    answer = structured(mcp.call("claim", {"todo_id": str(todo.pk)}))
    return answer["todo"], answer["todo_token"]


def token_session(mcp, token) -> McpDriver:
    driver = McpDriver(mcp.slug, token)
    driver.initialize()
    return driver


def add_secret(todo, value="s3cr3t") -> str:
    ref = OperatorSecret.mint_ref()
    OperatorSecret.objects.create(ref=ref, name="key", todo=todo,
                                  ciphertext=OperatorSecret.seal(value))
    return ref


def test_claim_and_claim_next_answer_a_todo_token_kept_only_as_its_digest(mcp):
    mcp.initialize()
    first, second = make_ready_todo(mcp.endpoint), make_ready_todo(mcp.endpoint)
    claimed, token = claim(mcp, first)
    assert token.startswith("sbt_") and len(token) > 40
    answer = structured(mcp.call("claim_next"))
    assert answer["todo"]["id"] == str(second.pk) and answer["todo_token"].startswith("sbt_")
    assert answer["todo_token"] != token
    row = TodoToken.objects.get(todo=first)
    assert row.digest == hashlib.sha256(token.encode()).hexdigest()
    assert row.lease_id == claimed["lease_id"] and row.endpoint_id == mcp.endpoint.pk
    stored = [str(value) for value in TodoToken.objects.values_list(
        "digest", "lease_id", "todo_id", "issued_at", "revoked_at")]
    assert not any(token in value or token[4:] in value for value in stored)
    # The todo itself (board, lists, heartbeat answers) never carries it.
    assert "todo_token" not in structured(mcp.call("heartbeat", {"todo_id": str(first.pk)}))["todo"]


def test_a_todo_token_session_lists_and_calls_only_its_lease_verbs(mcp):
    mcp.initialize()
    todo = make_ready_todo(mcp.endpoint)
    other = make_ready_todo(mcp.endpoint)
    ref = add_secret(todo)
    _, token = claim(mcp, todo)
    agent = token_session(mcp, token)
    listed = {tool["name"] for tool in agent.rpc("tools/list").json["result"]["tools"]}
    assert listed == mcp_schemas.TODO_TOKEN_VERBS & set(mcp_schemas.TOOL_SCHEMAS)
    for verb, arguments in (("list_todos", {}), ("claim", {"todo_id": str(other.pk)}),
                            ("claim_next", {}), ("clock_in", {}), ("clock_out", {})):
        assert refusal(agent.call(verb, arguments)) == "verb_not_allowed", verb
    own = {"todo_id": str(todo.pk)}
    beat = structured(agent.call("heartbeat", {**own, "lease_ttl_seconds": 600}))
    assert beat["todo"]["state"] == "claimed"
    # Routed with write-back off: refused for that reason, not for the token's.
    assert refusal(agent.call("post_update", {**own, "text": "half way"})) == "write_back_off"
    assert structured(agent.call("read_secret", {"ref": ref}))["value"] == "s3cr3t"
    assert refusal(agent.call("repo_token", own)) == "verb_not_allowed"
    done = structured(agent.call("complete", {**own, "result": {"ok": True}}))
    assert done["todo"]["state"] == "done"
    assert Todo.objects.get(pk=todo.pk).events.filter(action="complete").get().actor == \
        mcp.session_id  # it acts as the lease's holder


def test_fail_and_release_with_a_todo_token(mcp):
    mcp.initialize()
    failing, releasing = make_ready_todo(mcp.endpoint), make_ready_todo(mcp.endpoint)
    _, fail_token = claim(mcp, failing)
    _, release_token = claim(mcp, releasing)
    failed = structured(token_session(mcp, fail_token).call(
        "fail", {"todo_id": str(failing.pk), "error": "boom"}))
    assert failed["todo"]["state"] == "failed"
    released = structured(token_session(mcp, release_token).call(
        "release", {"todo_id": str(releasing.pk)}))
    assert released["todo"]["state"] == "pending"


def test_two_todos_tokens_never_cross(mcp):
    mcp.initialize()
    first, second = make_ready_todo(mcp.endpoint), make_ready_todo(mcp.endpoint)
    first_ref, second_ref = add_secret(first, "one"), add_secret(second, "two")
    _, first_token = claim(mcp, first)
    _, second_token = claim(mcp, second)
    agent = token_session(mcp, first_token)
    for verb, arguments in (("heartbeat", {}), ("complete", {}), ("fail", {}), ("release", {}),
                            ("post_update", {"text": "x"}), ("repo_token", {})):
        assert refusal(agent.call(verb, {"todo_id": str(second.pk), **arguments})) == \
            "not_found", verb
    assert refusal(agent.call("read_secret", {"ref": second_ref})) == "not_found"
    assert structured(agent.call("read_secret", {"ref": first_ref}))["value"] == "one"
    # A session opened with one token answers to that token only.
    agent.credential = second_token
    assert agent.call_status("heartbeat", {"todo_id": str(second.pk)}) == 404
    assert Todo.objects.get(pk=second.pk).state == "claimed"


def _settle(mcp, todo, lease_id):
    mcp.call("complete", {"todo_id": str(todo.pk)})


def _fail(mcp, todo, lease_id):
    mcp.call("fail", {"todo_id": str(todo.pk), "error": "boom"})


def _release(mcp, todo, lease_id):
    mcp.call("release", {"todo_id": str(todo.pk)})


def _lapse(mcp, todo, lease_id):
    Todo.objects.filter(pk=todo.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    transitions.return_lapsed_leases(now=timezone.now(), limit=10)


def _lapse_unreaped(mcp, todo, lease_id):
    Todo.objects.filter(pk=todo.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


def _override(mcp, todo, lease_id):
    operator = transitions.Caller.operator(mcp.endpoint, "operator")
    current = Todo.objects.get(pk=todo.pk)
    transitions.complete_todo(operator, todo.pk, overriding=transitions.HeldLease.of(current))


@pytest.mark.parametrize("end_lease", [_settle, _fail, _release, _lapse, _lapse_unreaped,
                                       _override])
def test_a_todo_token_dies_with_its_lease_and_its_session_ends(mcp, end_lease):
    mcp.initialize()
    todo = make_ready_todo(mcp.endpoint)
    claimed, token = claim(mcp, todo)
    agent = token_session(mcp, token)
    assert agent.call_status("heartbeat", {"todo_id": str(todo.pk)}) == 200
    end_lease(mcp, todo, claimed["lease_id"])
    assert agent.call_status("heartbeat", {"todo_id": str(todo.pk)}) == 401
    assert token_session_refused(mcp, token)
    # The sweep records the revocation and ends the session the token opened.
    assert ingest_sweeps.revoke_ended_agent_tokens()["todo_tokens"] == 1
    assert TodoToken.objects.get(todo=todo).revoked_at is not None
    assert McpSession.objects.get(pk=agent.session_id).terminated_at is not None
    # The endpoint's own session is untouched.
    assert McpSession.objects.get(pk=mcp.session_id).terminated_at is None
    assert ingest_sweeps.revoke_ended_agent_tokens()["todo_tokens"] == 0


def token_session_refused(mcp, token) -> bool:
    answer = McpDriver(mcp.slug, token).rpc("initialize", {
        "protocolVersion": "2025-11-25", "capabilities": {}})
    return answer.status == 401 and "works only for its own todo while that lease lasts" in (
        answer.body.decode())


def test_a_new_lease_gets_a_new_token_and_the_old_one_stays_dead(mcp):
    mcp.initialize()
    todo = make_ready_todo(mcp.endpoint)
    _, old = claim(mcp, todo)
    mcp.call("release", {"todo_id": str(todo.pk)})
    _, new = claim(mcp, todo)
    assert old != new
    assert token_session_refused(mcp, old)
    assert token_session(mcp, new).call_status("heartbeat", {"todo_id": str(todo.pk)}) == 200


def test_a_todo_token_session_has_no_stream_and_is_never_rung(mcp):
    mcp.initialize()
    todo = make_ready_todo(mcp.endpoint)
    _, token = claim(mcp, todo)
    mcp.request("DELETE")  # the endpoint's own session gone: only the token's is left
    agent = token_session(mcp, token)
    assert agent.request("GET", accept="text/event-stream").status == 405
    assert not session_queries.has_attached_session(mcp.endpoint.pk, timezone.now())


def test_a_todo_token_is_no_credential_of_another_endpoint(mcp, vend):
    mcp.initialize()
    todo = make_ready_todo(mcp.endpoint)
    _, token = claim(mcp, todo)
    other, _ = vend(slug="elsewhere")
    assert McpDriver(other.slug, token).rpc("initialize", {
        "protocolVersion": "2025-11-25", "capabilities": {}}).status == 401


def test_a_todo_token_sessions_instructions_name_its_todo_and_no_claiming(mcp):
    mcp.initialize()
    todo = make_ready_todo(mcp.endpoint)
    _, token = claim(mcp, todo)
    text = McpDriver(mcp.slug, token).initialize().json["result"]["instructions"]
    assert f"todo token of todo {todo.pk}" in text and "claim_next" not in text


def issued_token(endpoint, todo) -> str:
    agent = transitions.Caller.agent(endpoint, "runner-session")
    return transitions.issue_todo_token(transitions.claim_todo(agent, todo.pk))


@override_settings(SWITCHBOARD_MCP_RATE_PER_MINUTE=3)
def test_todo_tokens_spend_one_budget_per_endpoint(mcp, vend):
    first = issued_token(mcp.endpoint, make_ready_todo(mcp.endpoint))
    second = issued_token(mcp.endpoint, make_ready_todo(mcp.endpoint))
    token_session(mcp, first)  # initialize and its notification: two requests
    assert token_session(mcp, second).rpc("ping").status == 429  # the third passed, not these
    other, _ = vend(slug="other-agent")
    elsewhere = issued_token(other, make_ready_todo(other))
    assert token_session(McpDriver(other.slug, ""), elsewhere).rpc("ping").status == 200


def test_no_log_line_carries_a_todo_token(mcp, caplog):
    caplog.set_level(logging.DEBUG)
    mcp.initialize()
    todo = make_ready_todo(mcp.endpoint)
    _, token = claim(mcp, todo)
    agent = token_session(mcp, token)
    agent.call("heartbeat", {"todo_id": str(todo.pk)})
    agent.call("list_todos")
    agent.call("complete", {"todo_id": str(todo.pk)})
    McpDriver(mcp.slug, token).rpc("ping")  # refused now
    logged = "\n".join(f"{record.getMessage()} {record.__dict__}" for record in caplog.records)
    assert logged and token not in logged and token[4:] not in logged
