"""Write-backs on the console (docs/console.md#a-todo-todosid): a todo's page lists them with a
link to where they were written and "retry now" for a failed or abandoned one (and its operator
API twin), a webhook's page shows its connection with a "test" button and its failing
write-backs, and a delivery's page names what was written back for its todos. The write-backs
are made the way production makes them: GitHub's example deliveries, sent by the worker to the
stand-in held to GitHub's published description (ingest/tests/github_standin.py)."""

import json

import pytest
from django.contrib.auth.models import Permission
from django.test import Client

from ingest import connections, transitions as ingest_transitions, write_back
from ingest.models import Connection, WriteBack
from ingest.tests import hook_client, signing
from ingest.tests.conftest import SECRETS
from ingest.tests.github_standin import webhook_example
from tests.factories import EndpointFactory, UserFactory
from todos import transitions as todo_transitions
from todos.models import Todo

pytestmark = pytest.mark.django_db
INSTALLATION = 4242


@pytest.fixture(autouse=True)
def public_url(settings):
    settings.SWITCHBOARD_PUBLIC_URL = "https://sb.example"


@pytest.fixture
def hooked(operator, endpoint, app_connection, make_webhook):
    webhook = make_webhook("github", slug="gh")
    connections.set_webhook_connection(webhook, app_connection)
    return webhook


@pytest.fixture
def owner_client(operator):
    browser = Client()
    browser.force_login(operator)
    return browser


def deliver(event="issues", action="opened", *, slug="gh", issue=None) -> Todo:
    payload = webhook_example(event, action=action)
    if issue is not None:  # another issue: another body, so not a replay
        payload["issue"]["number"] = issue
    payload.setdefault("installation", {"id": INSTALLATION, "node_id": "MDIzOkludGVncmF0aW9u"})
    body = signing.body_of(payload)
    answer = hook_client.post(slug, body, **signing.github(SECRETS["github"], body, event=event))
    assert answer.status_code == 202, answer.content
    return Todo.objects.get(pk=answer.json()["todos"][0]["id"])


def rows(todo) -> dict:
    return {row.action: row for row in WriteBack.objects.filter(todo_id=todo.pk)}


@pytest.fixture
def refused_status(hooked, github, agent):
    """A todo whose ack was sent and whose living status GitHub refused (422): failed."""
    todo = deliver()
    write_back.send_due_write_backs()
    todo_transitions.claim_todo(agent, todo.pk)
    github.fail(422, message="Validation Failed", times=1)
    write_back.send_due_write_backs()
    assert {action: row.state for action, row in rows(todo).items()} == {
        "ack": "sent", "status": "failed"}
    return todo


def write_back_row(page: str, row) -> str:
    start = page.index(f'id="write-back-{row.pk}"')
    return page[start:page.index("</tr>", start)]


# -- the todo page --------------------------------------------------------------------------------


def test_a_todo_page_lists_its_write_backs_where_and_how_they_went(refused_status, owner_client,
                                                                   github):
    todo = refused_status
    ack, status = rows(todo)["ack"], rows(todo)["status"]
    page = owner_client.get(f"/todos/{todo.pk}/").content.decode()
    issue = todo.payload["issue"]
    repo = todo.payload["repository"]
    link = f'href="http://127.0.0.1:{github.server.server_port}/{repo["full_name"]}/issues/' \
           f'{issue["number"]}"'
    sent, failed = write_back_row(page, ack), write_back_row(page, status)
    assert "eyes reaction" in sent and link in sent and f"{repo['full_name']}#{issue['number']}" in sent
    assert ">sent<" in sent and "as gh-app" in sent and "retry now" not in sent
    assert ack.sent_at.strftime("%Y-%m-%d %H:%M:%S") in sent
    assert "living status, edited in place" in failed and link in failed
    assert ">failed<" in failed and "422: Validation Failed" in failed
    assert f'action="/todos/{todo.pk}/write-backs/{status.pk}/retry"' in failed
    assert "retry now" in failed


