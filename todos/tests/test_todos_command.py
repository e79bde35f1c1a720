"""``manage.py todos``: the latest todos by endpoint, queue, state or thread (docs/commands.md)."""

import json

import pytest
from django.core.management import CommandError, call_command

from tests.factories import EndpointFactory, UserFactory
from todos import transitions
from todos.models import Todo
from todos.tests.test_thread_holder import add_followup

pytestmark = pytest.mark.django_db


def todos(capsys, *args):
    call_command("todos", *args, "--json")
    return json.loads(capsys.readouterr().out)["todos"]


def test_it_filters_and_prints_the_todo_json_newest_first(capsys, agent, endpoint, make_todo):
    first, second = make_todo(title="first"), make_todo(queue="ops", title="second\x1b[2J<b>")
    Todo.objects.filter(pk__in=[first.pk, second.pk]).update(thread="octo/repo#12")
    add_followup(first.pk)
    transitions.claim_todo(agent, first.pk)
    transitions.request_cancel(first.pk, actor="octocat")
    other = EndpointFactory(owner=UserFactory())
    make_todo(on=other)
    assert [t["id"] for t in todos(capsys, "--endpoint", endpoint.slug)] == [
        str(second.pk), str(first.pk)]
    assert [t["id"] for t in todos(capsys, "--thread", "octo/repo#12", "--state", "claimed")] == [
        str(first.pk)]
    [only] = todos(capsys, "--queue", "ops", "--limit", "1")
    assert only["thread"] == "octo/repo#12" and only["followups"] is None
    assert len(todos(capsys)) == 3
    call_command("todos", "--thread", "octo/repo#12")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"#{second.pk} {endpoint.slug}/ops pending thread=octo/repo#12 second[2J‹b›"
    assert lines[1] == (f"#{first.pk} {endpoint.slug}/inbox claimed cancel_requested "
                        "thread=octo/repo#12 followups=1 first")


def test_bad_options_are_refused(capsys):
    for args in (("--limit", "0"), ("--endpoint", "nowhere"), ("--thread", "x" * 301)):
        with pytest.raises(CommandError):
            call_command("todos", *args)
