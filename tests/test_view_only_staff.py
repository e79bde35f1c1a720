"""View-only staff can look and nothing else (docs/security.md#who-may-act): every write URL of
the console and the operator API, found by walking the URLconf, answers a user who owns the
endpoint and webhook but holds only the ``view_*`` permissions 403 and changes nothing.

Which URLs write is not listed by hand: each concrete URL is posted once as the view-only user
(nothing may change, whatever the answer) and then once more with the permissions an operator
has; a URL whose second post changed something is a write URL, and its first answer must have
been 403. A URL with path arguments the walk cannot fill fails the test until it is taught
them, so a new write URL cannot slip past unchecked.
"""

import json
from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse
from django.utils import timezone

from console.views import ACTIONS, BULK_ACTIONS
from endpoints.models import Credential, Endpoint, EndpointEvent
from ingest import connections, transitions as ingest_transitions
from ingest.api import TODO_ACTION_ALIASES, TODO_ACTIONS
from ingest.models import (Connection, DeliveryEvent, DeliveryRecord, OperatorSecret, Route,
                           Webhook, WriteBack)
from ingest.tests.test_views import deliver
from tests.factories import EndpointFactory, UserFactory
from todos import transitions
from todos.models import Todo, TodoEvent

pytestmark = pytest.mark.django_db

OPERATOR_APPS = ("todos", "endpoints", "ingest")
# Posting these signs the user in or out: what they change is the session, not the data.
NOT_WRITES = {"board-login", "board-logout"}
# The walk must find at least these writing (a fixture that stopped making them write would
# otherwise pass silently).
KNOWN_WRITES = {"todos-act", "todos-bulk", "todos-new", "todos-endpoint-rotate", "todos-clock",
                "todos-limit", "todos-pause", "webhook-redeliver", "hand_over", "todo_action",
                "todos-write-back-retry", "webhook-test-connection", "todo_write_back_retry"}
API_WRITES = {"hand_over", "todo_action", "todo_write_back_retry"}
WATCHED = (Todo, TodoEvent, Endpoint, Credential, EndpointEvent, Webhook, Route, DeliveryEvent,
           DeliveryRecord, OperatorSecret, Connection, WriteBack)


def snapshot() -> dict:
    """A digest of every row of the WATCHED tables, in one statement (the walk takes three
    per URL)."""
    tables = [model._meta.db_table for model in WATCHED]
    digests = ", ".join(f"(SELECT md5(coalesce(string_agg(r::text, ',' ORDER BY r.id), ''))"
                        f" FROM {table} r)" for table in tables)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {digests}")
        return dict(zip(tables, cursor.fetchone()))


def walk(patterns, prefix=""):
    """(route text, URLPattern) of every view in the URLconf but the admin's, which checks
    its own model permissions (docs/security.md)."""
    for entry in patterns:
        if isinstance(entry, URLResolver):
            if str(entry.pattern).startswith("admin/"):
                continue
            yield from walk(entry.url_patterns, prefix + str(entry.pattern))
        elif isinstance(entry, URLPattern):
            yield prefix + str(entry.pattern), entry


# The state each todo action applies to, so that the operator's post really writes.
TODO_FOR_ACTION = {
    "claim": "pending", "complete": "claimed", "fail": "claimed", "extend": "claimed",
    "release": "claimed", "retry": "failed", "promote": "unverified", "priority": "pending",
    "run_now": "scheduled", "approve": "gated", "reject": "gated", "cancel": "pending",
    "request_cancel": "claimed",
}
BULK_FOR_ACTION = {"retry": "failed", "approve": "gated", "reject": "gated",
                   "promote": "unverified_gated", "cancel": "pending"}