def test_a_retrying_write_back_shows_when_it_goes_again(hooked, github, owner_client):
    todo = deliver()
    github.fail(503, times=1)
    write_back.send_due_write_backs()
    ack = rows(todo)["ack"]
    assert ack.state == "pending" and ack.failing_since is not None
    shown = write_back_row(owner_client.get(f"/todos/{todo.pk}/").content.decode(), ack)
    assert ">retrying<" in shown and "503" in shown and "retry now" not in shown
    assert ack.next_attempt_at.strftime("%Y-%m-%d %H:%M:%S") in shown


def test_a_todo_without_write_backs_says_why(owner_client, make_todo):
    todo = make_todo()
    page = owner_client.get(f"/todos/{todo.pk}/").content.decode()
    assert 'id="no-write-backs"' in page and "Nothing is written back for this todo" in page


def test_retry_now_sends_the_refused_status_again(refused_status, owner_client, github):
    todo = refused_status
    status = rows(todo)["status"]
    answer = owner_client.post(f"/todos/{todo.pk}/write-backs/{status.pk}/retry", follow=True)
    assert "the status write-back is due again" in answer.content.decode()
    status.refresh_from_db()
    assert (status.state, status.attempts, status.failing_since) == ("pending", 0, None)
    write_back.send_due_write_backs()
    status.refresh_from_db()
    assert status.state == "sent" and status.last_error == ""
    assert len(github.status_comments()) == 1


def test_retry_now_of_a_sent_write_back_changes_nothing(refused_status, owner_client):
    ack = rows(refused_status)["ack"]
    answer = owner_client.post(f"/todos/{refused_status.pk}/write-backs/{ack.pk}/retry",
                               follow=True)
    assert "is sent, neither failed nor abandoned: nothing to retry" in answer.content.decode()
    assert WriteBack.objects.get(pk=ack.pk).state == "sent"


def test_retry_now_wakes_the_sender_after_the_commit(refused_status, owner_client, monkeypatch,
                                                     django_capture_on_commit_callbacks):
    woken = []
    monkeypatch.setattr(write_back, "dispatch_send", lambda: woken.append(1))
    status = rows(refused_status)["status"]
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        owner_client.post(f"/todos/{refused_status.pk}/write-backs/{status.pk}/retry")
    assert woken == []  # not before the commit
    for callback in callbacks:
        callback()
    assert woken == [1]


def test_another_operators_write_back_is_404_and_stays_failed(refused_status):
    status = rows(refused_status)["status"]
    mallory = Client()
    mallory.force_login(UserFactory(username="mallory"))
    url = f"/todos/{refused_status.pk}/write-backs/{status.pk}/retry"
    assert mallory.post(url).status_code == 404
    assert WriteBack.objects.get(pk=status.pk).state == "failed"


def test_a_write_back_of_another_todo_is_404(refused_status, owner_client, make_todo):
    status = rows(refused_status)["status"]
    other = make_todo(title="another of mine")
    assert owner_client.post(f"/todos/{other.pk}/write-backs/{status.pk}/retry").status_code == 404
    assert WriteBack.objects.get(pk=status.pk).state == "failed"


def test_retry_now_needs_change_todo(refused_status, operator):
    status = rows(refused_status)["status"]
    operator.user_permissions.remove(*Permission.objects.filter(codename="change_todo"))
    viewer = Client()
    viewer.force_login(operator)
    answer = viewer.post(f"/todos/{refused_status.pk}/write-backs/{status.pk}/retry")
    assert answer.status_code == 403 and b"todos.change_todo" in answer.content
    assert WriteBack.objects.get(pk=status.pk).state == "failed"
    assert viewer.get(f"/todos/{refused_status.pk}/write-backs/{status.pk}/retry").status_code == 403


# -- the operator API's twin ----------------------------------------------------------------------


def api_retry(todo_id, write_back_id, token, body=None):
    return Client().post(f"/api/v1/todos/{todo_id}/write-backs/{write_back_id}/retry",
                         data=json.dumps(body) if body is not None else "",
                         content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token}")


def test_the_api_retries_a_failed_write_back_once(refused_status, operator):
    token = ingest_transitions.mint_operator_token(user=operator, name="cli")[1]
    status = rows(refused_status)["status"]
    answer = api_retry(refused_status.pk, status.pk, token)
    assert answer.status_code == 200, answer.content
    shown = answer.json()["write_back"]
    assert (shown["id"], shown["todo"], shown["action"], shown["state"], shown["attempts"]) == (
        status.pk, str(refused_status.pk), "status", "pending", 0)
    assert shown["next_attempt_at"] and shown["url"].endswith(
        f"/issues/{refused_status.payload['issue']['number']}")
    again = api_retry(refused_status.pk, status.pk, token)
    assert again.status_code == 409 and again.json()["error"]["code"] == "not_retryable"


