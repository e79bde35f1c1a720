"""The delivery -> todos write: all or none, exactly once under concurrency, independent of
Redis. Races run on real PostgreSQL with committed transactions (transaction=True)."""

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.processes import DEADLINE_SECONDS, children_database_url
from django.db import IntegrityError, connection

from ingest import transitions
from ingest.models import DeliveryEvent, Route
from switchboard.db import statements
from todos import transitions as todo_transitions
from todos.models import Todo

from . import hook_client, signing
from .conftest import SECRETS

REPO = Path(__file__).resolve().parents[2]
ISSUE = {"action": "opened", "issue": {"number": 3, "title": "t"},
         "repository": {"full_name": "o/r"}}


def arrive(webhook, *, delivery_id="d-1", kind="issues.opened"):
    return transitions.ingest_delivery(
        webhook=webhook, routes=list(Route.objects.filter(webhook=webhook).select_related("endpoint")),
        trust="signed", delivery_id=delivery_id, kind=kind, title="a title", payload={"x": 1},
        body_sha256="0" * 64,
    )


@pytest.mark.django_db
def test_failure_creating_the_second_todo_rolls_back_the_first(
        make_webhook, endpoint, other_endpoints, monkeypatch, django_capture_on_commit_callbacks,
        published):
    webhook = make_webhook("github", routes=[(endpoint, "inbox", None),
                                             (other_endpoints[0], "inbox", None),
                                             (other_endpoints[1], "inbox", None)])
    real_create = todo_transitions.create_todo
    calls = []

    def create_then_fail_on_the_second(**kwargs):
        calls.append(kwargs["endpoint"].slug)
        if len(calls) == 2:
            raise IntegrityError("simulated failure on the second route")
        return real_create(**kwargs)

    monkeypatch.setattr(todo_transitions, "create_todo", create_then_fail_on_the_second)
    with django_capture_on_commit_callbacks(execute=True), pytest.raises(IntegrityError):
        arrive(webhook)
    assert calls == ["agent", "agent-0"]
    assert Todo.objects.count() == 0 and DeliveryEvent.objects.count() == 0
    assert published == []  # the first todo, rolled back, was never announced


@pytest.mark.django_db
def test_fan_out_creates_one_todo_per_route_under_one_event(make_webhook, endpoint, other_endpoints):
    webhook = make_webhook("github", routes=[(endpoint, "inbox", None),
                                             (other_endpoints[0], "reviews", None),
                                             (other_endpoints[1], "triage", None)])
    arrival = arrive(webhook)
    assert [created for _, created in arrival.todos] == [True, True, True]
    assert {(t.endpoint.slug, t.queue) for t, _ in arrival.todos} == {
        ("agent", "inbox"), ("agent-0", "reviews"), ("agent-1", "triage")}
    assert {t.delivery_event_id for t, _ in arrival.todos} == {arrival.delivery_event.pk}


@pytest.mark.django_db
def test_key_is_free_again_once_the_todo_is_done(make_webhook, endpoint):
    webhook = make_webhook("github")
    first = arrive(webhook).todos[0][0]
    caller = todo_transitions.Caller.operator(endpoint, "alice")
    todo_transitions.claim_todo(caller, first.pk)
    todo_transitions.complete_todo(caller, first.pk)
    second, created = arrive(webhook).todos[0]
    assert created and second.pk != first.pk


@pytest.mark.django_db(transaction=True)
def test_thirty_concurrent_identical_deliveries_make_one_todo_per_route(
        make_webhook, endpoint, other_endpoints):
    webhook = make_webhook("github", routes=[(endpoint, "inbox", None),
                                             (other_endpoints[0], "inbox", None),
                                             (endpoint, "reviews", None)])
    body = json.dumps(ISSUE).encode()
    meta = signing.github(SECRETS["github"], body, delivery="same-delivery")
    barrier = threading.Barrier(30)
    answers, errors = [], []

    def send():
        try:
            barrier.wait(timeout=DEADLINE_SECONDS)
            answer = hook_client.post(webhook.slug, body, **meta)
            answers.append((answer.status_code, answer.json()))
        except Exception as exc:  # surfaced below; a thread's exception is otherwise lost
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=send) for _ in range(30)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=DEADLINE_SECONDS)
    assert errors == []
    assert [status for status, _ in answers] == [202] * 30
    assert Todo.objects.count() == 3
    ids = {tuple(sorted(t["id"] for t in data["todos"])) for _, data in answers}
    assert len(ids) == 1  # every answer names the same three todos
    created = sum(not t["duplicate"] for _, data in answers for t in data["todos"])
    assert created == 3
    # Losers' delivery events were not kept: one record of the one delivery.
    assert DeliveryEvent.objects.count() == 1


REDIS_DOWN_SCRIPT = r"""
import json, os, sys
import django
django.setup()
from ingest import transitions
from tests.factories import EndpointFactory, UserFactory
from todos import transitions as todo_transitions
from ingest.tests import hook_client, signing

owner = UserFactory(username="redis-down-owner")
endpoint = EndpointFactory(slug="redis-down-agent", owner=owner)
webhook, secret = transitions.create_webhook(slug="redis-down", owner=owner, source="github")
transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="inbox")
body = json.dumps({"action": "opened", "issue": {"number": 1, "title": "t"}}).encode()
answer = hook_client.post("redis-down", body, **signing.github(secret, body))
caller = todo_transitions.Caller.agent(endpoint, "session-1")
pulled = todo_transitions.claim_next_todo(caller)
from channels_push.bus import publish
publish.wait_for_sends(10)  # the fire-and-forget board send has failed (and logged) by now
print(json.dumps({"status": answer.status_code, "answer": answer.json(),
                  "pulled": str(pulled.pk) if pulled else None}))
"""


