"""The webhook page's sender setup and public-URL warning, a delivery's own page (headers as
received, never a signature or token), and add_webhook refusing to mint for senders that mint
their own secret."""

import json

import pytest
from django.core.management import CommandError, call_command
from django.test import Client, override_settings

from ingest import sender_setup, transitions
from ingest.models import DeliveryRecord, Source
from tests.factories import UserFactory

from ingest.tests import signing
from ingest.tests.conftest import SECRETS
from ingest.tests.test_views import ISSUE, post_hook

pytestmark = pytest.mark.django_db

SNEAKY = {
    "HTTP_AUTHORIZATION": "Bearer sb-very-secret-bearer",
    "HTTP_COOKIE": "sessionid=cookie-secret-value",
    "HTTP_X_CUSTOM_TOKEN": "custom-token-secret-value",
    "HTTP_X_VENDOR_SECRET": "vendor-secret-value",
    "HTTP_USER_AGENT": "GitHub-Hookshot/abc123",
}


@pytest.fixture
def owner_client(operator):
    browser = Client()
    browser.force_login(operator)
    return browser


def deliver_signed(webhook, **extra):
    body = signing.body_of(ISSUE)
    meta = {**signing.github(SECRETS["github"], body, delivery="gh-77"), **extra}
    return body, meta, post_hook(webhook.slug, body, meta)


def test_safe_headers_drop_every_signature_token_and_secret_header():
    kept = transitions.safe_headers({
        "x-hub-signature-256": "sha256=ab", "x-gitlab-token": "t", "stripe-signature": "t=1",
        "webhook-signature": "v1,x", "linear-signature": "x", "x-slack-signature": "v0=x",
        "sentry-hook-signature": "x", "x-gitea-signature": "x", "x-forgejo-signature": "x",
        "authorization": "Bearer x", "proxy-authorization": "Basic x", "cookie": "a=b",
        "x-my-token": "x", "x-api-key": "x", "x-client-secret": "x", "x-auth-session": "x",
        "content-type": "application/json", "x-github-event": "issues",
        "x-slack-request-timestamp": "1", "user-agent": "ua\x00\x1b[31m",
    })
    assert kept == {"content-type": "application/json", "x-github-event": "issues",
                    "x-slack-request-timestamp": "1", "user-agent": "ua[31m"}


def test_safe_headers_are_capped_in_count_and_length():
    kept = transitions.safe_headers({f"x-h{i}": "v" * 1000 for i in range(100)})
    assert len(kept) == transitions.SAFE_HEADERS_MAX
    assert all(len(value) == transitions.SAFE_HEADER_VALUE_MAX_CHARS for value in kept.values())


def test_an_arrival_keeps_its_headers_less_the_secret_ones(make_webhook):
    webhook = make_webhook("github")
    _, meta, answer = deliver_signed(webhook, **SNEAKY)
    assert answer.status_code == 202
    record = DeliveryRecord.objects.get(webhook=webhook)
    assert record.headers["x-github-event"] == "issues"
    assert record.headers["x-github-delivery"] == "gh-77"
    assert record.headers["user-agent"] == "GitHub-Hookshot/abc123"
    stored = json.dumps(record.headers)
    for secret in (meta["HTTP_X_HUB_SIGNATURE_256"], "sb-very-secret-bearer", "cookie-secret",
                   "custom-token-secret", "vendor-secret"):
        assert secret not in stored


def test_a_refused_arrival_keeps_its_headers_too(make_webhook):
    webhook = make_webhook("github")
    body = signing.body_of(ISSUE)
    meta = signing.github("not-the-secret", body, delivery="gh-bad")
    assert post_hook(webhook.slug, body, meta).status_code == 401
    record = DeliveryRecord.objects.get(webhook=webhook)
    assert record.outcome == "bad_signature"
    assert record.headers["x-github-delivery"] == "gh-bad"
    assert "x-hub-signature-256" not in record.headers


def test_the_delivery_page_shows_headers_verification_and_todos_never_signatures(
        make_webhook, owner_client):
    webhook = make_webhook("github")
    _, meta, answer = deliver_signed(webhook, **SNEAKY)
    record = DeliveryRecord.objects.get(webhook=webhook)
    listing = owner_client.get(f"/todos/webhooks/{webhook.slug}/").content.decode()
    url = f"/todos/webhooks/{webhook.slug}/deliveries/{record.pk}/"
    assert f'href="{url}"' in listing
    page = owner_client.get(url).content.decode()
    assert "signature verified" in page
    assert "<code>x-github-event</code>" in page and "GitHub-Hookshot/abc123" in page
    todo_id = answer.json()["todos"][0]["id"]
    assert f'href="/todos/{todo_id}/"' in page
    signature = meta["HTTP_X_HUB_SIGNATURE_256"]
    for secret in (signature, signature.split("=", 1)[1], "sb-very-secret-bearer",
                   "cookie-secret-value", SECRETS["github"]):
        assert secret not in page
    assert "x-hub-signature-256</code>" not in page


