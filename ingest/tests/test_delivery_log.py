"""The delivery log (CONTRACT §14; issue 16 item 2): every request naming an existing webhook is
recorded with its outcome — never its body or a secret header — through the real ASGI app;
refused ones are capped per webhook per minute with a dropped count; an operator redelivers an
accepted one."""

import json
import time
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from channels.testing import ApplicationCommunicator
from django.core.management import call_command
from django.test import Client, override_settings
from django.utils import timezone

from ingest import sweeps, transitions
from ingest.models import DeliveryDrops, DeliveryRecord, Outcome, TrustMode
from tests.factories import UserFactory
from todos.models import Todo

from . import hook_client, signing
from .conftest import SECRETS
from .test_views import ISSUE, numbered_issue, post_hook

pytestmark = pytest.mark.django_db


def signed(source, payload, **signer):
    body = signing.body_of(payload)
    return body, signing.SIGNERS[source](SECRETS[source], body, **signer)


def only_record(webhook) -> DeliveryRecord:
    (record,) = DeliveryRecord.objects.filter(webhook=webhook)
    return record


# -- one test per outcome ------------------------------------------------------------------------


def test_accepted_records_what_was_claimed_and_links_its_todos(make_webhook):
    webhook = make_webhook("github")
    body, meta = signed("github", ISSUE, delivery="gh-1")
    answer = post_hook(webhook.slug, body, meta)
    assert answer.status_code == 202
    record = only_record(webhook)
    assert (record.outcome, record.status, record.delivery_id, record.kind, record.size) == (
        "accepted", 202, "gh-1", "issues.opened", len(body))
    assert record.body_sha256 == transitions.body_digest(body)
    assert record.source_address == "127.0.0.1"
    assert record.delivery_event_id == int(answer.json()["delivery"])
    (todo,) = Todo.objects.filter(delivery_event_id=record.delivery_event_id)
    assert str(todo.pk) == answer.json()["todos"][0]["id"]
    # Never the body or a secret header: no column holds the title, the signature or secret.
    stored = json.dumps(list(DeliveryRecord.objects.values()), default=str)
    assert "Crash on start" not in stored and SECRETS["github"] not in stored
    assert meta["HTTP_X_HUB_SIGNATURE_256"].split("=", 1)[1] not in stored


def test_duplicate_names_the_live_todo(make_webhook):
    webhook = make_webhook("github")
    body, meta = signed("github", ISSUE, delivery="gh-1")
    first = post_hook(webhook.slug, body, meta).json()
    assert post_hook(webhook.slug, body, meta).status_code == 202
    record = DeliveryRecord.objects.get(outcome="duplicate")
    assert (record.status, record.delivery_id) == (202, "gh-1")
    assert record.todo_ids == [first["todos"][0]["id"]]


def test_replay_is_409(make_webhook):
    webhook = make_webhook("github")
    body, meta = signed("github", ISSUE, delivery="gh-1")
    post_hook(webhook.slug, body, meta)
    assert post_hook(webhook.slug, body, {**meta, "HTTP_X_GITHUB_DELIVERY": "gh-2"}).status_code == 409
    record = DeliveryRecord.objects.get(outcome="replay")
    assert (record.status, record.delivery_id) == (409, "gh-2")


def test_bad_signature_is_401(make_webhook):
    webhook = make_webhook("github")
    body, meta = signed("github", ISSUE, delivery="gh-1")
    meta["HTTP_X_HUB_SIGNATURE_256"] = "sha256=" + "0" * 64
    assert post_hook(webhook.slug, body, meta).status_code == 401
    record = only_record(webhook)
    assert (record.outcome, record.status, record.delivery_id, record.kind) == (
        "bad_signature", 401, "gh-1", "issues")
    assert record.reason == "delivery not verified: signature mismatch"


def test_stale_timestamp_is_401(make_webhook):
    webhook = make_webhook("stripe")
    body, meta = signed("stripe", {"id": "evt_1", "type": "invoice.paid"},
                        timestamp=int(time.time()) - 3600)
    assert post_hook(webhook.slug, body, meta).status_code == 401
    assert (only_record(webhook).outcome, only_record(webhook).status) == ("stale_timestamp", 401)


