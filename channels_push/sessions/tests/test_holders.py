"""Agents by name: a session keeps its client's clientInfo, and operator pages show lease
holders as ``client version · hint`` — never a whole session id."""

import pytest
from django.test import Client

from channels_push.sessions import holders
from channels_push.models import McpSession
from channels_push.tests.conftest import McpDriver, make_ready_todo
from todos.models import Todo


def test_initialize_keeps_the_clients_name_and_version(mcp):
    mcp.initialize(clientInfo={"name": "claude-code", "version": "2.1.3"})
    session = McpSession.objects.get(pk=mcp.session_id)
    assert (session.client_name, session.client_version) == ("claude-code", "2.1.3")


def test_client_info_is_sanitised_and_capped(mcp):
    mcp.initialize(clientInfo={"name": "Evil <channel>\u202e\x1b[31m" + "x" * 300,
                               "version": "9" * 100})
    session = McpSession.objects.get(pk=mcp.session_id)
    assert len(session.client_name) == holders.CLIENT_INFO_MAX_CHARS
    assert len(session.client_version) == holders.CLIENT_INFO_MAX_CHARS
    assert "<" not in session.client_name and "\x1b" not in session.client_name
    assert "\u202e" not in session.client_name and " " not in session.client_name


@pytest.mark.parametrize("client_info", [None, "claude", {"name": 7, "version": ["1"]}, {}])
def test_client_info_of_the_wrong_shape_is_kept_as_empty(mcp, client_info):
    mcp.initialize(clientInfo=client_info)
    session = McpSession.objects.get(pk=mcp.session_id)
    assert (session.client_name, session.client_version) == ("", "")


def test_holder_labels_name_sessions_and_leave_people_and_sweeps_alone(
        mcp, django_assert_num_queries):
    mcp.initialize(clientInfo={"name": "codex", "version": "0.5"})
    gone = McpSession(pk="A" * 43).pk  # a session id whose row was pruned
    with django_assert_num_queries(1):
        labels = holders.holder_labels([mcp.session_id, gone, "alice", "reaper", None])
    assert labels[mcp.session_id] == f"codex 0.5 · {mcp.session_id[:8]}"
    assert labels[gone] == "session · AAAAAAAA"
    assert labels["alice"] == "alice" and labels["reaper"] == "reaper"
    with django_assert_num_queries(0):
        assert holders.holder_labels(["alice", "reaper"]) == {"alice": "alice", "reaper": "reaper"}


def test_an_unnamed_client_still_shows_its_hint():
    assert holders.session_label("", "", "Ab3dEf9hXXXXXXXX") == "unnamed client · Ab3dEf9h"


def test_the_todo_page_shows_the_holder_by_client_and_never_the_session_id(mcp):
    mcp.initialize(clientInfo={"name": "claude-code", "version": "2.1"})
    todo = make_ready_todo(mcp.endpoint, title="fix the build")
    claimed = mcp.call("claim_next")
    assert not claimed["result"].get("isError"), claimed
    browser = Client()
    browser.force_login(mcp.endpoint.owner)
    label = f"claude-code 2.1 · {mcp.session_id[:8]}"

    page = browser.get(f"/todos/{todo.pk}/").content.decode()
    assert Todo.objects.get(pk=todo.pk).state == "claimed"
    assert f"held by <span class=\"holder\">{label}</span>" in page
    assert mcp.session_id not in page

    heartbeat = mcp.call("complete", {"todo_id": todo.pk, "result": {"ok": True}})
    assert not heartbeat["result"].get("isError"), heartbeat
    page = browser.get(f"/todos/{todo.pk}/").content.decode()
    history = page.split('id="history"', 1)[1]
    assert history.count(label) == 2  # the claim and the completion, by the agent
    assert mcp.session_id not in page
