"""Priority and scheduled todos on the board and in admin (docs/work-control.md)."""

from datetime import timedelta

import pytest
from django.utils import timezone

from tests.factories import UserFactory
from todos.models import Todo, TodoEvent

from .test_views import bob_todo, post_action  # noqa: F401 (bob_todo is a fixture)

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice_client(client, operator):
    client.force_login(operator)
    return client


def test_the_board_row_shows_priority_and_schedule_with_a_run_now_button(alice_client,
                                                                        make_todo):
    scheduled = make_todo(title="nightly", priority=30,
                          not_before=timezone.now() + timedelta(hours=4))
    plain = make_todo(title="plain")
    page = alice_client.get("/todos/").content.decode()
    row = page.split(f'id="todo-{scheduled.pk}"', 1)[1].split("</tr>", 1)[0]
    assert 'class="badge priority"' in row and "+30" in row
    assert 'class="badge scheduled"' in row and f"/todos/{scheduled.pk}/run_now" in row
    plain_row = page.split(f'id="todo-{plain.pk}"', 1)[1].split("</tr>", 1)[0]
    assert "badge priority" not in plain_row and "run_now" not in plain_row


def test_the_todo_page_sets_the_priority_and_runs_now(alice_client, make_todo):
    todo = make_todo(not_before=timezone.now() + timedelta(hours=4))
    page = alice_client.get(f"/todos/{todo.pk}/").content.decode()
    assert f"/todos/{todo.pk}/priority" in page and 'id="not-before"' in page
    assert post_action(alice_client, todo, "priority", priority="-40").status_code == 302
    assert post_action(alice_client, todo, "run_now").status_code == 302
    todo.refresh_from_db()
    assert (todo.priority, todo.not_before) == (-40, None)
    assert list(TodoEvent.objects.filter(todo=todo).values_list("action", "actor")
                .order_by("id"))[1:] == [("prioritize", "alice"), ("run_now", "alice")]


@pytest.mark.parametrize("value", ["200", "high", ""])
def test_a_bad_priority_on_the_board_is_a_message_and_writes_nothing(alice_client, make_todo,
                                                                    value):
    todo = make_todo()
    before = TodoEvent.objects.count()
    response = post_action(alice_client, todo, "priority", priority=value)
    assert response.status_code == 302
    messages = alice_client.get("/todos/").content.decode()
    assert "invalid_argument" in messages and "priority" in messages
    assert TodoEvent.objects.count() == before
    assert Todo.objects.get(pk=todo.pk).priority == 0


def test_another_operators_todo_cannot_be_reprioritised_or_run(alice_client, bob_todo):  # noqa: F811
    assert post_action(alice_client, bob_todo, "priority", priority="5").status_code == 404
    assert post_action(alice_client, bob_todo, "run_now").status_code == 404
    assert Todo.objects.get(pk=bob_todo.pk).priority == 0


@pytest.fixture
def root_client(client):
    client.force_login(UserFactory(username="root", is_superuser=True, is_staff=True))
    return client


def test_admin_lists_priority_and_schedule_and_acts_through_the_transitions(root_client,
                                                                          make_todo, agent):
    scheduled = make_todo(not_before=timezone.now() + timedelta(hours=1))
    claimed = make_todo()
    from todos import transitions

    transitions.claim_todo(agent, claimed.pk)
    page = root_client.get("/admin/todos/todo/?scheduled=yes").content.decode()
    assert f"/admin/todos/todo/{scheduled.pk}/change/" in page
    assert f"/admin/todos/todo/{claimed.pk}/change/" not in page
    response = root_client.post("/admin/todos/todo/", {
        "action": "set_priority", "priority": "12",
        "_selected_action": [scheduled.pk, claimed.pk]}, follow=True)
    assert f"#{claimed.pk}:" in response.content.decode()  # claimed: refused, reported
    root_client.post("/admin/todos/todo/", {"action": "run_now",
                                            "_selected_action": [scheduled.pk]})
    scheduled.refresh_from_db()
    assert (scheduled.priority, scheduled.not_before) == (12, None)
    assert Todo.objects.get(pk=claimed.pk).priority == 0
    assert [e.actor for e in TodoEvent.objects.filter(
        todo=scheduled, action__in=["prioritize", "run_now"])] == ["root", "root"]