def test_malformed_is_400(make_webhook):
    webhook = make_webhook("github")
    body, meta = signed("github", b"{not json")
    assert post_hook(webhook.slug, body, meta).status_code == 400
    assert (only_record(webhook).outcome, only_record(webhook).status) == ("malformed", 400)


def test_too_large_is_413(make_webhook, settings):
    settings.SWITCHBOARD_MAX_BODY_BYTES = 100
    webhook = make_webhook("github")
    body, meta = signed("github", {**ISSUE, "pad": "x" * 200})
    assert post_hook(webhook.slug, body, meta).status_code == 413
    record = only_record(webhook)
    assert (record.outcome, record.status, record.size) == ("too_large", 413, len(body))


def test_unsupported_type_is_415(make_webhook):
    webhook = make_webhook("github")
    body, meta = signed("github", ISSUE)
    assert post_hook(webhook.slug, body, meta, content_type="text/plain").status_code == 415
    assert (only_record(webhook).outcome, only_record(webhook).status) == ("unsupported_type", 415)


@override_settings(SWITCHBOARD_INGEST_RATE_PER_MINUTE=1)
def test_rate_limited_is_429(make_webhook):
    webhook = make_webhook("github")
    for n in range(2):
        body, meta = signed("github", numbered_issue(n))
        status = post_hook(webhook.slug, body, meta).status_code
    assert status == 429
    record = DeliveryRecord.objects.get(outcome="rate_limited")
    assert record.status == 429


def test_no_route_is_202_without_todos(make_webhook):
    webhook = make_webhook("github", routes=[])
    body, meta = signed("github", ISSUE)
    answer = post_hook(webhook.slug, body, meta)
    assert answer.status_code == 202 and answer.json()["todos"] == []
    assert (only_record(webhook).outcome, only_record(webhook).status) == ("no_route", 202)


def test_filtered_is_202_without_todos(make_webhook, endpoint):
    webhook = make_webhook("github", routes=[])
    transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="inbox",
                                  actors_allowed=["maintainer"])
    body, meta = signed("github", {**ISSUE, "sender": {"login": "someone-else"}})
    answer = post_hook(webhook.slug, body, meta)
    assert answer.status_code == 202 and answer.json()["todos"] == []
    assert (only_record(webhook).outcome, only_record(webhook).status) == ("filtered", 202)
    assert "someone-else" in only_record(webhook).reason


def test_coalesced_is_202_naming_the_live_todo(make_webhook, endpoint):
    webhook = make_webhook("github", routes=[])
    transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="inbox",
                                  follow_ups="skip")
    assert post_hook(webhook.slug, *signed("github", ISSUE)).status_code == 202
    answer = post_hook(webhook.slug, *signed("github", {**ISSUE, "action": "edited"}))
    assert answer.status_code == 202 and answer.json()["todos"] == []
    record = DeliveryRecord.objects.filter(webhook=webhook).latest("id")
    todo = Todo.objects.get()
    assert (record.outcome, record.status, record.todo_ids) == ("coalesced", 202, [str(todo.pk)])


def test_stopped_names_the_todos_it_stopped(make_webhook):
    webhook = make_webhook("github")
    assert post_hook(webhook.slug, *signed("github", ISSUE)).status_code == 202
    answer = post_hook(webhook.slug, *signed("github", {**ISSUE, "action": "closed"}))
    todo = Todo.objects.get()
    assert answer.status_code == 202 and answer.json()["stopped"] == [str(todo.pk)]
    record = DeliveryRecord.objects.filter(webhook=webhook).latest("id")
    assert (record.outcome, record.todo_ids) == ("stopped", [str(todo.pk)])


def test_every_outcome_has_a_test_here():
    names = {name.removeprefix("test_").split("_is_")[0].split("_records")[0]
             .split("_names")[0] for name in globals() if name.startswith("test_")}
    assert set(Outcome.values) <= names


