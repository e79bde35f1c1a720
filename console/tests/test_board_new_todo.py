"""The board's "new todo" form: the operator API's hand-over from a signed-in operator's form,
CSRF-protected, a refusal shown on the form with what was typed and nothing written."""

import pytest
from django.test import Client

from ingest.models import OperatorSecret
from tests.factories import EndpointFactory, UserFactory
from todos.models import Todo, Trust

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice_client(client, operator):
    client.force_login(operator)
    return client


def test_the_form_hands_over_a_todo_as_the_operator(alice_client, endpoint):
    page = alice_client.get("/todos/new?endpoint=agent")
    assert page.status_code == 200 and 'name="queue"' in page.content.decode()
    answer = alice_client.post("/todos/new", {
        "endpoint": "agent", "queue": "deploys", "title": "Ship 1.4", "kind": "deploy",
        "payload": '{"tag": "v1.4"}', "secrets": '{"token": "s3cret-value"}'})
    assert answer.status_code == 302 and answer["Location"] == "/todos/?endpoint=agent"
    todo = Todo.objects.get()
    assert (todo.queue, todo.title, todo.kind, todo.trust) == ("deploys", "Ship 1.4", "deploy",
                                                               Trust.OPERATOR)
    assert todo.payload["tag"] == "v1.4" and "s3cret-value" not in str(todo.payload)
    assert OperatorSecret.objects.filter(todo=todo).count() == 1
    assert todo.events.get().actor == "alice"
    board = alice_client.get("/todos/").content.decode()
    assert f"handed over #{todo.pk}" in board


@pytest.mark.parametrize("fields, named", [
    ({"queue": "deploys", "title": "x", "payload": "{not json"}, "payload is not valid JSON"),
    ({"queue": "deploys", "title": "x", "payload": "[1, 2]"}, "payload must be a JSON object"),
    ({"queue": "bad queue!", "title": "x"}, "queue names are"),
    ({"queue": "deploys", "title": "  "}, "title"),
])
def test_a_refusal_is_shown_on_the_form_and_writes_nothing(alice_client, endpoint, fields, named):
    answer = alice_client.post("/todos/new", {"endpoint": "agent", "secrets": '{"a": "b-secret"}',
                                              **fields})
    assert answer.status_code == 400
    html = answer.content.decode()
    assert 'id="new-todo-error"' in html and named in html
    assert f'value="{fields["queue"]}"' in html  # what was typed comes back …
    assert "b-secret" not in html  # … except the secrets
    assert not Todo.objects.exists()


def test_only_the_operators_own_endpoints_and_a_csrf_token(endpoint):
    bobs = EndpointFactory(slug="bobs", owner=UserFactory(username="bob"))
    client = Client(enforce_csrf_checks=True)
    client.force_login(endpoint.owner)
    assert client.post("/todos/new", {"endpoint": "agent", "queue": "q",
                                      "title": "t"}).status_code == 403
    page = client.get("/todos/new").content.decode()
    assert 'value="agent"' in page and 'value="bobs"' not in page
    token = client.cookies["csrftoken"].value
    answer = client.post("/todos/new", {"endpoint": bobs.slug, "queue": "q", "title": "t",
                                        "csrfmiddlewaretoken": token})
    assert answer.status_code == 400 and not Todo.objects.exists()
