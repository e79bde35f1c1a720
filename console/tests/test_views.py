"""The Todos board: login, visibility per operator, buttons through the transitions, CSRF."""

import re

import pytest
from django.test import Client
from django.urls import reverse

from tests.factories import EndpointFactory, UserFactory
from todos import transitions
from todos.models import State, Todo, Trust

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice_client(client, operator):
    client.force_login(operator)
    return client


@pytest.fixture
def bob_todo(db):
    bob = UserFactory(username="bob")
    bobs = EndpointFactory(slug="bobs", owner=bob)
    todo, _ = transitions.create_todo(endpoint=bobs, queue="inbox", title="bob's secret work",
                                      actor="test", trust=Trust.SIGNED)
    return todo


def test_board_requires_login(client):
    response = client.get("/todos/")
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("board-login"))


def test_login_page_signs_in_and_has_no_oidc_button_without_oidc(client, operator):
    page = client.get(reverse("board-login"))
    assert page.status_code == 200
    assert b"single sign-on" not in page.content
    response = client.post(reverse("board-login"),
                           {"username": "alice", "password": "pw-for-tests", "next": "/todos/"})
    assert response.status_code == 302 and response["Location"] == "/todos/"
    assert client.get("/todos/").status_code == 200


def test_oidc_button_needs_both_settings_and_routes(settings):
    from console import views

    assert views.oidc_login_url() is None
    settings.OIDC_ENABLED = True
    # Configured but its URLs not mounted: still no button rather than a broken link.
    assert views.oidc_login_url() is None


def test_board_lists_own_todos_with_trust_badges(alice_client, make_todo, bob_todo):
    make_todo(title="signed one", trust=Trust.SIGNED)
    make_todo(title="operator one", trust=Trust.OPERATOR)
    make_todo(title="unverified one")
    html = alice_client.get("/todos/").content.decode()
    for trust, title in [("signed", "signed one"), ("operator", "operator one"),
                         ("unverified", "unverified one")]:
        row = re.search(rf"<tr id=\"todo-\d+\"[^>]*>(?:(?!</tr>).)*{title}(?:(?!</tr>).)*</tr>",
                        html, re.S)
        assert row, title
        assert f'trust-{trust}"' in row.group(0)
    assert "bob&#x27;s secret work" not in html and "bob's secret work" not in html
    assert "bobs" not in html  # not even in the endpoint filter


def test_superuser_sees_every_endpoint(client, make_todo, bob_todo):
    make_todo(title="alice work")
    root = UserFactory(username="root", is_superuser=True, is_staff=True)
    client.force_login(root)
    html = client.get("/todos/").content.decode()
    assert "alice work" in html and "secret work" in html


def test_board_filters_by_endpoint_queue_and_state(alice_client, operator, make_todo):
    other = EndpointFactory(slug="other", owner=operator)
    make_todo(queue="inbox", title="inbox pending")
    claimed = make_todo(queue="reviews", title="reviews claimed")
    transitions.claim_todo(transitions.Caller.operator(claimed.endpoint, "x"), claimed.pk)
    make_todo(queue="inbox", title="on other endpoint", on=other)

    def titles(query):
        return {t.title for t in alice_client.get("/todos/" + query).context["todos"]}

    assert titles("") == {"inbox pending", "reviews claimed", "on other endpoint"}
    assert titles("?queue=inbox") == {"inbox pending", "on other endpoint"}
    assert titles("?state=claimed") == {"reviews claimed"}
    assert titles("?endpoint=other") == {"on other endpoint"}
    assert titles("?endpoint=agent&queue=inbox&state=pending") == {"inbox pending"}
    assert titles("?state=bogus") == {"inbox pending", "reviews claimed", "on other endpoint"}


def test_rows_fragment_is_the_filtered_rows(alice_client, make_todo):
    make_todo(queue="inbox", title="in inbox")
    make_todo(queue="reviews", title="in reviews")
    html = alice_client.get("/todos/rows?queue=reviews").content.decode()
    assert "in reviews" in html and "in inbox" not in html and "<html" not in html


