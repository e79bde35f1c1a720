"""POST /hooks/<slug> through the real ASGI app (hook_client), and POST
/api/v1/endpoints/<slug>/todos through Django's test client."""

import json
import logging
import time

import pytest
from django.test import Client, override_settings

from ingest import transitions
from ingest.models import DeliveryEvent, OperatorSecret
from switchboard.logfmt import KeyValueFormatter
from tests.factories import EndpointFactory, UserFactory
from todos.models import Todo

from . import hook_client, signing
from .conftest import SECRETS

pytestmark = pytest.mark.django_db

ISSUE = {
    "action": "opened",
    "issue": {"number": 12, "title": "Crash on start"},
    "repository": {"full_name": "octo/repo"},
}


def numbered_issue(n) -> dict:
    """ISSUE about issue ``n``: its own thread, so it makes its own todo (not a follow-up)."""
    return {**ISSUE, "issue": {**ISSUE["issue"], "number": n}, "n": n}


def post_hook(slug, body: bytes, meta: dict, content_type="application/json", **options):
    return hook_client.post(slug, body, content_type=content_type, **options, **meta)


def deliver(webhook, payload=ISSUE, **signer_kwargs):
    body = signing.body_of(payload)
    meta = signing.SIGNERS[webhook.source](SECRETS[webhook.source], body, **signer_kwargs) \
        if webhook.source != "unsigned" else {}
    return post_hook(webhook.slug, body, meta)


def nothing_written():
    return Todo.objects.count() == 0 and DeliveryEvent.objects.count() == 0


def logged(caplog) -> str:
    formatter = KeyValueFormatter()
    return "\n".join(formatter.format(record) for record in caplog.records)


# -- accepted deliveries, per source ------------------------------------------------------------

SOURCE_CASES = {
    "github": ({"HTTP_X_GITHUB_EVENT": None}, ISSUE, "issues.opened",
               "octo/repo#12 opened: Crash on start"),
    "gitea": ({}, ISSUE, "issues.opened", "octo/repo#12 opened: Crash on start"),
    "gitlab": ({}, {"object_kind": "merge_request", "project": {"path_with_namespace": "grp/proj"},
                    "object_attributes": {"iid": 7, "title": "Fix it", "action": "open"}},
               "merge_request.open", "grp/proj!7 open: Fix it"),
    "stripe": ({}, {"id": "evt_123", "type": "invoice.paid", "data": {"object": {"id": "in_9"}}},
               "invoice.paid", "Stripe invoice.paid: in_9"),
    "standard": ({}, {"type": "build.finished", "data": {}}, "build.finished",
                 "standard-hook: build.finished"),
    "unsigned": ({}, {"type": "ping"}, "ping", "unsigned-hook: ping"),
}


@pytest.mark.parametrize("source", list(SOURCE_CASES))
def test_valid_delivery_creates_a_todo_and_answers_202(make_webhook, endpoint, source):
    _, payload, kind, title = SOURCE_CASES[source]
    webhook = make_webhook(source)
    answer = deliver(webhook, payload)
    assert answer.status_code == 202, answer.content
    assert answer["Content-Length"] == str(len(answer.content))
    data = answer.json()
    if source == "unsigned":  # an anonymous sender learns only that it was accepted
        assert data == {"accepted": True}
        todo = Todo.objects.get()
        data = {"delivery": todo.delivery_event_id, "todos": [
            {"id": todo.pk, "endpoint": todo.endpoint.slug, "queue": todo.queue,
             "duplicate": False}]}
    [entry] = data["todos"]
    assert entry["endpoint"] == endpoint.slug and entry["queue"] == "inbox"
    assert entry["duplicate"] is False
    todo = Todo.objects.get(pk=entry["id"])
    assert (todo.kind, todo.title, todo.source, todo.payload) == (kind, title, source, payload)
    assert todo.trust == ("unverified" if source == "unsigned" else "signed")
    event = DeliveryEvent.objects.get(pk=data["delivery"])
    assert todo.delivery_event_id == event.pk
    assert (event.trust, event.kind, event.source) == (todo.trust, kind, source)
    assert event.attributed_to == webhook.owner and len(event.body_sha256) == 64


def test_stripe_event_id_is_the_delivery_id(make_webhook):
    webhook = make_webhook("stripe")
    payload = {"id": "evt_42", "type": "charge.succeeded"}
    deliver(webhook, payload)
    # Re-signed with a fresh timestamp, as Stripe does on retry: same event id, same todo.
    answer = deliver(webhook, payload, timestamp=int(time.time()) - 5)
    assert answer.json()["todos"][0]["duplicate"] is True
    assert Todo.objects.get().idempotency_key == "stripe-hook:evt_42"


