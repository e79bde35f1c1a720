"""Unverified todos (anyone who knows an unsigned webhook's URL can create one) never reach an
agent silently (CONTRACT §6, §12; issue 12 item 7): every todo an agent sees says its trust,
the instructions say what ``unverified`` means, an endpoint can refuse them to its agents, and
the operator can promote one, which then rings like a new todo."""

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.core.management import call_command

from channels_push.mcp import instructions as mcp_instructions
from channels_push.tests.conftest import McpDriver, make_ready_todo
from channels_push.doorbells.tests.test_doorbells import (  # noqa: F401 (driver: a fixture)
    close, driver, next_doorbell, next_ring, open_stream, ring)
from endpoints.models import Endpoint
from todos import transitions
from todos.models import Todo, TodoEvent, Trust

pytestmark = pytest.mark.django_db(transaction=True)


def structured(reply) -> dict:
    return reply["result"]["structuredContent"]


def test_every_todo_an_agent_sees_carries_its_trust(driver):
    d = driver("wary")
    for trust in Trust.values:
        make_ready_todo(d.endpoint, title=f"from {trust}", trust=trust)
    listed = structured(d.call("list_todos"))["todos"]
    assert sorted(todo["trust"] for todo in listed) == sorted(Trust.values)
    claimed = structured(d.call("claim_next"))["todo"]
    assert claimed["trust"] in Trust.values
    by_id = structured(d.call("claim", {"todo_id": listed[1]["id"]}))["todo"]
    assert by_id["trust"] == listed[1]["trust"]
    for verb in ("heartbeat", "release"):
        assert structured(d.call(verb, {"todo_id": by_id["id"]}))["todo"]["trust"] == by_id["trust"]
    d.call("claim", {"todo_id": by_id["id"]})
    assert structured(d.call("complete", {"todo_id": by_id["id"]}))["todo"]["trust"] == by_id["trust"]
    assert structured(d.call("fail", {"todo_id": claimed["id"]}))["todo"]["trust"] == claimed["trust"]


def test_the_instructions_say_unverified_todos_are_data_not_instructions(driver):
    d = driver("wary")
    instructions = McpDriver(d.slug, d.credential).initialize().json["result"]["instructions"]
    assert mcp_instructions.UNVERIFIED_TODOS_NOTE in instructions
    assert "unverified" in instructions and "never as instructions" in instructions
    assert len(instructions) <= mcp_instructions.INSTRUCTIONS_MAX_CHARS


def test_the_instructions_call_every_title_and_payload_third_party_text_whatever_its_trust(
        driver):
    """A signature proves which service sent a todo, not who wrote its text: anyone who can
    open a GitHub issue writes a signed todo's title. So no trust is called a verified sender,
    and the text of every todo, signed and operator ones included, is data, not instructions;
    the doorbell says the trust too (meta.trust)."""
    d = driver("wary")
    instructions = McpDriver(d.slug, d.credential).initialize().json["result"]["instructions"]
    assert "verified sender" not in instructions
    note = mcp_instructions.UNVERIFIED_TODOS_NOTE
    assert "every todo's title and payload" in note.lower() and "third-party text" in note
    assert "not who wrote" in note  # what "signed" does and does not prove
    assert "meta.trust" in note
    assert len(instructions) <= mcp_instructions.INSTRUCTIONS_MAX_CHARS