def test_the_api_refuses_what_is_not_the_operators_and_bad_input(refused_status, operator,
                                                                  make_todo):
    status = rows(refused_status)["status"]
    mallory = UserFactory(username="mallory")
    EndpointFactory(slug="mallorys", owner=mallory)
    theirs = ingest_transitions.mint_operator_token(user=mallory, name="cli")[1]
    mine = ingest_transitions.mint_operator_token(user=operator, name="cli")[1]
    assert api_retry(refused_status.pk, status.pk, theirs).status_code == 404
    other = make_todo(title="another of mine")
    assert api_retry(other.pk, status.pk, mine).status_code == 404
    assert api_retry(refused_status.pk, "x1", mine).status_code == 404
    bad = api_retry(refused_status.pk, status.pk, mine, body={"force": True})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_argument"
    assert api_retry(refused_status.pk, status.pk, "sbo_not-a-token").status_code == 401
    operator.user_permissions.remove(*Permission.objects.filter(codename="change_todo"))
    refused = api_retry(refused_status.pk, status.pk, mine)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
    assert WriteBack.objects.get(pk=status.pk).state == "failed"


# -- the webhook page -----------------------------------------------------------------------------


def section(page: str, element_id: str) -> str:
    start = page.index(f'id="{element_id}"')
    return page[start:page.index("</section>", start)]


def test_the_webhook_page_shows_its_connection_and_failing_write_backs(refused_status, hooked,
                                                                       github, owner_client,
                                                                       app_connection):
    retrying = deliver("issue_comment", "created", issue=2)  # its own thread
    github.fail(503, times=1)
    write_back.send_due_write_backs()
    assert rows(retrying)["ack"].failing_since is not None
    page = owner_client.get("/todos/webhooks/gh/").content.decode()
    card = section(page, "write-back")
    assert "gh-app" in card and "github_app" in card
    assert "writes as <strong id=\"connection-identity\">switchboard-test[bot]</strong>" in card
    assert app_connection.last_success_at.strftime("%Y-%m-%d %H:%M:%S") in card
    assert "last success (a test or a write-back)" in card
    assert 'action="/todos/webhooks/gh/test-connection"' in card
    assert "1 failing" in card and "1 retrying" in card
    listed = card[card.index('class="failing-write-backs"'):]
    assert f'href="/todos/{refused_status.pk}/"' in listed and "422: Validation Failed" in listed
    assert f'href="/todos/{retrying.pk}/"' not in listed  # retrying is not failing


def test_the_webhook_page_lists_the_latest_failing_and_says_where_the_rest_are(
        refused_status, hooked, github, owner_client, monkeypatch):
    from console import webhooks as console_webhooks

    monkeypatch.setattr(console_webhooks, "WEBHOOK_PAGE_FAILING_WRITE_BACKS", 1)
    newer = deliver("issue_comment", "created", issue=2)  # its own thread
    github.fail(404, message="Not Found", times=1)
    write_back.send_due_write_backs()
    assert rows(newer)["ack"].state == "failed"
    card = section(owner_client.get("/todos/webhooks/gh/").content.decode(), "write-back")
    assert "2 failing" in card
    listed = card[card.index('class="failing-write-backs"'):]
    assert f'href="/todos/{newer.pk}/"' in listed and f'/todos/{refused_status.pk}/"' not in listed
    assert "the latest 1 shown; <code>manage.py write_backs --webhook gh --state failed</code>" \
        in card


def test_the_test_button_records_what_the_source_says(hooked, github, owner_client,
                                                      app_connection):
    github.fail(401, message="Bad credentials", times=1)
    answer = owner_client.post("/todos/webhooks/gh/test-connection", follow=True)
    page = answer.content.decode()
    assert "gh-app: the test failed: 401: Bad credentials" in page
    assert "Bad credentials" in section(page, "write-back")
    failed_at = Connection.objects.get(pk=app_connection.pk).last_error_at
    assert failed_at is not None
    answer = owner_client.post("/todos/webhooks/gh/test-connection", follow=True)
    assert "gh-app: writes back as switchboard-test[bot]" in answer.content.decode()
    tested = Connection.objects.get(pk=app_connection.pk)
    assert tested.last_success_at > failed_at and tested.is_ok
    assert len(github.requests_to("apps/get-authenticated")) == 3  # at save, and twice here