def test_cairn_signed_event_id_in_the_body_is_the_delivery_id(make_webhook):
    webhook = make_webhook("standard")
    payload = {"type": "note.created", "event_id": "ev-7"}
    deliver(webhook, payload, message_id="msg_a")
    answer = deliver(webhook, payload, message_id="msg_b")
    assert answer.json()["todos"][0]["duplicate"] is True
    assert Todo.objects.get().idempotency_key == "standard-hook:ev-7"


def test_delivery_without_an_id_is_keyed_by_body_hash(make_webhook):
    webhook = make_webhook("unsigned")
    assert deliver(webhook, {"type": "x"}).status_code == 202
    assert deliver(webhook, {"type": "x"}).status_code == 202  # a duplicate of the live todo
    assert Todo.objects.count() == 1
    assert Todo.objects.get().idempotency_key.startswith("unsigned-hook:")
    assert len(Todo.objects.get().idempotency_key) == len("unsigned-hook:") + 64


def test_github_form_encoded_delivery_is_accepted(make_webhook):
    from urllib.parse import urlencode

    webhook = make_webhook("github")
    body = urlencode({"payload": json.dumps(ISSUE)}).encode()
    meta = signing.github(SECRETS["github"], body)
    answer = post_hook(webhook.slug, body, meta,
                       content_type="application/x-www-form-urlencoded")
    assert answer.status_code == 202
    assert Todo.objects.get().payload == ISSUE


# -- refused deliveries -------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["github", "gitea", "gitlab", "stripe", "standard"])
def test_bad_signature_is_401_and_writes_nothing(make_webhook, source, caplog):
    webhook = make_webhook(source)
    body = signing.body_of({"id": "evt_1", "type": "x", "action": "opened"})
    meta = signing.SIGNERS[source]("whsec_d3JvbmcgYnV0IHZhbGlkIGJhc2U2NA==", body)
    with caplog.at_level(logging.INFO):
        answer = post_hook(webhook.slug, body, meta)
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "bad_signature"
    assert nothing_written()
    text = logged(caplog)
    assert f"webhook={webhook.slug}" in text and "reason=" in text
    signature_values = [v for k, v in meta.items() if "SIGNATURE" in k or "TOKEN" in k]
    for secret_thing in [SECRETS[source], body.decode(), *signature_values]:
        assert secret_thing not in text


SIGNATURE_HEADER = {"github": "HTTP_X_HUB_SIGNATURE_256", "gitea": "HTTP_X_GITEA_SIGNATURE",
                    "gitlab": "HTTP_X_GITLAB_TOKEN", "stripe": "HTTP_STRIPE_SIGNATURE",
                    "standard": "HTTP_WEBHOOK_SIGNATURE"}


# GitLab's shared token does not cover the body, so a tampered body is undetectable there by
# design (test_verification says so); every other pairing must be refused.
SPOILED = [(source, spoil) for source in SIGNATURE_HEADER for spoil in ("tampered body", "missing header")
           if (source, spoil) != ("gitlab", "tampered body")]


@pytest.mark.parametrize("source, spoil", SPOILED)
def test_spoiled_delivery_is_401_and_writes_nothing(make_webhook, source, spoil):
    webhook = make_webhook(source)
    body = signing.body_of({"id": "evt_1", "type": "x", "action": "opened"})
    meta = signing.SIGNERS[source](SECRETS[source], body)
    if spoil == "tampered body":
        body = body.replace(b"opened", b"closed")
    else:
        del meta[SIGNATURE_HEADER[source]]
    answer = post_hook(webhook.slug, body, meta)
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "bad_signature"
    assert nothing_written()


@pytest.mark.parametrize("source", ["stripe", "standard"])
def test_future_timestamp_is_401_and_writes_nothing(make_webhook, frozen_now, source):
    webhook = make_webhook(source)
    answer = deliver(webhook, {"id": "evt_1", "type": "x"},
                     timestamp=int(frozen_now.timestamp()) + 400)
    assert answer.status_code == 401
    assert nothing_written()