@pytest.fixture
def world(db):
    vera = UserFactory(username="vera", permissions=())
    vera.is_staff = True
    vera.save()
    vera.user_permissions.add(*Permission.objects.filter(
        content_type__app_label__in=OPERATOR_APPS, codename__startswith="view_"))
    endpoint = EndpointFactory(slug="veras", owner=vera)
    webhook, _ = ingest_transitions.create_webhook(slug="veras-hook", owner=vera,
                                                   source="unsigned")
    ingest_transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="inbox")
    assert deliver(webhook).status_code == 202
    record = DeliveryRecord.objects.get(webhook=webhook)
    token = ingest_transitions.mint_operator_token(user=vera, name="laptop")[1]
    # A GitHub webhook writing back under a token connection whose source answers nothing
    # (a closed loopback port): testing it records an error, which is a write.
    connection, _ = connections.create_connection(
        name="veras-github", owner=vera, kind="github_token", secret="ghp_for-the-walk",
        api_url="http://127.0.0.1:9")
    connected, _ = ingest_transitions.create_webhook(slug="veras-github", owner=vera,
                                                     source="github")
    connections.set_webhook_connection(connected, connection)
    return {"vera": vera, "endpoint": endpoint, "webhook": webhook, "record": record,
            "token": token, "connection": connection, "connected": connected}


def failed_write_back(world) -> WriteBack:
    """A status write-back the source refused, of a todo of vera's: what "retry now" takes."""
    return WriteBack.objects.create(
        todo=make(world, "claimed"), connection=world["connection"], action="status",
        target={"owner": "octo", "repo": "hello", "number": 1}, target_label="octo/hello#1",
        state="failed", attempts=1, last_error="422: Validation Failed",
        created_at=timezone.now())


def make(world, kind) -> Todo:
    endpoint = world["endpoint"]
    agent = transitions.Caller.agent(endpoint, "session-a")
    options = {"trust": "signed"}
    if kind in ("gated", "unverified_gated"):
        options["requires_approval"] = True
    if kind in ("unverified", "unverified_gated"):
        options["trust"] = "unverified"
    if kind == "scheduled":
        options["not_before"] = timezone.now() + timedelta(hours=1)
    todo, _ = transitions.create_todo(endpoint=endpoint, queue="inbox", title=f"a {kind} todo",
                                      actor="test", **options)
    if kind in ("claimed", "failed"):
        transitions.claim_todo(agent, todo.pk)
    if kind == "failed":
        transitions.fail_todo(agent, todo.pk, error="boom")
    return todo


def concrete_urls(world):
    """Every (name, url, form data, JSON body or None) the walk posts, one per argument set."""
    endpoint, webhook = world["endpoint"].slug, world["webhook"].slug
    form = {"next": "/todos/", "queue": "inbox", "title": "written", "endpoint": endpoint,
            "max_claimed": "3", "queue_limits": "", "priority": "7", "lease_seconds": "60",
            "reason": "because", "error": "boom", "result": ""}
    fillers = {
        "todos-act": lambda: [({"todo_id": make(world, TODO_FOR_ACTION.get(a, "pending")).pk,
                                "action": a}, {}) for a in ACTIONS],
        "todos-bulk": lambda: [({"action": a},
                                {"ids": [make(world, BULK_FOR_ACTION.get(a, "pending")).pk]})
                               for a in BULK_ACTIONS],
        "todos-detail": lambda: [({"todo_id": make(world, "pending").pk}, {})],
        "todos-clock": lambda: [({"slug": endpoint, "state": s}, {}) for s in ("out", "in")],
        "todos-pause": lambda: [({"slug": endpoint, "action": a}, {})
                                for a in ("pause", "resume")],
        "webhook-delivery": lambda: [({"slug": webhook, "record_id": world["record"].pk}, {})],
        "webhook-redeliver": lambda: [({"slug": webhook, "record_id": world["record"].pk}, {})],
        "hand_over": lambda: [({"endpoint_slug": endpoint},
                               {"json": {"queue": "inbox", "title": "handed"}})],
        "api-endpoint-stats": lambda: [({"endpoint_slug": endpoint}, {})],
        "todos-write-back-retry": lambda: [
            ({"todo_id": row.todo_id, "write_back_id": row.pk}, {})
            for row in [failed_write_back(world)]],
        "todo_write_back_retry": lambda: [
            ({"todo_id": str(row.todo_id), "write_back_id": str(row.pk)}, {"json": {}})
            for row in [failed_write_back(world)]],
        "webhook-test-connection": lambda: [({"slug": world["connected"].slug}, {})],
        "todo_action": lambda: [
            ({"todo_id": str(make(world, TODO_FOR_ACTION[TODO_ACTION_ALIASES.get(a, a)]).pk),
              "action": a},
             {"json": {"priority": 7} if a == "priority" else {}})
            for a in [*TODO_ACTIONS, *TODO_ACTION_ALIASES]
            if TODO_ACTION_ALIASES.get(a, a) in TODO_FOR_ACTION],
    }
    for route, pattern in walk(get_resolver().url_patterns):
        name = pattern.name
        if name in NOT_WRITES:
            continue
        arguments = set(pattern.pattern.regex.groupindex)
        if not arguments:  # an unnamed one (a second spelling) is its route's text
            yield name, reverse(name) if name else "/" + route, form, None
            continue
        if name in fillers:
            filled = fillers[name]()
        elif arguments == {"slug"}:  # an endpoint's or a webhook's own page
            filled = [({"slug": webhook if name.startswith("webhook") else endpoint}, {})]
        else:
            pytest.fail(f"the walk cannot fill {route!r} ({name}): teach it the arguments")
        for kwargs, extra in filled:
            data = {**form, **{k: v for k, v in extra.items() if k != "json"}}
            yield name, reverse(name, kwargs=kwargs), data, extra.get("json")


