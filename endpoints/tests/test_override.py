"""An operator override, seen from every side (CONTRACT §8, issue 13 item 14): clock_in during
one says why nothing changed and until when; ``manage.py clock clear-override`` lifts it (and a
digest follows when that turned presence in); the board shows it."""

import io
import json
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.utils import timezone

from channels_push.doorbells import doorbells
from channels_push.tests.conftest import McpDriver, make_ready_todo
from endpoints import transitions
from endpoints.models import Endpoint

pytestmark = pytest.mark.django_db

UNTIL = "2099-01-01T00:00:00Z"


@pytest.fixture
def digests(monkeypatch):
    sent = []
    monkeypatch.setattr(doorbells, "send_digest",
                        lambda endpoint, reason, now=None: sent.append((endpoint.slug, reason)))
    return sent


def clock_json(*args) -> dict:
    out = io.StringIO()
    call_command("clock", *args, "--json", stdout=out)
    return json.loads(out.getvalue())


def test_clock_in_during_an_override_answers_why_through_mcp(operator):
    endpoint, credential = transitions.vend_endpoint(slug="overridden", owner=operator)
    assert clock_json("out", endpoint.slug, "--until", UNTIL) == {
        "endpoint": "overridden", "presence": "out", "override_until": UNTIL}
    agent = McpDriver(endpoint.slug, credential)
    agent.initialize()
    answer = agent.call("clock_in")["result"]
    assert not answer["isError"]
    assert answer["structuredContent"] == {"presence": "out", "override_until": UNTIL}
    # Without an override the answer stays as it was.
    transitions.clear_override(endpoint)
    assert agent.call("clock_out")["result"]["structuredContent"] == {"presence": "out"}


def test_clear_override_command_lifts_it_and_sends_the_digest(
        endpoint, digests, django_capture_on_commit_callbacks):
    make_ready_todo(endpoint)
    transitions.clock(endpoint, "out", reason="operator",
                      until=timezone.now() + timedelta(hours=8))
    with django_capture_on_commit_callbacks(execute=True):
        assert clock_json("clear-override", endpoint.slug) == {
            "endpoint": "agent", "presence": "in", "override_until": None}
    row = Endpoint.objects.get(pk=endpoint.pk)
    assert (row.presence_override, row.presence_override_until) == ("", None)
    assert digests == [("agent", "operator")]
    with django_capture_on_commit_callbacks(execute=True):
        clock_json("clear-override", endpoint.slug)  # nothing to lift: no digest
    assert digests == [("agent", "operator")]


def test_the_board_and_admin_show_the_override(client, endpoint, operator):
    until = timezone.now() + timedelta(hours=3)
    transitions.clock(endpoint, "out", reason="operator", until=until)
    client.force_login(operator)
    page = client.get("/todos/").content.decode()
    assert "operator override until" in page and until.strftime("%Y-%m-%d %H:%M") in page
    response = client.post(f"/todos/endpoints/{endpoint.slug}/clock/in", follow=True)
    assert "operator override until" in response.content.decode()


def test_get_root_leads_to_the_board(client):
    response = client.get("/")
    assert response.status_code == 302 and response["Location"] == "/todos/"