@pytest.mark.parametrize("source", ["stripe", "standard"])
def test_stale_timestamp_is_401_and_writes_nothing(make_webhook, frozen_now, source):
    webhook = make_webhook(source)
    answer = deliver(webhook, {"id": "evt_1", "type": "x"},
                     timestamp=int(frozen_now.timestamp()) - 301)
    assert answer.status_code == 401 and "300 s" in answer.json()["error"]["message"]
    assert answer.json()["error"]["code"] == "stale_timestamp"
    assert nothing_written()


def test_previous_secret_accepted_over_http_during_rotation(make_webhook):
    webhook = make_webhook("github")
    transitions.rotate_webhook_secret(webhook, secret="the-new-secret-0123456789")
    assert deliver(webhook).status_code == 202  # signed with the old secret
    body = signing.body_of({**ISSUE, "action": "edited"})  # another event, not a replay
    answer = post_hook(webhook.slug, body,
                       signing.github("the-new-secret-0123456789", body))
    assert answer.status_code == 202


def test_unknown_and_inactive_webhooks_are_404(make_webhook):
    webhook = make_webhook("github")
    assert post_hook("nope", b"{}", {}).status_code == 404
    # The unknown slug is quoted back, but cut short (the caller chose it; it can be huge).
    long_slug = "n" * 5000
    answer = post_hook(long_slug, b"{}", {})
    message = answer.json()["error"]["message"]
    assert answer.status_code == 404 and "n" * 64 in message and "n" * 65 not in message
    assert len(message) < 120
    webhook.active = False
    webhook.save()
    answer = deliver(webhook)
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "unknown_webhook"
    assert nothing_written()


def test_an_inactive_owners_webhooks_are_404_until_reactivated(make_webhook):
    """Offboarding (CONTRACT §12): deactivating an operator stops their webhooks creating
    work (an unsigned one included: anyone could otherwise keep feeding it)."""
    signed, unsigned = make_webhook("github"), make_webhook("unsigned")
    owner = signed.owner
    owner.is_active = False
    owner.save()
    for webhook in (signed, unsigned):
        answer = deliver(webhook)
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "unknown_webhook"
    assert nothing_written()
    owner.is_active = True
    owner.save()
    assert deliver(signed).status_code == 202


def test_a_client_gone_mid_body_gets_nothing_run_or_written(make_webhook):
    """An unsigned webhook would accept the first half of this body as it stands (it is JSON);
    a client that hangs up before the rest must not have a truncated delivery written."""
    webhook = make_webhook("unsigned")
    assert hook_client.post(webhook.slug, chunks=[b'{"type": "ping"}'], disconnect=True) is None
    assert nothing_written()


@pytest.mark.parametrize("path", ["/hooks/a\x00b", "/hooks/café", "/hooks/a.b"])  # decoded, as daphne passes it
def test_a_path_that_cannot_be_a_slug_is_an_unknown_webhook_not_a_database_error(path, caplog):
    """Regression: a NUL in the slug reached PostgreSQL, which refuses it, and the sender got
    503 'could not store the delivery' (with an error logged) instead of 404."""
    answer = post_hook("x", b"{}", {}, path=path)
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "unknown_webhook"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert nothing_written()


OUT_OF_RANGE_BODIES = [
    b'{"action": "opened", "x": 1e400}',
    b'{"action": "opened", "x": -1e400}',
    b'{"action": "opened", "deep": {"list": [1, 2, 1.5e309]}}',
    b'{"action": "opened", "x": 1' + b"0" * 400 + b'.0}',
]
NUL_BODIES = [
    b'{"action": "opened", "issue": {"title": "a\\u0000b"}}',
    b'{"action": "opened", "k\\u0000ey": 1}',
]


@pytest.mark.parametrize("source", list(SOURCE_CASES))
@pytest.mark.parametrize("body", OUT_OF_RANGE_BODIES + NUL_BODIES)
def test_unstorable_json_is_400_naming_the_problem_for_every_source(make_webhook,
                                                                     source, body):
    """Valid JSON PostgreSQL cannot store (a number that overflows to inf, a NUL character)
    used to reach the write and fail there as 503; it is the sender's error: 400."""
    webhook = make_webhook(source)
    if source == "stripe":
        body = body.replace(b'"action"', b'"id": "evt_1", "type": "x", "action"', 1)
    meta = signing.SIGNERS[source](SECRETS[source], body) if source != "unsigned" else {}
    answer = post_hook(webhook.slug, body, meta)
    assert answer.status_code == 400, answer.content
    message = answer.json()["error"]["message"]
    assert ("out of range" in message) if b"\\u0000" not in body else ("NUL" in message)
    assert nothing_written()


