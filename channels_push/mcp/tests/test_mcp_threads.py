"""Threads through the MCP tools (docs/reference.md#follow-ups): the todo a claim answers carries
every follow-up, heartbeat answers the new ones and cancel_requested, the holder's cancel, and
list_todos by thread."""

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from channels_push.mcp import tools as mcp_tools
from todos.models import State, Todo
from todos.tests.test_thread_holder import add_followup

pytestmark = pytest.mark.django_db


def call(endpoint, name, arguments=None, session="session-a"):
    result = mcp_tools.call_tool(endpoint=endpoint, session_id=session,
                                 params={"name": name, "arguments": arguments or {}})
    return result.is_error, result.structured_content


def test_claim_answers_every_follow_up_and_heartbeat_the_new_ones(endpoint, make_todo):
    todo = make_todo()
    Todo.objects.filter(pk=todo.pk).update(thread="octo/repo#12")
    add_followup(todo.pk, "first")
    error, claimed = call(endpoint, "claim", {"todo_id": str(todo.pk)})
    assert not error
    assert [f["title"] for f in claimed["todo"]["followups"]] == ["first"]
    assert claimed["todo"]["thread"] == "octo/repo#12"
    error, beat = call(endpoint, "heartbeat", {"todo_id": str(todo.pk)})
    assert not error and beat["followups"] == [] and beat["cancel_requested"] is False
    add_followup(todo.pk, "second")
    Todo.objects.filter(pk=todo.pk).update(cancel_requested_at=timezone.now())
    error, beat = call(endpoint, "heartbeat", {"todo_id": str(todo.pk)})
    assert [f["id"] for f in beat["followups"]] == [f"{todo.pk}.2"]
    assert beat["followups"][0]["payload"] == {"body": "second"}
    assert beat["cancel_requested"] is True and beat["todo"]["cancel_requested"] is True
    assert [f["id"] for f in beat["todo"]["followups"]] == [f"{todo.pk}.1", f"{todo.pk}.2"]
    error, listed = call(endpoint, "list_todos", {"state": "claimed"})
    assert listed["todos"][0]["followups"] is None and listed["todos"][0]["followup_count"] == 2
    error, cancelled = call(endpoint, "cancel", {"todo_id": str(todo.pk), "reason": "closed"})
    assert not error and cancelled["todo"]["state"] == State.CANCELLED
    error, again = call(endpoint, "cancel", {"todo_id": str(todo.pk)})
    assert error and again["error"]["code"] == "lease_lost"


def test_list_todos_takes_a_thread(endpoint, make_todo):
    ours, other = make_todo(), make_todo()
    Todo.objects.filter(pk=ours.pk).update(thread="octo/repo#12")
    error, listed = call(endpoint, "list_todos", {"thread": "octo/repo#12"})
    assert not error and [t["id"] for t in listed["todos"]] == [str(ours.pk)]
    error, refused = call(endpoint, "list_todos", {"thread": 12})
    assert error and refused["error"]["code"] == "invalid_argument"


def test_an_endpoint_without_cancel_is_refused_it(vend, make_todo):
    endpoint, _ = vend(slug="no-cancel", verbs=["claim", "heartbeat", "complete"])
    error, refused = call(endpoint, "cancel", {"todo_id": "1"})
    assert error and refused["error"]["code"] == "verb_not_allowed"


@pytest.mark.django_db(transaction=True)
def test_the_migration_grants_cancel_where_complete_was_granted(vend):
    executor = MigrationExecutor(connection)
    executor.migrate([("endpoints", "0010_post_update_verb")])
    old_apps = executor.loader.project_state([("endpoints", "0010_post_update_verb")]).apps
    Endpoint = old_apps.get_model("endpoints", "Endpoint")
    completes, _ = vend(slug="completes", verbs=["claim", "complete"])
    lists, _ = vend(slug="lists", verbs=["list_todos"])
    executor = MigrationExecutor(connection)
    executor.migrate([("endpoints", "0011_cancel_verb")])
    assert Endpoint.objects.get(slug="completes").verbs == ["claim", "complete", "cancel"]
    assert Endpoint.objects.get(slug="lists").verbs == ["list_todos"]
