"""The board's header, tabs, search, paging and bulk actions (the page and its JSON), and the
"new todo" form."""

import json
import re

import pytest
from django.test import Client

from tests.factories import EndpointFactory, UserFactory
from todos import queries, transitions
from todos.models import State, TodoEvent, Trust
from console.tests.test_views import alice_client  # noqa: F401 — a fixture

pytestmark = pytest.mark.django_db


@pytest.fixture
def bobs(db):
    return EndpointFactory(slug="bobs", owner=UserFactory(username="bob"))


def dead_letter(endpoint, agent, make_todo, queue="deploys", error="exit 1"):
    endpoint.max_attempts = 1
    endpoint.save()
    todo = transitions.claim_todo(agent, make_todo(queue=queue).pk)
    return transitions.fail_todo(agent, todo.pk, error=error)


def test_the_board_embeds_its_glance_and_tabs_for_every_state(alice_client, make_todo, bobs):
    make_todo(queue="inbox")
    transitions.create_todo(endpoint=bobs, queue="inbox", title="bob's", actor="test")
    page = alice_client.get("/todos/")
    glance = json.loads(re.search(r'<script id="glance-data" type="application/json">(.*?)</script>',
                                  page.content.decode(), re.S).group(1))
    assert [entry["endpoint"] for entry in glance["endpoints"]] == ["agent"]  # not bob's
    assert glance["endpoints"][0]["queues"]["inbox"]["pending"] == 1
    assert glance["columns"] == queries.glance_columns()
    tabs = [tab["state"] for tab in page.context["tabs"]]
    assert tabs[0] == "" and {"pending", "claimed", "retrying", "dead", "done"} <= set(tabs)
    for state in State.values:
        if state != State.FAILED:  # shown as its two kinds
            assert state in tabs


def test_the_glance_json_is_the_viewers_own(alice_client, make_todo, bobs):
    make_todo()
    answer = alice_client.get("/todos/glance").json()
    assert [entry["endpoint"] for entry in answer["endpoints"]] == ["agent"]
    assert alice_client.get("/todos/glance?endpoint=bobs").json()["endpoints"] == []
    assert Client().get("/todos/glance").status_code == 302  # sign in first


def test_tabs_split_failed_into_retrying_and_dead(alice_client, endpoint, agent, make_todo):
    waiting = transitions.fail_todo(agent, transitions.claim_todo(agent, make_todo().pk).pk,
                                    error="flaky")
    dead = dead_letter(endpoint, agent, make_todo, error="Traceback: KeyError 'sha'")
    listed = lambda query: [t.pk for t in alice_client.get(f"/todos/?{query}").context["todos"]]
    assert listed("state=dead") == [dead.pk]
    assert listed("state=retrying") == [waiting.pk]
    assert listed("state=failed") == [dead.pk, waiting.pk]
    html = alice_client.get("/todos/?state=failed").content.decode()
    # A failed row says why and when (or that it will not) retry.
    assert "Traceback: KeyError" in html and "dead letter: no retry left" in html
    assert re.search(rf'id="todo-{waiting.pk}".*?retry <time datetime=', html, re.S)


def test_search_finds_by_id_title_or_kind(alice_client, make_todo):
    deploy = make_todo(title="Deploy the release", kind="deploy")
    issue = make_todo(title="Crash on start", kind="github.issues")
    listed = lambda q: [t.pk for t in alice_client.get("/todos/", {"q": q}).context["todos"]]
    assert listed(f"#{issue.pk}") == [issue.pk] and listed(str(deploy.pk)) == [deploy.pk]
    assert listed("crash") == [issue.pk]
    assert listed("GITHUB.") == [issue.pk]
    assert listed("nothing like it") == []
    assert alice_client.get("/todos/", {"q": "a\x00b"}).status_code == 400


def test_older_pages_past_the_newest_two_hundred(alice_client, make_todo):
    made = [make_todo(title=f"t{n}").pk for n in range(queries.BOARD_LIMIT + 5)]
    first = alice_client.get("/todos/")
    assert len(first.context["todos"]) == queries.BOARD_LIMIT
    older = first.context["older_query"]
    assert older == f"before={made[5]}"
    second = alice_client.get(f"/todos/?{older}")
    assert [t.pk for t in second.context["todos"]] == made[:5][::-1]
    assert second.context["older_query"] is None
    assert 'id="newest"' in second.content.decode()