@pytest.mark.parametrize("body, content_type, status", [
    (b'{"action": "opened", ', "application/json", 400),  # malformed JSON
    (b'[1, 2]', "application/json", 400),  # JSON, but not an object
    (b'{"a": NaN}', "application/json", 400),  # not JSON, though Python would accept it
    (b'{"a": "\\u0000"}', "application/json", 400),  # JSON PostgreSQL cannot store
    (b'{"a": "\\ud800"}', "application/json", 400),  # a lone surrogate
    (b'{"a": "\xff\xfe"}', "application/json", 400),  # not UTF-8
    (b'{"a": 1}', "text/plain", 415),  # wrong content type
    (b"payload=%7B%7D", "application/x-www-form-urlencoded", 415),  # form, on a JSON-only source
])
def test_bad_input_gets_its_status_and_writes_nothing(make_webhook, body, content_type,
                                                      status):
    webhook = make_webhook("stripe")
    meta = signing.stripe(SECRETS["stripe"], body)
    answer = post_hook(webhook.slug, body, meta, content_type=content_type)
    assert answer.status_code == status, answer.content
    assert answer["Content-Type"] == "application/json"
    assert answer.json()["error"]["message"]
    assert nothing_written()


@override_settings(SWITCHBOARD_MAX_BODY_BYTES=64)
@pytest.mark.parametrize("content_length", ["10", None], ids=["lying", "absent"])
def test_oversized_body_is_413_by_declared_and_by_actual_length(make_webhook, content_length):
    webhook = make_webhook("github")
    big = signing.body_of({"padding": "x" * 1000})
    meta = signing.github(SECRETS["github"], big)
    chunks = [big[i:i + 16] for i in range(0, len(big), 16)]
    answer = post_hook(webhook.slug, big, meta, chunks=chunks)
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "too_large"
    assert answer.chunks_read == 0  # refused by Content-Length before reading anything
    # A streamed body longer than its (lying or absent) Content-Length: the app cannot know
    # its size without reading, so it stops at the first chunk past the cap and answers 413.
    answer = post_hook(webhook.slug, big, {**meta, "CONTENT_LENGTH": content_length},
                       chunks=chunks)
    assert answer.status_code == 413, answer.content
    assert answer.json()["error"]["code"] == "too_large"
    assert answer.chunks_read == 5  # 80 bytes: the first read past 64, and no further
    assert nothing_written()


def test_body_cut_short_at_content_length_is_401(make_webhook):
    """The server hands the app only the declared bytes (daphne cuts the body at
    Content-Length): a prefix whose signature cannot match is 401 (never 202, never a write)."""
    webhook = make_webhook("github")
    big = signing.body_of({"padding": "x" * 100})
    answer = post_hook(webhook.slug, big[:10], signing.github(SECRETS["github"], big))
    assert answer.status_code == 401
    assert nothing_written()


@pytest.mark.parametrize("header, value", [("CONTENT_LENGTH", "ten"), ("HTTP_HOST", "evil.example")],
                         ids=["unparseable Content-Length", "Host outside ALLOWED_HOSTS"])
def test_bad_request_headers_are_400_json(make_webhook, header, value):
    webhook = make_webhook("github")
    body = signing.body_of(ISSUE)
    answer = post_hook(webhook.slug, body, {**signing.github(SECRETS["github"], body),
                                            header: value})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "bad_request"
    assert nothing_written()


