"""Pausing work (CONTRACT §14): the transitions, the claim filters they drive, the command,
the board buttons, the admin actions and the /metrics gauge. The push side (doorbells,
sweeps, the resume digest with a live client) is tests/test_pause_e2e.py."""

import io
import json
from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from channels_push.doorbells import sweeps
from channels_push.doorbells import doorbells
from channels_push.sessions import transitions as session_transitions
from channels_push.models import McpSession
from channels_push.tests.conftest import McpDriver, make_ready_todo
from endpoints import transitions
from endpoints.models import Endpoint
from tests.factories import EndpointFactory, UserFactory, credential_for
from todos import transitions as todo_transitions

pytestmark = pytest.mark.django_db


def fresh(endpoint):
    return Endpoint.objects.get(pk=endpoint.pk)


def test_pause_and_resume_record_events_and_what_is_paused(endpoint):
    assert transitions.pause_work(endpoint, queue="reviews", actor="alice") == ["reviews"]
    assert transitions.pause_work(endpoint, queue="inbox", actor="alice") == ["inbox", "reviews"]
    assert transitions.pause_work(endpoint, queue="inbox", actor="alice") == ["inbox", "reviews"]
    assert transitions.resume_work(endpoint, queue="inbox", actor="bob") == ["reviews"]
    assert transitions.pause_work(endpoint, actor="alice") == ["*"]
    with pytest.raises(ValueError):  # one queue of a wholly paused endpoint
        transitions.resume_work(endpoint, queue="reviews", actor="bob")
    assert transitions.resume_work(endpoint, actor="bob") == []
    assert fresh(endpoint).paused_queues == []
    assert list(endpoint.events.order_by("at", "id").values_list("action", "queue", "actor")) == [
        ("pause", "reviews", "alice"), ("pause", "inbox", "alice"), ("resume", "inbox", "bob"),
        ("pause", "*", "alice"), ("resume", "*", "bob")]  # no event for a no-op


def test_a_queue_outside_the_scope_cannot_be_paused(operator):
    scoped = EndpointFactory(owner=operator, scope=["inbox"])
    with pytest.raises(ValidationError):
        transitions.pause_work(scoped, queue="reviews", actor="alice")


def test_claim_next_skips_paused_queues_and_says_when_all_are(operator):
    endpoint = EndpointFactory(owner=operator, scope=["inbox", "reviews"])
    old = make_ready_todo(endpoint, "reviews", now=timezone.now() - timedelta(hours=1))
    new = make_ready_todo(endpoint, "inbox")
    transitions.pause_work(endpoint, queue="reviews", actor="alice")
    agent = todo_transitions.Caller.agent(fresh(endpoint), "s-1")
    assert todo_transitions.claim_next_todo(agent).pk == new.pk  # the older one waits
    assert todo_transitions.claim_next_todo(agent) is None
    with pytest.raises(todo_transitions.Refusal) as refused:
        todo_transitions.claim_todo(agent, old.pk)
    assert refused.value.code == "paused"
    transitions.pause_work(endpoint, queue="inbox", actor="alice")
    assert fresh(endpoint).paused_among(("inbox", "reviews")) == ["inbox", "reviews"]
    # A missing or invisible todo still looks missing, paused or not.
    with pytest.raises(todo_transitions.Refusal) as refused:
        todo_transitions.claim_todo(todo_transitions.Caller.agent(fresh(endpoint), "s-1"), 999999)
    assert refused.value.code == "not_found"


def test_claim_next_through_mcp_answers_paused(operator):
    vended, credential = transitions.vend_endpoint(slug="paused-mcp", owner=operator)
    mcp = McpDriver(vended.slug, credential)
    mcp.endpoint = vended
    mcp.initialize()
    make_ready_todo(mcp.endpoint, "inbox")
    transitions.pause_work(mcp.endpoint, queue="inbox", actor="alice")
    answer = mcp.call("claim_next", {"queues": ["inbox"]})["result"]
    assert answer["structuredContent"] == {"empty": True, "paused": ["inbox"]}
    transitions.pause_work(mcp.endpoint, actor="alice")
    assert mcp.call("claim_next")["result"]["structuredContent"] == {"empty": True,
                                                                     "paused": ["*"]}