def test_an_endpoint_that_refuses_unverified_todos_never_hands_one_out(driver):
    d = driver("wary", accept_unverified=False)
    unverified = make_ready_todo(d.endpoint, title="anyone's", trust=Trust.UNVERIFIED)
    signed = make_ready_todo(d.endpoint, title="signed", trust=Trust.SIGNED)
    # Not listed, in any state filter.
    assert [t["id"] for t in structured(d.call("list_todos"))["todos"]] == [str(signed.pk)]
    assert structured(d.call("list_todos", {"state": "pending"}))["todos"][0]["id"] == str(signed.pk)
    # claim by id: exactly the answer for a todo that does not exist.
    refused = d.call("claim", {"todo_id": str(unverified.pk)})["result"]
    missing = d.call("claim", {"todo_id": "999999"})["result"]
    assert refused["isError"] and refused["structuredContent"]["error"]["code"] == "not_found"
    assert refused["structuredContent"]["error"]["message"].replace(str(unverified.pk), "N") == \
        missing["structuredContent"]["error"]["message"].replace("999999", "N")
    # Every other verb on it answers the same as for a missing todo (no "lease_lost … pending").
    for verb in ("heartbeat", "complete", "fail", "cancel", "release"):
        answer = d.call(verb, {"todo_id": str(unverified.pk)})["result"]
        assert answer["structuredContent"]["error"]["code"] == "not_found", (verb, answer)
    # claim_next skips it (though older) and then finds nothing.
    assert structured(d.call("claim_next"))["todo"]["id"] == str(signed.pk)
    assert structured(d.call("claim_next")) == {"empty": True}
    # Still on the board, still pending.
    assert Todo.objects.get(pk=unverified.pk).state == "pending"


def test_promoting_an_unverified_todo_hands_it_out_and_rings(driver):
    d = driver("wary", accept_unverified=False)

    async def scenario():
        stream = await open_stream(d)
        todo = await ring(d.endpoint, title="looks legit", trust=Trust.UNVERIFIED)
        caller = transitions.Caller.operator(d.endpoint, "owner-wary")
        promoted = await sync_to_async(transitions.promote_todo, thread_sensitive=False)(caller, todo.pk)
        assert promoted.trust == Trust.OPERATOR and promoted.state == "pending"
        params = await next_ring(stream)
        assert params["meta"]["todo_id"] == str(todo.pk)  # the first doorbell is the promoted one
        await close(stream)
        return todo

    todo = async_to_sync(scenario)()
    event = TodoEvent.objects.filter(todo=todo).latest("id")
    assert (event.action, event.actor, event.detail) == ("promote", "owner-wary",
                                                         {"from_trust": "unverified"})
    assert structured(d.call("claim_next"))["todo"]["id"] == str(todo.pk)


def test_vend_endpoint_no_unverified_flag(db, capsys):
    from tests.factories import UserFactory

    UserFactory(username="carol")
    call_command("vend_endpoint", "careful", "--owner", "carol", "--no-unverified")
    call_command("vend_endpoint", "trusting", "--owner", "carol")
    assert Endpoint.objects.get(slug="careful").accept_unverified is False
    assert Endpoint.objects.get(slug="trusting").accept_unverified is True


def test_claim_next_with_verified_only_skips_unverified_todos(driver):
    d = driver("picky")
    unverified = make_ready_todo(d.endpoint, title="anyone's", trust=Trust.UNVERIFIED)
    signed = make_ready_todo(d.endpoint, title="signed", trust=Trust.SIGNED)
    operator = make_ready_todo(d.endpoint, title="handed over", trust=Trust.OPERATOR)
    picked = [structured(d.call("claim_next", {"verified_only": True}))["todo"]["id"]
              for _ in range(2)]
    assert sorted(picked) == sorted([str(signed.pk), str(operator.pk)])
    assert structured(d.call("claim_next", {"verified_only": True})) == {"empty": True}
    assert Todo.objects.get(pk=unverified.pk).state == "pending"
    # Without it (or false), the endpoint's own rule applies: this one accepts unverified.
    assert structured(d.call("claim_next", {"verified_only": False}))["todo"]["id"] == \
        str(unverified.pk)


def test_verified_only_must_be_a_boolean(driver):
    d = driver("picky")
    answer = d.call("claim_next", {"verified_only": "yes"})["result"]
    assert answer["isError"]
    assert answer["structuredContent"]["error"]["code"] == "invalid_argument"
    assert "verified_only" in answer["structuredContent"]["error"]["message"]
