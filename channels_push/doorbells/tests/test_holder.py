"""The holder's doorbell (docs/work-control.md#threads): a follow-up of a held todo, or a stop
request, rings the session that holds it, with ids only."""

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from django.utils import timezone

from channels_push.doorbells import doorbells
from channels_push.doorbells.tests.test_doorbells import close, driver, next_ring, open_stream  # noqa: F401
from channels_push.tests.conftest import make_ready_todo
from todos import transitions

pytestmark = pytest.mark.django_db(transaction=True)


def test_holder_doorbell_frame_names_only_the_todo():
    todo = type("T", (), {"pk": 7})()
    params = doorbells.holder_doorbell(todo, "followup")
    assert params["meta"] == {"kind": "followup", "todo_id": "7"}
    assert "7" in params["content"] and not doorbells.is_digest(params)
    assert doorbells.holder_doorbell(todo, "cancel_requested")["meta"]["kind"] == "cancel_requested"


def test_a_followup_and_a_stop_request_ring_the_holder_without_sender_text(driver):  # noqa: F811
    d = driver()

    def held():
        todo = make_ready_todo(d.endpoint, title="first")
        return transitions.claim_todo(transitions.Caller.agent(d.endpoint, d.session_id), todo.pk)

    def fold(todo):
        return transitions.add_followup(
            todo.pk, delivery_event=None, kind="issue_comment.created", title="SECRET comment",
            actor="octocat", trust="unverified", payload={"body": "SECRET"}, now=timezone.now())

    async def scenario():
        todo = await database_sync_to_async(held, thread_sensitive=False)()
        stream = await open_stream(d)
        await database_sync_to_async(fold, thread_sensitive=False)(todo)
        params = await next_ring(stream)
        assert params["meta"] == {"kind": "followup", "todo_id": str(todo.pk)}
        assert "SECRET" not in str(params)
        await database_sync_to_async(transitions.request_cancel, thread_sensitive=False)(
            todo.pk, actor="alice")
        params = await next_ring(stream)
        assert params["meta"] == {"kind": "cancel_requested", "todo_id": str(todo.pk)}
        await close(stream)

    async_to_sync(scenario)()


def test_a_followup_of_an_unheld_todo_rings_no_holder(vend, monkeypatch):
    endpoint, _ = vend("quiet")
    sent = []
    monkeypatch.setattr(doorbells, "send_doorbell", lambda *args: sent.append(args))
    todo = make_ready_todo(endpoint)
    assert doorbells.ring_holder(todo, "followup") is False
    assert sent == []