def test_doorbells_and_sweeps_hold_for_a_paused_queue(endpoint):
    now = timezone.now()
    session = session_transitions.open_session(endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25")
    session_transitions.attach_stream(endpoint=endpoint, session_id=session.pk)
    transitions.pause_work(endpoint, queue="reviews", actor="alice")
    held = make_ready_todo(endpoint, "reviews", now=now - timedelta(minutes=10))
    assert doorbells.ring_todo(held) is None
    assert sweeps.ring_due_todos(now=now) == 0
    held.refresh_from_db()
    assert (held.ring_attempts, held.last_ringed_at) == (0, None)  # budget untouched
    assert McpSession.objects.get(pk=session.pk).last_doorbell_at is None
    other = make_ready_todo(endpoint, "inbox", now=now - timedelta(minutes=10))
    assert sweeps.ring_due_todos(now=now) == 1  # the sweep itself works
    other.refresh_from_db()
    assert other.ring_attempts == 1


def test_resume_sends_one_digest_only_if_work_waited(endpoint, django_capture_on_commit_callbacks,
                                                     monkeypatch):
    sent = []
    monkeypatch.setattr(doorbells, "send_digest",
                        lambda endpoint, reason, now=None: sent.append((endpoint.slug, reason)))
    transitions.pause_work(endpoint, actor="alice")
    with django_capture_on_commit_callbacks(execute=True):
        transitions.resume_work(endpoint, actor="alice")
        transitions.resume_work(endpoint, actor="alice")  # nothing paused: no second one
    assert sent == [("agent", "resumed")]
    # send_digest itself sends nothing when nothing waits (tested with presence digests).


def test_pause_and_resume_commands(endpoint):
    def run(*args):
        out = io.StringIO()
        call_command(*args, "--json", stdout=out)
        return json.loads(out.getvalue())

    assert run("pause", endpoint.slug, "--queue", "reviews") == {"endpoint": "agent",
                                                                 "paused": ["reviews"]}
    assert run("pause", endpoint.slug) == {"endpoint": "agent", "paused": ["*"]}
    with pytest.raises(CommandError):
        call_command("resume", endpoint.slug, "--queue", "reviews")
    assert run("resume", endpoint.slug) == {"endpoint": "agent", "paused": []}
    with pytest.raises(CommandError):
        call_command("pause", "nope")


def test_board_buttons_pause_and_show_it(client, endpoint, operator):
    client.force_login(operator)
    response = client.post(f"/todos/endpoints/{endpoint.slug}/work/pause", {"queue": "reviews"})
    assert response.status_code == 302
    assert fresh(endpoint).paused_queues == ["reviews"]
    page = client.get("/todos/").content.decode()
    assert "paused: reviews" in page and f"/todos/endpoints/{endpoint.slug}/work/resume" in page
    client.post(f"/todos/endpoints/{endpoint.slug}/work/resume", {"queue": ""})
    assert fresh(endpoint).paused_queues == []
    stranger = UserFactory(username="mallory")
    client.force_login(stranger)
    assert client.post(f"/todos/endpoints/{endpoint.slug}/work/pause").status_code == 404
    assert fresh(endpoint).paused_queues == []


def test_admin_actions_pause_and_resume(client, endpoint):
    client.force_login(UserFactory(username="root", is_superuser=True, is_staff=True))
    url = "/admin/endpoints/endpoint/"
    client.post(url, {"action": "pause_work", "_selected_action": [endpoint.pk]})
    assert fresh(endpoint).paused_queues == ["*"]
    assert "pause * by root" in client.get(f"{url}{endpoint.pk}/change/").content.decode()
    client.post(url, {"action": "resume_work", "_selected_action": [endpoint.pk]})
    assert fresh(endpoint).paused_queues == []


def test_metrics_gauge_shows_paused_work(client, endpoint, settings):
    settings.SWITCHBOARD_METRICS_TOKEN = "t0ken"
    transitions.pause_work(endpoint, queue="reviews", actor="alice")
    text = client.get("/metrics", HTTP_AUTHORIZATION="Bearer t0ken").content.decode()
    assert 'switchboard_paused_queues{endpoint="agent",queue="reviews"} 1.0' in text