def test_testing_needs_change_connection_and_another_operators_webhook_is_404(hooked, github,
                                                                              operator):
    operator.user_permissions.remove(*Permission.objects.filter(codename="change_connection"))
    viewer = Client()
    viewer.force_login(operator)
    answer = viewer.post("/todos/webhooks/gh/test-connection")
    assert answer.status_code == 403 and b"ingest.change_connection" in answer.content
    mallory = Client()
    mallory.force_login(UserFactory(username="mallory"))
    assert mallory.post("/todos/webhooks/gh/test-connection").status_code == 404
    assert len(github.requests_to("apps/get-authenticated")) == 1  # only the one at save


def test_a_webhook_without_a_connection_says_nothing_is_written_back_and_how_to_add_one(
        make_webhook, owner_client, operator):
    make_webhook("github", slug="bare")
    page = owner_client.get("/todos/webhooks/bare/").content.decode()
    card = section(page, "write-back")
    assert "Nothing is written back" in card and "this webhook has no connection" in card
    assert f"manage.py add_connection NAME --owner {operator.username} --kind github_app" in card
    assert "manage.py set_connection bare NAME" in card
    assert 'id="connection"' not in card and "test-connection" not in card
    answer = owner_client.post("/todos/webhooks/bare/test-connection", follow=True)
    assert "webhook bare has no connection to test" in answer.content.decode()


def test_a_source_with_nothing_to_write_back_to_says_so(make_webhook, owner_client):
    make_webhook("stripe", slug="payments")
    card = section(owner_client.get("/todos/webhooks/payments/").content.decode(), "write-back")
    assert "stripe has nothing switchboard could write back to" in card
    assert "add_connection" not in card


# -- the delivery page ----------------------------------------------------------------------------


def test_a_delivery_page_names_what_was_written_back_for_its_todo(refused_status, hooked,
                                                                  owner_client):
    record = refused_status.delivery_event.records.get()
    page = owner_client.get(f"/todos/webhooks/gh/deliveries/{record.pk}/").content.decode()
    listed = page[page.index('id="todos-created"'):page.index("Request headers")]
    repo, issue = refused_status.payload["repository"], refused_status.payload["issue"]
    for action, state in (("ack", "sent"), ("status", "failed")):
        row = rows(refused_status)[action]
        shown = listed[listed.index(f'id="write-back-{row.pk}"'):]
        shown = shown[:shown.index("</li>")]
        assert f"written back: {action}" in shown and f">{state}<" in shown
        assert f"{repo['full_name']}#{issue['number']}" in shown


def test_a_source_whose_connections_cannot_be_made_yet_says_so(make_webhook, owner_client,
                                                               monkeypatch):
    monkeypatch.setattr(connections, "buildable_kinds", lambda: [])
    make_webhook("github", slug="later")
    card = section(owner_client.get("/todos/webhooks/later/").content.decode(), "write-back")
    assert "this webhook has no connection" in card
    assert "switchboard cannot write back over github_app or github_token yet" in card
    assert "add_connection" not in card


def test_the_pages_read_write_backs_in_a_fixed_number_of_queries(refused_status, hooked, github,
                                                                 owner_client):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    def queries(url) -> int:
        with CaptureQueriesContext(connection) as seen:
            assert owner_client.get(url).status_code == 200
        return len(seen)

    record = refused_status.delivery_event.records.get()
    urls = [f"/todos/{refused_status.pk}/", "/todos/webhooks/gh/",
            f"/todos/webhooks/gh/deliveries/{record.pk}/"]
    before = [queries(url) for url in urls]
    for number in range(3):  # three more todos, each with a failed ack
        deliver("issues", issue=100 + number)
        github.fail(404, message="Not Found", times=1)
        write_back.send_due_write_backs()
    assert WriteBack.objects.filter(state="failed").count() == 4
    assert [queries(url) for url in urls] == before