def test_an_unexpected_error_is_500_json_without_the_body(make_webhook, monkeypatch, caplog):
    from ingest import senders

    def explode(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(senders, "derive_kind", explode)
    webhook = make_webhook("github")
    body = signing.body_of(ISSUE)
    answer = post_hook(webhook.slug, body, signing.github(SECRETS["github"], body))
    assert answer.status_code == 500 and answer.json()["error"]["code"] == "internal_error"
    assert "Crash on start" not in caplog.text
    assert nothing_written()


def test_the_asgi_routing_serves_hooks_with_answer_hook():
    """hook_client mirrors production: the same pattern and handler, routed in asgi.py."""
    from switchboard.http import plain
    from ingest import hook
    from switchboard import asgi

    [route] = [r for r in asgi.http_routes if r.pattern.regex.pattern == hook.HOOK_ROUTE_PATTERN]
    assert isinstance(route.callback, plain.SyncHandlerApp)
    assert route.callback.handler is hook.answer_hook


@override_settings(SWITCHBOARD_INGEST_RATE_PER_MINUTE=3)
def test_rate_limit_is_429_with_retry_after(make_webhook):
    webhook = make_webhook("github")
    statuses = [deliver(webhook, numbered_issue(n)).status_code for n in range(4)]
    assert statuses == [202, 202, 202, 429]
    answer = deliver(webhook, numbered_issue(4))
    assert answer.status_code == 429
    assert 1 <= int(answer["Retry-After"]) <= 60
    assert answer.json()["error"]["code"] == "rate_limited"
    assert Todo.objects.count() == 3
    # Per webhook: another webhook is not limited by the first one's traffic.
    other = make_webhook("gitea")
    assert deliver(other).status_code == 202


def test_get_is_405_json(make_webhook):
    webhook = make_webhook("github")
    answer = hook_client.post(webhook.slug, method="GET", content_type=None)
    assert answer.status_code == 405 and answer.json()["error"]["code"] == "method_not_allowed"
    assert answer["Allow"] == "POST"


# -- idempotency and fan-out --------------------------------------------------------------------


def test_redelivery_while_live_returns_the_same_todo(make_webhook, published):
    webhook = make_webhook("github")
    first = deliver(webhook, delivery="d-1")
    again = deliver(webhook, delivery="d-1")
    assert again.status_code == 202
    assert again.json()["todos"] == [{**first.json()["todos"][0], "duplicate": True}]
    assert again.json()["delivery"] == first.json()["delivery"]
    assert Todo.objects.count() == 1 and DeliveryEvent.objects.count() == 1


def test_one_delivery_fans_out_to_every_route(make_webhook, endpoint, other_endpoints):
    webhook = make_webhook("github", routes=[
        (endpoint, "inbox", None),
        (other_endpoints[0], "reviews", ["issues"]),
        (other_endpoints[1], "triage", ["issues.opened"]),
        (other_endpoints[1], "pushes", ["push"]),  # filtered out: wrong kind
    ])
    answer = deliver(webhook)
    placed = {(t["endpoint"], t["queue"]) for t in answer.json()["todos"]}
    assert placed == {("agent", "inbox"), ("agent-0", "reviews"), ("agent-1", "triage")}
    todos = Todo.objects.all()
    assert len(todos) == 3 and len({t.delivery_event_id for t in todos}) == 1


def test_two_routes_into_one_endpoint_make_two_todos(make_webhook, endpoint):
    webhook = make_webhook("github", routes=[(endpoint, "inbox", None), (endpoint, "reviews", None)])
    answer = deliver(webhook, delivery="d-2")
    assert sorted(t["queue"] for t in answer.json()["todos"]) == ["inbox", "reviews"]
    again = deliver(webhook, delivery="d-2")
    assert all(t["duplicate"] for t in again.json()["todos"])
    assert Todo.objects.count() == 2


def test_adding_a_route_then_redelivering_duplicates_nothing(make_webhook, endpoint):
    webhook = make_webhook("github")  # endpoint/inbox only
    first = deliver(webhook, delivery="d-live").json()["todos"][0]
    transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="reviews")
    again = deliver(webhook, delivery="d-live").json()["todos"]
    assert {t["queue"]: t["duplicate"] for t in again} == {"inbox": True, "reviews": False}
    assert [t["id"] for t in again if t["queue"] == "inbox"] == [first["id"]]
    assert Todo.objects.count() == 2


def test_delivery_to_inactive_endpoint_route_is_skipped(make_webhook, endpoint):
    endpoint.active = False
    endpoint.save()
    answer = deliver(make_webhook("github"))
    assert answer.status_code == 202 and answer.json()["todos"] == []


# -- operator API -------------------------------------------------------------------------------


@pytest.fixture
def token(operator):
    return transitions.mint_operator_token(user=operator, name="laptop")[1]


def hand(client, slug, data, **meta):
    body = data if isinstance(data, bytes) else json.dumps(data).encode()
    return client.post(f"/api/v1/endpoints/{slug}/todos", data=body,
                       content_type="application/json", **meta)


def bearer(token):
    return {"HTTP_AUTHORIZATION": f"Bearer {token}"}


def test_owner_hands_over_a_todo_with_a_token(client, endpoint, operator, token, published):
    answer = hand(client, endpoint.slug, {"queue": "inbox", "title": "Review the release notes",
                                          "payload": {"pr": 7}, "kind": "review"}, **bearer(token))
    assert answer.status_code == 201, answer.content
    data = answer.json()
    assert data["duplicate"] is False
    todo = Todo.objects.get(pk=data["todo"]["id"])
    assert (todo.trust, todo.source, todo.kind, todo.payload) == ("operator", "operator", "review",
                                                                   {"pr": 7})
    assert todo.delivery_event.trust == "operator"
    assert todo.delivery_event.attributed_to == operator
    assert data["todo"]["trust"] == "operator" and data["todo"]["endpoint"] == endpoint.slug