def post(client, url, data, body, **meta):
    if body is not None:
        return client.post(url, data=json.dumps(body), content_type="application/json", **meta)
    return client.post(url, data, **meta)


@pytest.mark.parametrize("how", ["session", "bearer token"])
def test_every_write_url_refuses_view_only_staff_and_changes_nothing(world, how):
    vera = world["vera"]
    client = Client()
    client.force_login(vera)
    meta = {"HTTP_AUTHORIZATION": f"Bearer {world['token']}"} if how == "bearer token" else {}
    grants = Permission.objects.filter(content_type__app_label__in=OPERATOR_APPS)
    writes, refused = set(), []
    for name, url, data, body in list(concrete_urls(world)):
        if how == "bearer token" and not url.startswith("/api/"):
            continue  # the console reads no bearer token
        before = snapshot()
        answer = post(client, url, data, body, **meta)
        assert snapshot() == before, f"{url}: view-only staff changed something"
        vera.user_permissions.add(*grants)
        try:
            post(client, url, data, body, **meta)
            if snapshot() != before:
                writes.add(name)
                if answer.status_code != 403:
                    refused.append(f"{url}: {answer.status_code}, not 403")
                elif body is not None:
                    assert answer.json()["error"]["code"] == "forbidden", url
        finally:
            vera.user_permissions.remove(*grants.exclude(codename__startswith="view_"))
    assert not refused, refused
    expected = KNOWN_WRITES if how == "session" else API_WRITES
    assert expected <= writes, f"the walk no longer writes through {expected - writes}"


def test_the_refusal_names_the_permission_and_the_forms_ask_first(world):
    client = Client()
    client.force_login(world["vera"])
    todo = make(world, "pending")
    answer = client.post(f"/todos/{todo.pk}/cancel", {"next": "/todos/"})
    assert answer.status_code == 403 and b"todos.change_todo" in answer.content
    api = client.post(f"/api/v1/todos/{todo.pk}/cancel", data="{}",
                      content_type="application/json")
    assert api.status_code == 403
    assert api.json()["error"] == {"code": "forbidden", "message":
                                   "this needs the permission todos.change_todo"}
    # The confirmation page and the new-todo form are the first step of a write: refused too.
    assert client.get("/todos/bulk/cancel", {"ids": [todo.pk]}).status_code == 403
    assert client.get("/todos/new").status_code == 403
    # Looking still works.
    assert client.get("/todos/").status_code == 200
    assert client.get(f"/todos/{todo.pk}/").status_code == 200
    assert client.get(f"/todos/endpoints/{world['endpoint'].slug}/").status_code == 200