@pytest.mark.django_db(transaction=True)
def test_ingest_with_redis_unreachable_still_answers_202_and_the_todo_is_pullable():
    """A separate process whose REDIS_URL points at a closed port: the channel layer, the rate
    limiter and the after-commit publish all see Redis down (the shared Redis stays up)."""
    env = {**__import__("os").environ, "REDIS_URL": "redis://127.0.0.1:6390/0",
           "DJANGO_SETTINGS_MODULE": "switchboard.settings_test", "PYTHONPATH": str(REPO)}
    # The child writes to this test's database (committed rows, transaction=True test).
    env["DATABASE_URL"] = children_database_url()
    result = subprocess.run([sys.executable, "-c", REDIS_DOWN_SCRIPT], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["status"] == 202
    [entry] = outcome["answer"]["todos"]
    assert outcome["pulled"] == entry["id"]
    assert "publish dropped" in result.stderr  # the publish failed, and was only logged
    assert "rate limit counting in-process" in result.stderr  # the limiter failed open
    assert Todo.objects.filter(pk=entry["id"], state="claimed").exists()


@pytest.mark.django_db
def test_a_database_failure_answers_503_json_and_keeps_nothing(make_webhook, monkeypatch, caplog):
    from django.db import OperationalError

    webhook = make_webhook("github")

    def fail(*args, **kwargs):
        raise OperationalError("server closed the connection; DETAIL: the body was {secret}")

    read_rows = statements.fetch_rows

    def fail_writes(sql, params):
        # The webhook lookup (a read on the same path) still works: the failure is the write's.
        return fail() if "INSERT" in sql else read_rows(sql, params)

    # The todo's write fails: in the one-statement delivery (PostgreSQL, one route) or in the
    # transaction path.
    monkeypatch.setattr(statements, "fetch_rows", fail_writes)
    monkeypatch.setattr(todo_transitions, "create_todo", fail)
    body = json.dumps(ISSUE).encode()
    answer = hook_client.post(webhook.slug, body, **signing.github(SECRETS["github"], body))
    assert answer.status_code == 503 and answer["Retry-After"] == "5"
    assert answer.json()["error"]["code"] == "unavailable"
    assert Todo.objects.count() == 0 and DeliveryEvent.objects.count() == 0
    assert "{secret}" not in caplog.text and "OperationalError" in " ".join(
        str(getattr(r, "error", "")) for r in caplog.records)


# -- idempotency keys stay stable when routes change ------------------------------------------


@pytest.mark.django_db
def test_adding_a_second_route_to_the_same_endpoint_keeps_the_first_routes_key(
        make_webhook, endpoint, published):
    """A redelivery after a second route to the same endpoint was added must find the live
    todo of the first delivery (the endpoint's first route keeps the plain §5 key) and create
    only the new route's todo."""
    webhook = make_webhook("github")  # one route: endpoint/inbox
    first = arrive(webhook, delivery_id="live-1")
    (original, created), = first.todos
    assert created and original.idempotency_key == "github-hook:live-1"
    transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="reviews")

    again = arrive(webhook, delivery_id="live-1")
    by_queue = {todo.queue: (todo, created) for todo, created in again.todos}
    assert by_queue["inbox"] == (original, False)
    new_todo, new_created = by_queue["reviews"]
    assert new_created and new_todo.idempotency_key == "github-hook:live-1/reviews"
    assert Todo.objects.count() == 2


@pytest.mark.django_db
def test_the_first_routes_key_does_not_depend_on_which_routes_match_the_kind(make_webhook,
                                                                             endpoint):
    webhook = make_webhook("github", routes=[(endpoint, "pushes", ["push"]),
                                             (endpoint, "inbox", None)])
    (todo, _), = arrive(webhook, delivery_id="d-9", kind="issues.opened").todos
    # "pushes" is the endpoint's first route; "inbox" is an additional one, kind or not.
    assert todo.queue == "inbox" and todo.idempotency_key == "github-hook:d-9/inbox"


# -- route checks: scope and owner, for every caller ------------------------------------------


@pytest.mark.django_db
def test_route_to_a_queue_outside_the_endpoints_scope_is_refused(operator):
    from django.core.exceptions import ValidationError

    from tests.factories import EndpointFactory

    narrow = EndpointFactory(slug="narrow", owner=operator, scope=["inbox"])
    webhook, _ = transitions.create_webhook(slug="gh", owner=operator, source="github")
    with pytest.raises(ValidationError, match="outside endpoint narrow's scope"):
        transitions.add_webhook_route(webhook=webhook, endpoint=narrow, queue="reviews")
    transitions.add_webhook_route(webhook=webhook, endpoint=narrow, queue="inbox")
    assert Route.objects.count() == 1


@pytest.mark.django_db
def test_route_to_another_owners_endpoint_is_refused(operator):
    from django.core.exceptions import ValidationError

    from tests.factories import EndpointFactory, UserFactory

    bobs = EndpointFactory(slug="bobs", owner=UserFactory(username="bob"))
    webhook, _ = transitions.create_webhook(slug="gh", owner=operator, source="github")
    with pytest.raises(ValidationError, match="different owners"):
        transitions.add_webhook_route(webhook=webhook, endpoint=bobs, queue="inbox")
    assert Route.objects.count() == 0


def test_the_unsigned_warning_names_the_body_cap_in_force(settings):
    settings.SWITCHBOARD_UNSIGNED_MAX_BODY_BYTES = 16 * 1024
    assert "SWITCHBOARD_UNSIGNED_MAX_BODY_BYTES (16 KiB)" in transitions.unsigned_warning()
    settings.SWITCHBOARD_UNSIGNED_MAX_BODY_BYTES = 1000
    assert "(1000 bytes)" in transitions.unsigned_warning()