def test_repeated_idempotency_key_returns_the_existing_todo_and_rings_nothing(
        client, endpoint, token, django_capture_on_commit_callbacks, published):
    data = {"queue": "inbox", "title": "once", "idempotency_key": "k-1",
            "secrets": {"api_key": "s3cr3t-value"}}
    with django_capture_on_commit_callbacks(execute=True):
        first = hand(client, endpoint.slug, data, **bearer(token))
    assert [c["action"] for c in published] == ["create"]
    with django_capture_on_commit_callbacks(execute=True):
        again = hand(client, endpoint.slug, data, **bearer(token))
    assert again.status_code == 200 and again.json()["duplicate"] is True
    assert again.json()["todo"]["id"] == first.json()["todo"]["id"]
    assert [c["action"] for c in published] == ["create"]  # nothing rung the second time
    assert (Todo.objects.count(), DeliveryEvent.objects.count(), OperatorSecret.objects.count()) == (1, 1, 1)


def test_secrets_are_stored_apart_and_never_shown(client, endpoint, token, caplog,
                                                  django_capture_on_commit_callbacks, published):
    with caplog.at_level(logging.DEBUG), django_capture_on_commit_callbacks(execute=True):
        answer = hand(client, endpoint.slug, {
            "queue": "inbox", "title": "deploy", "payload": {"env": "prod"},
            "secrets": {"deploy_token": "tok-very-secret-123"}}, **bearer(token))
    assert answer.status_code == 201
    todo = Todo.objects.get()
    ref = todo.payload["secrets"]["deploy_token"]["$secret"]
    assert ref.startswith("sec_")
    stored = OperatorSecret.objects.get(ref=ref)
    assert b"tok-very-secret-123" not in bytes(stored.ciphertext)
    assert stored.unseal() == "tok-very-secret-123"
    for surface in [answer.content.decode(), json.dumps(todo.payload), json.dumps(published),
                    logged(caplog)]:
        assert "tok-very-secret-123" not in surface


def test_board_todo_page_shows_secret_refs_never_values(client, endpoint, operator, token):
    """§5/§9: a todo handed over with secrets shows the refs on its board page (and on the
    board list, and in its claimed state), never a secret value."""
    from django.urls import reverse

    from todos import transitions as todo_transitions

    answer = hand(client, endpoint.slug, {
        "queue": "inbox", "title": "rotate the key", "payload": {"env": "prod"},
        "secrets": {"deploy_token": "tok-very-secret-123", "db_password": "pw-hunter2-xyz"}},
        **bearer(token))
    assert answer.status_code == 201, answer.content
    todo = Todo.objects.get()
    refs = {name: value["$secret"] for name, value in todo.payload["secrets"].items()}
    board = Client()
    board.force_login(operator)

    def pages():
        return [board.get(reverse("todos-detail", args=[todo.pk])),
                board.get("/todos/"), board.get("/todos/rows")]

    detail = pages()[0]
    assert detail.status_code == 200
    html = detail.content.decode()
    for ref in refs.values():
        assert ref in html  # the ref is shown, as-is
    todo_transitions.claim_todo(todo_transitions.Caller.operator(endpoint, operator.username),
                                todo.pk)
    for page in pages():
        assert page.status_code == 200
        for value in ("tok-very-secret-123", "pw-hunter2-xyz"):
            assert value not in page.content.decode()


def test_session_operator_needs_csrf_and_token_operator_does_not(endpoint, operator, token):
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(operator)
    data = {"queue": "inbox", "title": "from the browser"}
    refused = hand(browser, endpoint.slug, data)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "csrf_failed"
    browser.get("/admin/login/")  # sets the CSRF cookie
    csrf = browser.cookies["csrftoken"].value
    assert hand(browser, endpoint.slug, data, HTTP_X_CSRFTOKEN=csrf).status_code == 201
    scripted = Client(enforce_csrf_checks=True)
    assert hand(scripted, endpoint.slug, {**data, "title": "scripted"}, **bearer(token)).status_code == 201