def test_unknown_slugs_are_not_recorded(make_webhook):
    make_webhook("github")
    assert post_hook("nope", b"{}", {}).status_code == 404
    assert DeliveryRecord.objects.count() == 0


# -- the cap -------------------------------------------------------------------------------------


def flood(slug: str, requests: int, body: bytes, headers: dict) -> list[int]:
    """``requests`` POSTs through the real ASGI app in one event loop (fast), statuses back."""
    raw = [(b"host", b"localhost"), (b"content-type", b"application/json"),
           (b"content-length", str(len(body)).encode())]
    raw += [(name.encode(), value.encode()) for name, value in headers.items()]
    scope = {"type": "http", "http_version": "1.1", "method": "POST", "path": f"/hooks/{slug}",
             "raw_path": f"/hooks/{slug}".encode(), "query_string": b"", "scheme": "http",
             "server": ("localhost", 80), "client": ("203.0.113.9", 40000), "headers": raw}

    async def run():
        statuses = []
        for _ in range(requests):
            communicator = ApplicationCommunicator(hook_client.application, dict(scope))
            await communicator.send_input({"type": "http.request", "body": body})
            start = await communicator.receive_output(30)
            await communicator.receive_output(30)
            statuses.append(start["status"])
        return statuses

    return async_to_sync(run)()