def test_todo_page_shows_payload_refs_result_attempts_lease_and_history(alice_client, make_todo):
    todo = make_todo(title="deploy", trust=Trust.OPERATOR,
                     payload={"token": {"$secret": "sec_abc123"}, "n": 1})
    caller = transitions.Caller.operator(todo.endpoint, "alice")
    transitions.claim_todo(caller, todo.pk)
    transitions.fail_todo(caller, todo.pk, error="boom", result={"log": "went wrong"})
    html = alice_client.get(f"/todos/{todo.pk}/").content.decode()
    assert "&quot;$secret&quot;: &quot;sec_abc123&quot;" in html  # the ref, as-is
    assert "went wrong" in html and "boom" in html
    assert "1 of 5" in html
    history = html.split('id="history"')[1]
    assert [a for a in ("create", "claim", "fail") if f"<td>{a}</td>" in history] == ["create", "claim", "fail"]


def test_other_operators_todo_page_is_404(alice_client, bob_todo):
    assert alice_client.get(f"/todos/{bob_todo.pk}/").status_code == 404
    assert alice_client.get("/todos/999999999/").status_code == 404


def post_action(client, todo, action, **data):
    return client.post(f"/todos/{todo.pk}/{action}", {"next": "/todos/", **data})


def test_claim_then_complete_as_the_operator(alice_client, make_todo):
    todo = make_todo()
    response = post_action(alice_client, todo, "claim")
    assert response.status_code == 302 and response["Location"] == "/todos/"
    todo.refresh_from_db()
    assert todo.state == State.CLAIMED and todo.lease_owner == "alice" and todo.attempts == 1
    post_action(alice_client, todo, "extend", lease_seconds="600")
    post_action(alice_client, todo, "complete", result='{"ok": true}')
    todo.refresh_from_db()
    assert todo.state == State.DONE and todo.result == {"ok": True}
    actions = list(todo.events.order_by("id").values_list("action", "actor"))
    assert actions == [("create", "test"), ("claim", "alice"), ("heartbeat", "alice"),
                       ("complete", "alice")]


def test_fail_release_and_retry_now(alice_client, make_todo):
    todo = make_todo()
    post_action(alice_client, todo, "claim")
    post_action(alice_client, todo, "release")
    todo.refresh_from_db()
    assert todo.state == State.PENDING and todo.attempts == 0
    post_action(alice_client, todo, "claim")
    post_action(alice_client, todo, "fail", error="nope")
    todo.refresh_from_db()
    assert todo.state == State.FAILED and todo.last_error == "nope" and todo.retry_at
    post_action(alice_client, todo, "retry")
    todo.refresh_from_db()
    assert todo.state == State.PENDING and todo.attempts == 0


def test_refusal_becomes_a_message_not_an_error(alice_client, make_todo, agent):
    todo = make_todo()
    transitions.claim_todo(agent, todo.pk)  # an agent session holds it
    post_action(alice_client, todo, "claim")
    assert "not_claimable" in alice_client.get("/todos/").content.decode()
    todo.refresh_from_db()
    assert todo.state == State.CLAIMED and todo.lease_owner == "session-a"


@pytest.mark.parametrize("action, state", [("release", State.PENDING), ("fail", State.FAILED),
                                           ("complete", State.DONE), ("extend", State.CLAIMED)])
def test_board_buttons_override_an_agents_lease(alice_client, make_todo, agent, action, state):
    """Issue 13.3: complete, fail, extend and release on a todo an agent held answered "not
    held by this session (lease_lost)", so a stuck 24 h lease could only be freed in admin."""
    todo = make_todo()
    held = transitions.claim_todo(agent, todo.pk, lease_ttl_seconds=86400)
    post_action(alice_client, todo, action, lease_seconds="600")
    page = alice_client.get("/todos/").content.decode()
    assert "the agent&#x27;s lease" in page or "the agent's lease" in page
    assert "this session" not in page and "lease_lost" not in page
    todo.refresh_from_db()
    assert todo.state == state
    event = todo.events.order_by("-id").first()
    assert event.actor == "alice" and event.detail["override"] is True
    assert event.detail["overridden_lease"]["lease_id"] == held.lease_id[:8]
    outcome = transitions.Refusal
    if action == "extend":  # the agent keeps an extended lease
        assert transitions.complete_todo(agent, todo.pk, lease_id=held.lease_id).state == State.DONE
    else:
        with pytest.raises(outcome) as refused:
            transitions.heartbeat_todo(agent, todo.pk, lease_id=held.lease_id)
        assert refused.value.code == "lease_lost"
    detail = alice_client.get(f"/todos/{todo.pk}/").content.decode()
    assert "override" in detail  # the history names the override


