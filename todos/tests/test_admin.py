"""Todo admin: read-mostly, history inline, actions through the transitions, cheap lists."""

import pytest

from tests.factories import UserFactory
from todos import transitions
from todos.models import State, Todo, TodoEvent

pytestmark = pytest.mark.django_db


@pytest.fixture
def root_client(client):
    client.force_login(UserFactory(username="root", is_superuser=True, is_staff=True))
    return client


def test_changelist_query_count_is_flat_and_skips_the_full_count(root_client, make_todo,
                                                                 django_assert_max_num_queries):
    for n in range(40):
        make_todo(title=f"todo {n}")
    with django_assert_max_num_queries(8) as captured:
        response = root_client.get("/admin/todos/todo/")
    assert response.status_code == 200
    assert response.context["cl"].show_full_result_count is False
    counts = [q["sql"] for q in captured.captured_queries if "COUNT(" in q["sql"].upper()]
    assert all("LIMIT" in sql.upper() for sql in counts), counts  # bounded counts only


def test_change_page_is_read_only_with_history_inline(root_client, make_todo):
    todo = make_todo(payload={"key": {"$secret": "ref-1"}})
    transitions.claim_todo(transitions.Caller.operator(todo.endpoint, "alice"), todo.pk)
    page = root_client.get(f"/admin/todos/todo/{todo.pk}/change/").content.decode()
    assert "ref-1" in page and "claim" in page and "create" in page
    assert 'name="_save"' not in page
    response = root_client.post(f"/admin/todos/todo/{todo.pk}/change/", {"state": "done"})
    assert response.status_code == 403
    todo.refresh_from_db()
    assert todo.state == State.CLAIMED
    assert root_client.get("/admin/todos/todo/add/").status_code == 403


def test_retry_now_action_requeues_dead_letters(root_client, operator):
    from tests.factories import EndpointFactory

    endpoint = EndpointFactory(slug="once", owner=operator, max_attempts=1)
    todo, _ = transitions.create_todo(endpoint=endpoint, queue="inbox", title="t", actor="t")
    caller = transitions.Caller.operator(endpoint, "alice")
    transitions.claim_todo(caller, todo.pk)
    transitions.fail_todo(caller, todo.pk, error="x")
    todo.refresh_from_db()
    assert todo.is_dead_letter
    root_client.post("/admin/todos/todo/", {"action": "retry_now", "_selected_action": [todo.pk]})
    todo.refresh_from_db()
    assert todo.state == State.PENDING and todo.attempts == 0
    assert todo.events.order_by("-id").first().actor == "root"


def test_release_action_returns_a_claimed_todo_and_refuses_others(root_client, make_todo, agent):
    claimed, pending = make_todo(), make_todo()
    transitions.claim_todo(agent, claimed.pk)
    response = root_client.post("/admin/todos/todo/", {
        "action": "release_lease", "_selected_action": [claimed.pk, pending.pk],
    }, follow=True)
    claimed.refresh_from_db()
    assert claimed.state == State.PENDING and claimed.lease_owner is None
    assert f"#{pending.pk}:" in response.content.decode()  # refusal reported
    event = claimed.events.order_by("-id").first()
    assert event.actor == "root" and event.detail["override"] is True


@pytest.mark.parametrize("action, state", [("fail_lease", State.FAILED),
                                           ("complete_lease", State.DONE),
                                           ("extend_lease", State.CLAIMED)])
def test_admin_overrides_an_agents_lease(root_client, make_todo, agent, action, state):
    """Issue 13.3: operators act on an agent's lease from admin too, recorded as overrides."""
    held = transitions.claim_todo(agent, make_todo().pk, lease_ttl_seconds=60)
    response = root_client.post("/admin/todos/todo/", {
        "action": action, "_selected_action": [held.pk]}, follow=True)
    assert response.status_code == 200
    todo = Todo.objects.get(pk=held.pk)
    assert todo.state == state
    event = todo.events.order_by("-id").first()
    assert event.actor == "root" and event.detail["override"] is True
    assert event.detail["overridden_lease"]["lease_id"] == held.lease_id[:8]
    if action == "extend_lease":
        assert todo.lease_expires_at > held.lease_expires_at and todo.lease_id == held.lease_id


def test_staff_operator_sees_only_own_todos_and_endpoints_in_admin(client, make_todo):
    from django.contrib.auth.models import Permission

    from tests.factories import EndpointFactory

    make_todo(title="alice's todo")
    carol = UserFactory(username="carol", is_staff=True)
    carol.user_permissions.add(*Permission.objects.filter(codename__in=["view_todo", "change_todo"]))
    carols = EndpointFactory(slug="carols", owner=carol)
    transitions.create_todo(endpoint=carols, queue="inbox", title="carol's todo", actor="t")
    client.force_login(carol)
    page = client.get("/admin/todos/todo/").content.decode()
    assert "carol&#x27;s todo" in page and "alice&#x27;s todo" not in page
    assert "carols" in page and ">agent<" not in page  # the endpoint filter too
    filtered = client.get(f"/admin/todos/todo/?endpoint={carols.pk}")
    assert filtered.status_code == 200


def test_admin_shows_agents_by_client_and_hint_never_a_whole_session_id(root_client, endpoint,
                                                                        make_todo):
    from channels_push.sessions import transitions as session_transitions
    from tests.factories import credential_for

    session = session_transitions.open_session(
        endpoint=endpoint, protocol_version="2025-11-25", client_name="claude-code",
        client_version="2.1", credential_id=credential_for(endpoint))
    agent = transitions.Caller.agent(endpoint, session.pk)
    held = transitions.claim_todo(agent, make_todo().pk)
    released = transitions.claim_todo(agent, make_todo().pk)
    transitions.release_todo(agent, released.pk)
    label = f"claude-code 2.1 · {session.pk[:8]}"
    listing = root_client.get("/admin/todos/todo/").content.decode()
    assert label in listing and session.pk not in listing
    for todo in (held, released):  # the lease holder, and the actors in the history
        page = root_client.get(f"/admin/todos/todo/{todo.pk}/change/").content.decode()
        assert label in page and session.pk not in page


def test_approve_reject_and_cancel_actions_take_their_transitions(root_client, make_todo, agent):
    approved, rejected = make_todo(requires_approval=True), make_todo(requires_approval=True)
    claimed = transitions.claim_todo(agent, make_todo().pk)
    root_client.post("/admin/todos/todo/", {"action": "approve",
                                           "_selected_action": [approved.pk]})
    response = root_client.post("/admin/todos/todo/", {
        "action": "reject", "_selected_action": [rejected.pk, claimed.pk]}, follow=True)
    assert f"#{claimed.pk}:" in response.content.decode()  # not awaiting approval: refused
    root_client.post("/admin/todos/todo/", {"action": "cancel",
                                           "_selected_action": [claimed.pk, approved.pk]})
    states = dict(Todo.objects.values_list("pk", "state"))
    assert [states[t.pk] for t in (approved, rejected, claimed)] == ["cancelled"] * 3
    events = {e.todo_id: e for e in TodoEvent.objects.filter(
        action__in=["approve", "reject", "cancel"]).order_by("id")}
    assert {e.actor for e in events.values()} == {"root"}
    assert events[claimed.pk].detail["override"] is True
    page = root_client.get(f"/admin/todos/todo/{claimed.pk}/change/").content.decode()
    assert "cancelled at" in page.lower()