def test_bulk_retry_confirms_then_requeues_a_queues_dead_letters_only(alice_client, endpoint,
                                                                      agent, make_todo, bobs):
    dead = [dead_letter(endpoint, agent, make_todo, queue="deploys") for _ in range(3)]
    other_queue = dead_letter(endpoint, agent, make_todo, queue="inbox")
    endpoint.max_attempts = 5
    endpoint.save()
    waiting = transitions.fail_todo(agent, transitions.claim_todo(
        agent, make_todo(queue="deploys").pk).pk)
    bob_agent = transitions.Caller.agent(bobs, "session-b")
    bobs.max_attempts = 1
    bobs.save()
    bobs_dead, _ = transitions.create_todo(endpoint=bobs, queue="deploys", title="b", actor="t",
                                           trust=Trust.SIGNED)
    transitions.fail_todo(bob_agent, transitions.claim_todo(bob_agent, bobs_dead.pk).pk)
    selection = {"endpoint": "agent", "queue": "deploys", "state": "dead", "next": "/todos/"}

    events_before = TodoEvent.objects.count()
    confirm = alice_client.get("/todos/bulk/retry", selection)
    assert confirm.status_code == 200
    assert [t.pk for t in confirm.context["todos"]] == [t.pk for t in dead]
    assert 'name="csrfmiddlewaretoken"' in confirm.content.decode()
    assert TodoEvent.objects.count() == events_before  # asking changes nothing

    csrf_client = Client(enforce_csrf_checks=True)
    csrf_client.force_login(UserFactory(username="carol", is_superuser=True))
    assert csrf_client.post("/todos/bulk/retry", selection).status_code == 403  # no token

    done = alice_client.post("/todos/bulk/retry", selection)
    assert done.status_code == 302 and done["Location"] == "/todos/"
    for todo in dead:
        todo.refresh_from_db()
        assert todo.state == State.PENDING and todo.dead_lettered_at is None
    assert TodoEvent.objects.filter(action="requeue").count() == 3  # one event per todo
    for untouched in (other_queue, waiting, bobs_dead):
        untouched.refresh_from_db()
        assert untouched.state == State.FAILED


def test_bulk_retry_of_ticked_rows_reports_the_ones_it_could_not(alice_client, endpoint, agent,
                                                                 make_todo, bobs):
    dead = dead_letter(endpoint, agent, make_todo)
    pending = make_todo()
    bobs_todo, _ = transitions.create_todo(endpoint=bobs, queue="inbox", title="b", actor="t")
    ids = [dead.pk, pending.pk, bobs_todo.pk]
    confirm = alice_client.get("/todos/bulk/retry", {"ids": ids})
    assert [t.pk for t in confirm.context["todos"]] == [dead.pk]  # only what retry applies to
    alice_client.post("/todos/bulk/retry", {"ids": ids, "next": "/todos/"})
    dead.refresh_from_db()
    assert dead.state == State.PENDING
    assert alice_client.get("/todos/bulk/nonsense").status_code == 404
    # A selection by filter names an endpoint or a state: never "everything" by accident.
    assert alice_client.get("/todos/bulk/retry").context["todos"] == []


def test_a_new_bulk_action_plugs_in(alice_client, make_todo, monkeypatch):
    from console import views

    todo = make_todo(trust=Trust.UNVERIFIED)
    monkeypatch.setitem(views.BULK_ACTIONS, "promote", views.BulkAction(
        label="promote", done="promoted", applies_to=lambda: views.Q(trust=Trust.UNVERIFIED),
        act=lambda caller, todo, post: transitions.promote_todo(caller, todo.pk)))
    assert "promote…" in alice_client.get("/todos/").content.decode()
    alice_client.post("/todos/bulk/promote", {"ids": [todo.pk]})
    todo.refresh_from_db()
    assert todo.trust == Trust.OPERATOR