@override_settings(SWITCHBOARD_DELIVERY_LOG_REFUSED_PER_MINUTE=60)
def test_a_flood_of_bad_signatures_writes_at_most_the_cap_plus_per_minute_counts(make_webhook):
    webhook = make_webhook("github")
    body = signing.body_of(ISSUE)
    started = timezone.now()
    statuses = flood(webhook.slug, 10_000, body, {
        "x-hub-signature-256": "sha256=" + "0" * 64, "x-github-event": "issues",
        "x-github-delivery": "forged"})
    finished = timezone.now()
    assert set(statuses) <= {401, 429} and len(statuses) == 10_000
    minutes = int(finished.timestamp() // 60) - int(started.timestamp() // 60) + 1
    recorded = DeliveryRecord.objects.filter(webhook=webhook).count()
    assert recorded <= 60 * minutes
    assert sweeps.fold_dropped_delivery_counts() == DeliveryDrops.objects.count() <= minutes
    dropped = sum(DeliveryDrops.objects.values_list("dropped", flat=True))
    assert recorded + dropped == 10_000
    assert sweeps.fold_dropped_delivery_counts() == DeliveryDrops.objects.count()  # idempotent
    assert sum(DeliveryDrops.objects.values_list("dropped", flat=True)) == dropped


def test_a_failing_log_write_never_fails_the_answer(make_webhook, monkeypatch):
    webhook = make_webhook("github")

    def broken(*args, **kwargs):
        raise RuntimeError("log storage is broken")

    monkeypatch.setattr(DeliveryRecord.objects, "create", broken)
    body, meta = signed("github", ISSUE)
    meta["HTTP_X_HUB_SIGNATURE_256"] = "sha256=" + "0" * 64
    assert post_hook(webhook.slug, body, meta).status_code == 401


# -- the command ---------------------------------------------------------------------------------


def test_deliveries_command_prints_the_contract_shape(make_webhook, capsys):
    webhook = make_webhook("github")
    body, meta = signed("github", ISSUE, delivery="gh-1")
    todo_id = post_hook(webhook.slug, body, meta).json()["todos"][0]["id"]
    meta["HTTP_X_HUB_SIGNATURE_256"] = "sha256=" + "0" * 64
    post_hook(webhook.slug, body, meta)
    call_command("deliveries", webhook.slug, "--json")
    data = json.loads(capsys.readouterr().out)
    assert [set(row) >= {"id", "at", "outcome", "status", "delivery_id", "kind", "size", "todos"}
            for row in data["deliveries"]] == [True, True]
    assert [(r["outcome"], r["todos"]) for r in data["deliveries"]] == [
        ("bad_signature", []), ("accepted", [todo_id])]
    call_command("deliveries", webhook.slug, "--outcome", "accepted", "--limit", "5", "--json")
    assert [r["outcome"] for r in json.loads(capsys.readouterr().out)["deliveries"]] == ["accepted"]


# -- the page and redelivery ----------------------------------------------------------------------


@pytest.fixture
def signed_in(operator):
    operator.set_password("pw")
    operator.save()
    client = Client()
    client.force_login(operator)
    return client


def test_the_webhook_page_shows_routes_and_deliveries_filtered_by_outcome(make_webhook, signed_in):
    webhook = make_webhook("github")
    body, meta = signed("github", ISSUE, delivery="gh-ok")
    post_hook(webhook.slug, body, meta)
    meta = {**meta, "HTTP_X_HUB_SIGNATURE_256": "sha256=" + "0" * 64,
            "HTTP_X_GITHUB_DELIVERY": "gh-bad"}
    post_hook(webhook.slug, body, meta)
    page = signed_in.get(f"/todos/webhooks/{webhook.slug}/").content.decode()
    assert f"/hooks/{webhook.slug}" in page and "agent/inbox" in page
    assert "gh-ok" in page and "gh-bad" in page and 'outcome-bad_signature' in page
    rows = signed_in.get(f"/todos/webhooks/{webhook.slug}/rows?outcome=accepted").content.decode()
    assert "gh-ok" in rows and "gh-bad" not in rows
    assert f"/todos/webhooks/{webhook.slug}/" in signed_in.get("/todos/webhooks/").content.decode()
    assert "/todos/webhooks/" in signed_in.get("/todos/").content.decode()  # linked from the board


def test_another_operators_webhook_page_is_404(make_webhook):
    webhook = make_webhook("github")
    mallory = UserFactory(username="mallory")
    client = Client()
    client.force_login(mallory)
    assert client.get(f"/todos/webhooks/{webhook.slug}/").status_code == 404
    assert client.get(f"/todos/webhooks/{webhook.slug}/rows").status_code == 404


def test_redelivery_creates_new_todos_of_the_originals_trust_and_the_log_links_both(
        make_webhook, signed_in, operator, endpoint):
    webhook = make_webhook("github")
    body, meta = signed("github", ISSUE, delivery="gh-1")
    first = post_hook(webhook.slug, body, meta).json()
    original = only_record(webhook)
    answer = signed_in.post(f"/todos/webhooks/{webhook.slug}/deliveries/{original.pk}/redeliver")
    assert answer.status_code == 302
    again = DeliveryRecord.objects.exclude(pk=original.pk).get()
    assert (again.outcome, again.redelivered_from_id, again.attributed_to_id) == (
        "accepted", original.pk, operator.pk)
    (todo,) = Todo.objects.filter(delivery_event_id=again.delivery_event_id)
    assert str(todo.pk) != first["todos"][0]["id"]
    assert todo.trust == TrustMode.SIGNED and todo.payload == ISSUE
    assert todo.delivery_event.trust == TrustMode.SIGNED
    assert todo.delivery_event.attributed_to_id == operator.pk
    assert todo.idempotency_key != Todo.objects.get(pk=first["todos"][0]["id"]).idempotency_key
    rows = signed_in.get(f"/todos/webhooks/{webhook.slug}/rows").content.decode()
    assert f'redelivered from <a href="#delivery-{original.pk}">#{original.pk}</a>' in rows
    assert f'redelivered as <a href="#delivery-{again.pk}">#{again.pk}</a>' in rows
    assert f"/todos/{todo.pk}/" in rows and f"/todos/{first['todos'][0]['id']}/" in rows
    # Only accepted deliveries can be re-sent, and only by their webhook's owner.
    meta["HTTP_X_HUB_SIGNATURE_256"] = "sha256=" + "0" * 64
    post_hook(webhook.slug, body, meta)
    refused = DeliveryRecord.objects.get(outcome="bad_signature")
    signed_in.post(f"/todos/webhooks/{webhook.slug}/deliveries/{refused.pk}/redeliver")
    assert Todo.objects.count() == 2
    mallory = Client()
    mallory.force_login(UserFactory(username="mallory"))
    assert mallory.post(f"/todos/webhooks/{webhook.slug}/deliveries/{original.pk}/redeliver"
                        ).status_code == 404


def test_redelivering_an_unsigned_delivery_keeps_it_unverified_hidden_and_unrung(
        make_webhook, signed_in, operator, endpoint, published):
    from todos import transitions as todo_transitions

    endpoint.accept_unverified = False
    endpoint.save(update_fields=["accept_unverified"])
    webhook = make_webhook("unsigned")
    assert post_hook(webhook.slug, signing.body_of(ISSUE), {}).status_code == 202
    original = only_record(webhook)
    answer = signed_in.post(f"/todos/webhooks/{webhook.slug}/deliveries/{original.pk}/redeliver")
    assert answer.status_code == 302
    again = DeliveryRecord.objects.exclude(pk=original.pk).get()
    # The operator is named as the one who re-sent it; the trust is still the sender's.
    assert (again.outcome, again.attributed_to_id) == ("accepted", operator.pk)
    (todo,) = Todo.objects.filter(delivery_event_id=again.delivery_event_id)
    assert todo.trust == TrustMode.UNVERIFIED
    assert todo.delivery_event.trust == TrustMode.UNVERIFIED
    assert todo.delivery_event.attributed_to_id == operator.pk
    # accept_unverified off: the agent gets neither the original nor the redelivery.
    agent = todo_transitions.Caller.agent(endpoint, "session-a")
    assert todo_transitions.claim_next_todo(agent) is None
    # And it is never pushed to an agent: doorbells ring only verified or operator work.
    from channels_push.doorbells import doorbells
    assert not doorbells.is_push_eligible(todo.trust, todo.delivery_event.attributed_to_id)


def test_the_admin_shows_the_delivery_log_read_only(make_webhook, admin_client):
    webhook = make_webhook("github")
    body, meta = signed("github", ISSUE, delivery="gh-1")
    post_hook(webhook.slug, body, meta)
    page = admin_client.get("/admin/ingest/deliveryrecord/")
    assert page.status_code == 200 and "gh-1" in page.content.decode()
    record = only_record(webhook)
    assert admin_client.post(f"/admin/ingest/deliveryrecord/{record.pk}/change/",
                             {"outcome": "replay"}).status_code == 403
    assert only_record(webhook).outcome == "accepted"


def test_only_the_owner_or_a_superuser_may_watch_a_webhooks_live_log(make_webhook, operator):
    from console import webhooks as views

    webhook = make_webhook("github")
    assert views.delivery_stream_group(operator, {"slug": webhook.slug}) == (
        transitions.deliveries_group(webhook.pk))
    assert views.delivery_stream_group(UserFactory(username="mallory"), {"slug": webhook.slug}) is None
    boss = UserFactory(username="boss", is_superuser=True)
    assert views.delivery_stream_group(boss, {"slug": webhook.slug}) is not None


def test_the_retention_prune_leaves_the_log_readable(make_webhook, endpoint, settings):
    from todos import transitions as todo_transitions

    # The log outlives the todos it names (its own window is longer here).
    settings.SWITCHBOARD_RETAIN_DELIVERY_LOG = timedelta(days=1000)
    webhook = make_webhook("github")
    body, meta = signed("github", ISSUE, delivery="gh-1")
    todo_id = int(post_hook(webhook.slug, body, meta).json()["todos"][0]["id"])
    agent = todo_transitions.Caller.agent(endpoint, "session-a")
    todo_transitions.claim_todo(agent, todo_id)
    todo_transitions.complete_todo(agent, todo_id)
    pruned = sweeps.prune_history(now=timezone.now() + timedelta(days=400), pause_seconds=0)
    assert pruned["done_todos"] == 1 and pruned["delivery_events"] == 1
    (record,) = DeliveryRecord.objects.all()
    assert record.outcome == "accepted"
    call_command("deliveries", webhook.slug, "--json")  # still printable, its todos gone