def test_a_board_override_acts_on_the_lease_the_page_showed(alice_client, make_todo, agent):
    todo = make_todo()
    shown = transitions.claim_todo(agent, todo.pk)
    page = alice_client.get(f"/todos/{todo.pk}/").content.decode()
    assert "act on the agent&#x27;s lease as an override" in page or \
        "act on the agent's lease as an override" in page
    assert f'name="lease" value="{shown.lease_id[:8]}"' in page
    transitions.release_todo(agent, todo.pk)
    now_held = transitions.claim_todo(transitions.Caller.agent(todo.endpoint, "session-b"), todo.pk)
    post_action(alice_client, todo, "release", lease=shown.lease_id[:8])
    message = alice_client.get("/todos/").content.decode()
    assert "changed since the page was shown" in message and "this session" not in message
    todo.refresh_from_db()
    assert todo.state == State.CLAIMED and todo.lease_id == now_held.lease_id
    post_action(alice_client, todo, "release", lease=now_held.lease_id[:8])
    todo.refresh_from_db()
    assert todo.state == State.PENDING


def test_an_override_of_a_lease_that_changed_meanwhile_says_so(make_todo, agent):
    todo = make_todo()
    transitions.claim_todo(agent, todo.pk)
    seen = Todo.objects.get(pk=todo.pk)  # what the operator's page showed
    transitions.release_todo(agent, todo.pk)
    transitions.claim_todo(transitions.Caller.agent(todo.endpoint, "session-b"), todo.pk)
    caller = transitions.Caller.operator(todo.endpoint, "alice")
    with pytest.raises(transitions.Refusal) as refused:
        transitions.release_todo(caller, todo.pk, overriding=transitions.HeldLease.of(seen))
    assert "the agent's lease" in refused.value.message and "session" not in refused.value.message
    todo.refresh_from_db()
    assert todo.lease_owner == "session-b"


def test_forged_action_on_another_operators_todo_is_404_and_changes_nothing(alice_client, bob_todo):
    for action in ("claim", "complete", "fail", "extend", "release", "retry"):
        assert post_action(alice_client, bob_todo, action).status_code == 404
    bob_todo.refresh_from_db()
    assert bob_todo.state == State.PENDING and bob_todo.events.count() == 1


def test_unknown_action_and_get_are_refused(alice_client, make_todo):
    todo = make_todo()
    assert post_action(alice_client, todo, "explode").status_code == 404
    assert alice_client.get(f"/todos/{todo.pk}/claim").status_code == 405


def test_offsite_next_is_not_followed(alice_client, make_todo):
    todo = make_todo()
    response = post_action(alice_client, todo, "claim", next="https://evil.example/")
    assert response["Location"] == f"/todos/{todo.pk}/"


def test_csrf_is_enforced_on_every_button(operator, make_todo):
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator)
    todo = make_todo()
    assert client.post(f"/todos/{todo.pk}/claim", {"next": "/todos/"}).status_code == 403
    todo.refresh_from_db()
    assert todo.state == State.PENDING
    page = client.get("/todos/").content.decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
    response = client.post(f"/todos/{todo.pk}/claim",
                           {"next": "/todos/", "csrfmiddlewaretoken": token})
    assert response.status_code == 302
    todo.refresh_from_db()
    assert todo.state == State.CLAIMED


def test_board_script_is_linked_and_served_as_a_static_file(alice_client):
    page = alice_client.get("/todos/").content.decode()
    assert '<script src="/static/console/board.js" defer>' in page
    response = asgi_get("/static/console/board.js")
    assert response["status"] == 200 and b"EventSource" in response["body"]