def test_another_operator_cannot_hand_over_to_my_endpoint(client, endpoint):
    mallory = UserFactory(username="mallory")
    mallory_token = transitions.mint_operator_token(user=mallory)[1]
    EndpointFactory(slug="mallorys", owner=mallory)
    answer = hand(client, endpoint.slug, {"queue": "inbox", "title": "x"}, **bearer(mallory_token))
    assert answer.status_code == 404
    assert nothing_written()


def test_missing_bad_and_revoked_tokens_are_401(client, endpoint, operator, token):
    data = {"queue": "inbox", "title": "x"}
    assert hand(client, endpoint.slug, data).status_code == 401
    assert hand(client, endpoint.slug, data, **bearer("sbo_nope")).status_code == 401
    transitions.revoke_operator_tokens(operator.operator_tokens.all())
    answer = hand(client, endpoint.slug, data, **bearer(token))
    assert answer.status_code == 401 and "WWW-Authenticate" in answer
    assert nothing_written()


@pytest.mark.parametrize("data, status", [
    ({"title": "no queue"}, 400),
    ({"queue": "inbox"}, 400),
    ({"queue": "bad queue!", "title": "x"}, 400),
    ({"queue": "inbox", "title": "x", "payload": [1]}, 400),
    ({"queue": "inbox", "title": "x", "secrets": {"a": 1}}, 400),
    ({"queue": "inbox", "title": "x", "surprise": 1}, 400),
    (b"not json", 400),
])
def test_operator_api_bad_input(client, endpoint, token, data, status):
    answer = hand(client, endpoint.slug, data, **bearer(token))
    assert answer.status_code == status and answer.json()["error"]["message"]
    assert nothing_written()


@pytest.mark.parametrize("data, problem", [
    (b'{"queue": "inbox", "title": "x", "payload": {"n": 1e400}}', "out of range"),
    (b'{"queue": "inbox", "title": "x", "payload": {"n": [-1e999]}}', "out of range"),
    (b'{"queue": "inbox", "title": "x\\u0000y"}', "NUL"),
    (b'{"queue": "inbox", "title": "x", "payload": {"a\\u0000": "b"}}', "NUL"),
    (b'{"queue": "inbox", "title": "x", "payload": {"a": "b\\u0000"}}', "NUL"),
    (b'{"queue": "inbox", "title": "x", "secrets": {"s": "v\\u0000"}}', "NUL"),
])
def test_operator_api_unstorable_json_is_400(client, endpoint, token, data, problem):
    answer = hand(client, endpoint.slug, data, **bearer(token))
    assert answer.status_code == 400, answer.content
    assert problem in answer.json()["error"]["message"]
    assert nothing_written() and OperatorSecret.objects.count() == 0


@pytest.mark.parametrize("kind", ["--dangerously-skip-permissions", "-x", "_deploy", "‹deploy›"])
def test_operator_api_refuses_a_kind_that_does_not_start_with_a_letter_or_digit(
        client, endpoint, token, kind):
    """A kind is an event name wherever it comes from: one starting with "-" would read as an
    option where an agent's prompt starts with it (docs/runner.md)."""
    answer = hand(client, endpoint.slug, {"queue": "inbox", "title": "x", "kind": kind},
                  **bearer(token))
    assert answer.status_code == 400, answer.content
    error = answer.json()["error"]
    assert error["code"] == "invalid_argument" and error["message"].startswith("kind"), error
    assert nothing_written()
    taken = hand(client, endpoint.slug, {"queue": "inbox", "title": "x", "kind": "deploy request"},
                 **bearer(token))
    assert taken.status_code == 201, taken.content


OPERATOR_FIELDS_WITH_TEXT = {
    "queue": '"queue": "in{bad}box", "title": "x"',
    "title": '"queue": "inbox", "title": "x{bad}y"',
    "kind": '"queue": "inbox", "title": "x", "kind": "re{bad}view"',
    "idempotency_key": '"queue": "inbox", "title": "x", "idempotency_key": "k{bad}"',
    "payload": '"queue": "inbox", "title": "x", "payload": {{"a": ["b{bad}"]}}',
    "secrets": '"queue": "inbox", "title": "x", "secrets": {{"s{bad}": "v"}}',
}


@pytest.mark.parametrize("bad", ["\\u0000", "\\ud800"])
@pytest.mark.parametrize("field", sorted(OPERATOR_FIELDS_WITH_TEXT))
def test_operator_api_refuses_nul_or_a_lone_surrogate_naming_the_field(
        client, endpoint, token, field, bad):
    body = ("{" + OPERATOR_FIELDS_WITH_TEXT[field].format(bad=bad) + "}").encode()
    answer = hand(client, endpoint.slug, body, **bearer(token))
    assert answer.status_code == 400, answer.content
    error = answer.json()["error"]
    assert error["code"] == "invalid_argument" and error["message"].startswith(field), error
    assert nothing_written() and OperatorSecret.objects.count() == 0