def test_a_refused_delivery_says_why(make_webhook, owner_client):
    webhook = make_webhook("github")
    body = signing.body_of(ISSUE)
    post_hook(webhook.slug, body, signing.github("not-the-secret", body))
    record = DeliveryRecord.objects.get(webhook=webhook)
    page = owner_client.get(f"/todos/webhooks/{webhook.slug}/deliveries/{record.pk}/")
    assert "refused: bad_signature" in page.content.decode()


def test_another_operators_delivery_is_404(make_webhook):
    webhook = make_webhook("github")
    deliver_signed(webhook)
    record = DeliveryRecord.objects.get(webhook=webhook)
    bob = Client()
    bob.force_login(UserFactory(username="bob"))
    assert bob.get(f"/todos/webhooks/{webhook.slug}/deliveries/{record.pk}/").status_code == 404
    other = make_webhook("gitlab", routes=[])
    mine = Client()
    mine.force_login(webhook.owner)
    assert mine.get(f"/todos/webhooks/{other.slug}/deliveries/{record.pk}/").status_code == 404


@pytest.mark.parametrize("source, must_say", [
    ("github", ["Payload URL: http", "Content type: application/json", "Recent deliveries",
                "Which events"]),
    ("gitlab", ["Secret token", "X-Gitlab-Token"]),
    ("stripe", ["whsec_", "stripe listen --forward-to http", "signing secret"]),
    ("standard", ["webhook-signature", "whsec_"]),
    ("linear", ["lin_wh_"]), ("slack", ["Signing Secret", "url_verification"]),
    ("sentry", ["Client Secret"]),
])
def test_the_webhook_page_says_how_to_connect_each_sender(make_webhook, owner_client, source,
                                                          must_say):
    webhook = make_webhook(source)
    page = owner_client.get(f"/todos/webhooks/{webhook.slug}/").content.decode()
    setup = page.split('id="setup"', 1)[1].split("</section>", 1)[0]
    for text in must_say:
        assert text.replace("'", "&#x27;") in setup, text
    assert f"/hooks/{webhook.slug}" in setup
    assert SECRETS[source] not in page


@pytest.mark.parametrize("public_url, warns", [
    ("http://127.0.0.1:8000", "loopback"), ("http://localhost:8000", "loopback"),
    ("http://[::1]:8000", "loopback"), ("http://switchboard.example.com", "plain http"),
    ("https://switchboard.example.com", ""),
])
def test_the_webhook_page_warns_when_senders_cannot_reach_the_public_url(
        make_webhook, owner_client, public_url, warns):
    assert (warns in sender_setup.public_url_warning(public_url)) if warns else (
        sender_setup.public_url_warning(public_url) == "")
    webhook = make_webhook("github")
    with override_settings(SWITCHBOARD_PUBLIC_URL=public_url):
        page = owner_client.get(f"/todos/webhooks/{webhook.slug}/").content.decode()
    assert ('id="public-url-warning"' in page) == bool(warns)


@pytest.mark.parametrize("source", sorted(sender_setup.SENDER_MINTED))
def test_a_sender_minted_secrets_setup_names_this_webhook_and_only_stripe_gets_its_forwarder(
        make_webhook, owner_client, source):
    webhook = make_webhook(source)
    page = owner_client.get(f"/todos/webhooks/{webhook.slug}/").content.decode()
    assert f"rotate_webhook_secret {webhook.slug} --secret" in page
    assert "&lt;slug&gt;" not in page
    warning = sender_setup.public_url_warning("http://127.0.0.1:8000", source)
    assert ("stripe listen" in warning) == (source == Source.STRIPE)


@pytest.mark.parametrize("source", sorted(sender_setup.SENDER_MINTED))
def test_add_webhook_for_a_sender_minted_secret_needs_the_senders_secret(operator, source):
    with pytest.raises(CommandError) as refused:
        call_command("add_webhook", f"{source}-x", "--owner", operator.username,
                     "--source", source)
    assert "--secret" in str(refused.value) and "mints the signing secret" in str(refused.value)
    if source == Source.STRIPE:
        assert "whsec_" in str(refused.value) and "stripe listen" in str(refused.value)
    assert not transitions.Webhook.objects.filter(slug=f"{source}-x").exists()