def asgi_get(path: str) -> dict:
    """GET through the real ASGI application (the test client has no static files handler):
    the status, the headers and the whole body."""
    from asgiref.sync import async_to_sync
    from asgiref.testing import ApplicationCommunicator

    from switchboard.asgi import application

    async def go():
        communicator = ApplicationCommunicator(application, {
            "type": "http", "http_version": "1.1", "method": "GET", "path": path,
            "query_string": b"", "headers": [(b"host", b"127.0.0.1")], "scheme": "http",
            "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)})
        await communicator.send_input({"type": "http.request", "body": b""})
        start = await communicator.receive_output(10)
        body = b""
        while True:
            chunk = await communicator.receive_output(10)
            body += chunk.get("body", b"")
            if not chunk.get("more_body"):
                break
        return {"status": start["status"], "headers": start["headers"], "body": body}

    return async_to_sync(go)()


def test_many_rows_render_in_a_fixed_number_of_queries(alice_client, make_todo,
                                                       django_assert_max_num_queries):
    for n in range(30):
        make_todo(title=f"todo {n}")
    # session, user, endpoints (filter, with today's spend for the header), todos (+version
    # subquery), the header's glance (open counts, the fold row, the tallies, the unfolded
    # events); not one per row
    with django_assert_max_num_queries(8):
        assert len(alice_client.get("/todos/").context["todos"]) == 30


def test_the_board_page_of_a_hundred_endpoints_costs_what_one_endpoints_does(
        alice_client, endpoint, django_assert_max_num_queries):
    for n in range(100):
        other = EndpointFactory(slug=f"e{n}", owner=endpoint.owner)
        transitions.create_todo(endpoint=other, queue=f"q{n % 7}", title=f"todo {n}",
                                actor="test")
    # the same statements as for one endpoint: the glance groups, it does not loop, and the
    # spend strip's figures come with the endpoints' own query
    with django_assert_max_num_queries(8):
        page = alice_client.get("/todos/")
    assert len(page.context["todos"]) == 100


def test_todo_page_offers_result_error_and_lease_forms_while_claimed(alice_client, make_todo):
    todo = make_todo()
    assert 'name="result"' not in alice_client.get(f"/todos/{todo.pk}/").content.decode()
    post_action(alice_client, todo, "claim")
    page = alice_client.get(f"/todos/{todo.pk}/").content.decode()
    assert 'name="result"' in page and 'name="error"' in page and 'name="lease_seconds"' in page
    response = alice_client.post(f"/todos/{todo.pk}/extend", {"lease_seconds": "soon"})
    assert response.status_code == 302  # a refusal message, not a 500
    assert "invalid_argument" in alice_client.get(f"/todos/{todo.pk}/").content.decode()
    alice_client.post(f"/todos/{todo.pk}/complete", {"result": "plain words"})
    todo.refresh_from_db()
    assert todo.state == State.DONE and todo.result == "plain words"


def test_filtered_board_buttons_return_to_the_filtered_board(alice_client, make_todo):
    make_todo(queue="inbox")
    for url in ("/todos/?queue=inbox", "/todos/rows?queue=inbox"):
        html = alice_client.get(url).content.decode()
        assert 'name="next" value="/todos/?queue=inbox"' in html


def test_board_clock_buttons_clock_own_endpoints_only(alice_client, operator, bob_todo):
    from endpoints.models import Endpoint

    mine = EndpointFactory(slug="mine", owner=operator)
    board = alice_client.get(reverse("todos-board")).content.decode()
    assert reverse("todos-clock", args=["mine", "out"]) in board
    assert "bobs" not in board
    response = alice_client.post(reverse("todos-clock", args=["mine", "out"]),
                                 {"next": reverse("todos-board")})
    assert response.status_code == 302
    assert Endpoint.objects.get(pk=mine.pk).presence_state == "out"
    assert reverse("todos-clock", args=["mine", "in"]) in alice_client.get(reverse("todos-board")).content.decode()
    assert alice_client.post(reverse("todos-clock", args=["bobs", "out"])).status_code == 404
    assert Endpoint.objects.get(slug="bobs").presence_state == "in"
    assert alice_client.get(reverse("todos-clock", args=["mine", "in"])).status_code == 405


@pytest.mark.parametrize("bad", ["a%00b", "%ED%A0%80"])
@pytest.mark.parametrize("field", ["endpoint", "queue"])
def test_a_board_filter_with_a_nul_or_broken_text_is_a_400_naming_it_never_a_500(
        alice_client, endpoint, field, bad):
    for path in ("/todos/", "/todos/rows"):
        answer = alice_client.get(f"{path}?{field}={bad}")
        if "%00" in bad:
            assert answer.status_code == 400, (path, answer.status_code)
            assert field in answer.content.decode()
        else:  # undecodable bytes arrive as U+FFFD: a filter that matches nothing
            assert answer.status_code == 200, (path, answer.status_code)


def test_pausing_a_queue_named_with_a_nul_on_the_board_is_refused_with_a_message(
        alice_client, endpoint):
    answer = alice_client.post(f"/todos/endpoints/{endpoint.slug}/work/pause",
                               {"queue": "in\x00box"}, follow=True)
    assert answer.status_code == 200
    notes = [str(m) for m in answer.context["messages"]]
    assert any("queue" in note for note in notes), notes
    endpoint.refresh_from_db()
    assert endpoint.paused_queues == []