@pytest.mark.parametrize("slug", ["agent%00", "a%00b"])
def test_a_nul_in_the_operator_api_slug_is_a_400_not_a_false_503(client, endpoint, token, slug):
    answer = hand(client, slug, {"queue": "inbox", "title": "x"}, **bearer(token))
    assert answer.status_code == 400, answer.content
    error = answer.json()["error"]
    assert error["code"] == "invalid_argument" and "endpoint slug" in error["message"]
    assert nothing_written()


def test_broken_utf_8_in_the_operator_api_slug_is_an_unknown_endpoint(client, endpoint, token):
    # Django keeps undecodable path bytes percent-encoded: no such slug, and no 5xx.
    answer = hand(client, "agent%ED%A0%80", {"queue": "inbox", "title": "x"}, **bearer(token))
    assert answer.status_code == 404, answer.content
    assert nothing_written()


def test_unknown_endpoint_slug_is_echoed_cut_short(client, token):
    answer = hand(client, "e" * 3000, {"queue": "inbox", "title": "x"}, **bearer(token))
    message = answer.json()["error"]["message"]
    assert answer.status_code == 404 and "e" * 64 in message and "e" * 65 not in message


def test_operator_api_queue_outside_scope_is_400(client, operator, token):
    narrow = EndpointFactory(slug="narrow", owner=operator, scope=["inbox"])
    answer = hand(client, narrow.slug, {"queue": "reviews", "title": "x"}, **bearer(token))
    assert answer.status_code == 400 and "scope" in answer.json()["error"]["message"]


def test_delivery_query_count_is_pinned(make_webhook, endpoint, other_endpoints,
                                        django_assert_num_queries):
    """The hot path: one read (routes + webhook + endpoints), then savepoint, the delivery
    event (with its replay-ledger entry and delivery-log record in the same statement on
    PostgreSQL), one INSERT … RETURNING per route (its todo event rides in the same statement
    on PostgreSQL; SQLite needs a second statement per todo, two more for the ledger and the
    log, and pins its own count). With one route, PostgreSQL writes everything in ONE
    statement (here inside a savepoint, the test's transaction being open; the statement
    alone in production: test_one_route_delivery_is_two_statements_in_autocommit)."""
    from django.db import connection

    # SQLite: each todo is its own SAVEPOINT, INSERT, event INSERT, RELEASE (4 per route).
    postgres = connection.vendor == "postgresql"
    one_route = make_webhook("github")
    with django_assert_num_queries(4 if postgres else 10):
        assert deliver(one_route).status_code == 202
    three_routes = make_webhook("gitea", routes=[(endpoint, "inbox", None),
                                                 (other_endpoints[0], "inbox", None),
                                                 (other_endpoints[1], "inbox", None)])
    with django_assert_num_queries(7 if postgres else 18):
        assert deliver(three_routes).status_code == 202


@override_settings(SWITCHBOARD_UNKNOWN_CLIENT_PER_MINUTE=3)
def test_an_address_out_of_its_unknown_slug_budget_is_refused_before_any_query(
        django_assert_num_queries):
    statuses = [post_hook(f"nope-{n}", b"{}", {}).status_code for n in range(4)]
    assert statuses == [404, 404, 404, 429]
    with django_assert_num_queries(0):
        blocked = post_hook("nope-again", b"{}", {})
    assert blocked.status_code == 429 and int(blocked["Retry-After"]) >= 1
    assert blocked.json()["error"]["code"] == "rate_limited"


@override_settings(SWITCHBOARD_UNKNOWN_CLIENT_PER_MINUTE=3)
def test_a_blocked_address_still_reaches_a_webhook_this_process_has_served(make_webhook):
    # A sender's shared egress address (a CI fleet, GitHub itself) may be spent by someone
    # else's typos: the webhooks it really delivers to keep working, as bearers do on /mcp.
    webhook = make_webhook("github")
    assert deliver(webhook, numbered_issue(1)).status_code == 202
    for n in range(4):
        post_hook(f"nope-{n}", b"{}", {})
    assert post_hook("nope-again", b"{}", {}).status_code == 429
    assert deliver(webhook, numbered_issue(2)).status_code == 202
