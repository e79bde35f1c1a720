"""Per-source verification, unit level: no database, headers and bytes in, verdict out."""

import hashlib
import hmac
import json
from datetime import datetime, timedelta, timezone

import pytest
from django.http.request import HttpHeaders

from ingest import senders, verification
from ingest.models import Webhook

from ingest.tests import signing
from ingest.tests.conftest import SECRETS

NOW = datetime.now(timezone.utc)


@pytest.fixture(autouse=True)
def fresh_now():
    """The signers stamp the real time; NOW must be read per test, not at import (pytest-django
    runs these database-free tests last, easily more than the 300 s tolerance later)."""
    global NOW
    NOW = datetime.now(timezone.utc)


def headers_of(meta: dict) -> HttpHeaders:
    return HttpHeaders(meta)


def hook(source, secret=None, previous="", previous_expires=None):
    return Webhook(slug=f"{source}-hook", source=source,
                   secret=SECRETS[source] if secret is None else secret,
                   previous_secret=previous, previous_secret_expires_at=previous_expires)


# -- the public reference vectors --------------------------------------------------------------


def test_github_documented_example_vector_verifies():
    # GitHub's docs validate with the secret "It's a Secret to Everybody" over the body
    # "Hello, World!", whose X-Hub-Signature-256 they give as sha256=757107ea…3e17.
    webhook = hook("github", secret="It's a Secret to Everybody")
    meta = {"HTTP_X_HUB_SIGNATURE_256":
            "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17",
            "HTTP_X_GITHUB_EVENT": "ping", "HTTP_X_GITHUB_DELIVERY": "d-1"}
    envelope = senders.verify_delivery(webhook, headers_of(meta), b"Hello, World!", now=NOW)
    assert (envelope.trust, envelope.delivery_id, envelope.event) == ("signed", "d-1", "ping")
    with pytest.raises(verification.VerificationFailed):
        senders.verify_delivery(webhook, headers_of(meta), b"Hello, World?", now=NOW)


def test_standard_webhooks_reference_vector_verifies():
    # The Standard Webhooks reference: key whsec_MfKQ9r8G…, id msg_p5jXN8AQM9LWM0D4loKWxJek,
    # timestamp 1614265330, body {"test": 2432232314}, signature v1,g0hM9SsE…1OE=.
    webhook = hook("standard")
    meta = {"HTTP_WEBHOOK_ID": "msg_p5jXN8AQM9LWM0D4loKWxJek",
            "HTTP_WEBHOOK_TIMESTAMP": "1614265330",
            "HTTP_WEBHOOK_SIGNATURE": "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="}
    body = b'{"test": 2432232314}'
    at_signing = datetime.fromtimestamp(1614265330, timezone.utc)
    envelope = senders.verify_delivery(webhook, headers_of(meta), body, now=at_signing)
    assert envelope.delivery_id == "msg_p5jXN8AQM9LWM0D4loKWxJek"
    # The same vector a day later is a replay.
    with pytest.raises(verification.VerificationFailed, match="tolerance"):
        senders.verify_delivery(webhook, headers_of(meta), body,
                                     now=at_signing + timedelta(days=1))


# Slack's worked example in "Verifying requests from Slack" (api.slack.com/authentication/
# verifying-requests-from-slack): a slash command's form body, signed at 1531420618.
SLACK_EXAMPLE_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
SLACK_EXAMPLE_TIMESTAMP = "1531420618"
SLACK_EXAMPLE_BODY = (
    b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow"
    b"&channel_id=G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner"
    b"&command=%2Fwebhook-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands"
    b"%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN"
    b"&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c")
SLACK_EXAMPLE_SIGNATURE = "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503"


def test_slack_documented_example_vector_verifies():
    webhook = hook("slack", secret=SLACK_EXAMPLE_SECRET)
    meta = {"HTTP_X_SLACK_SIGNATURE": SLACK_EXAMPLE_SIGNATURE,
            "HTTP_X_SLACK_REQUEST_TIMESTAMP": SLACK_EXAMPLE_TIMESTAMP}
    at_signing = datetime.fromtimestamp(int(SLACK_EXAMPLE_TIMESTAMP), timezone.utc)
    envelope = senders.verify_delivery(webhook, headers_of(meta), SLACK_EXAMPLE_BODY,
                                            now=at_signing + timedelta(seconds=10))
    assert envelope.trust == "signed"
    # One byte of the body changed, or the same request six minutes later: refused.
    with pytest.raises(verification.VerificationFailed, match="mismatch"):
        senders.verify_delivery(webhook, headers_of(meta), SLACK_EXAMPLE_BODY + b"x",
                                     now=at_signing)
    with pytest.raises(verification.VerificationFailed, match="tolerance") as stale:
        senders.verify_delivery(webhook, headers_of(meta), SLACK_EXAMPLE_BODY,
                                     now=at_signing + timedelta(minutes=6))
    assert stale.value.stale


def test_slack_signature_must_be_v0():
    body = b'{"type": "event_callback"}'
    meta = signing.slack(SECRETS["slack"], body)
    meta["HTTP_X_SLACK_SIGNATURE"] = meta["HTTP_X_SLACK_SIGNATURE"].replace("v0=", "v1=")
    with pytest.raises(verification.VerificationFailed, match="v0="):
        senders.verify_delivery(hook("slack"), headers_of(meta), body, now=NOW)


def test_slack_without_a_timestamp_header_is_refused():
    body = b'{"type": "event_callback"}'
    meta = signing.slack(SECRETS["slack"], body)
    del meta["HTTP_X_SLACK_REQUEST_TIMESTAMP"]
    with pytest.raises(verification.VerificationFailed, match="missing X-Slack-Request-Timestamp"):
        senders.verify_delivery(hook("slack"), headers_of(meta), body, now=NOW)


def test_linear_and_sentry_take_their_delivery_id_and_event_from_their_headers():
    body = b'{"type": "Issue", "action": "create"}'
    envelope = senders.verify_delivery(
        hook("linear"), headers_of(signing.linear(SECRETS["linear"], body, delivery="lin-1",
                                                  event="Issue")), body, now=NOW)
    assert (envelope.delivery_id, envelope.event) == ("lin-1", "Issue")
    # Linear's timestamp is inside the body: the body is the signed request.
    assert envelope.signed_digest == hashlib.sha256(body).hexdigest()
    envelope = senders.verify_delivery(
        hook("sentry"), headers_of(signing.sentry(SECRETS["sentry"], body, resource="event_alert",
                                                  delivery="req-1")), body, now=NOW)
    assert (envelope.delivery_id, envelope.event, envelope.signed_digest) == (
        "req-1", "event_alert", "")


@pytest.mark.parametrize("skew_ms", [-61_000, 61_000])
def test_linear_body_timestamp_beyond_60_seconds_is_stale(skew_ms):
    payload = {"webhookTimestamp": int(NOW.timestamp() * 1000) + skew_ms}
    with pytest.raises(verification.VerificationFailed, match="60 s tolerance") as refused:
        senders.check_payload(hook("linear"), payload, now=NOW)
    assert refused.value.stale


@pytest.mark.parametrize("skew_ms", [-59_000, 0, 59_000])
def test_linear_body_timestamp_within_60_seconds_is_accepted(skew_ms):
    payload = {"webhookTimestamp": int(NOW.timestamp() * 1000) + skew_ms}
    senders.check_payload(hook("linear"), payload, now=NOW)


@pytest.mark.parametrize("payload, reason", [
    ({}, "missing webhookTimestamp"),
    ({"webhookTimestamp": "1714478400000"}, "not a number"),
    ({"webhookTimestamp": True}, "not a number"),
])
def test_linear_body_without_a_numeric_timestamp_is_refused(payload, reason):
    with pytest.raises(verification.VerificationFailed, match=reason) as refused:
        senders.check_payload(hook("linear"), payload, now=NOW)
    assert not refused.value.stale


def test_other_sources_sign_nothing_inside_the_body():
    for source in ("github", "slack", "sentry", "stripe"):
        senders.check_payload(hook(source), {}, now=NOW)


def test_standard_accepts_any_of_several_listed_signatures():
    webhook = hook("standard")
    body = b'{"type": "x"}'
    meta = signing.standard(SECRETS["standard"], body)
    meta["HTTP_WEBHOOK_SIGNATURE"] = "v1,bm90LWl0 " + meta["HTTP_WEBHOOK_SIGNATURE"]
    senders.verify_delivery(webhook, headers_of(meta), body, now=NOW)


# -- every signed source: accepted, and each way of being wrong -------------------------------

SIGNED = ["github", "gitea", "gitlab", "stripe", "standard", "linear", "slack", "sentry"]
REQUIRED_HEADER = {"github": "HTTP_X_HUB_SIGNATURE_256", "gitea": "HTTP_X_GITEA_SIGNATURE",
                   "gitlab": "HTTP_X_GITLAB_TOKEN", "stripe": "HTTP_STRIPE_SIGNATURE",
                   "standard": "HTTP_WEBHOOK_SIGNATURE", "linear": "HTTP_LINEAR_SIGNATURE",
                   "slack": "HTTP_X_SLACK_SIGNATURE", "sentry": "HTTP_SENTRY_HOOK_SIGNATURE"}
BODY = json.dumps({"id": "evt_1", "type": "invoice.paid", "action": "opened"}).encode()


@pytest.mark.parametrize("source", SIGNED)
def test_valid_delivery_verifies(source):
    meta = signing.SIGNERS[source](SECRETS[source], BODY)
    envelope = senders.verify_delivery(hook(source), headers_of(meta), BODY, now=NOW)
    assert envelope.trust == "signed"


# GitLab's scheme is a shared token, not a MAC over the body: nothing in it can detect a
# tampered body (integrity there rests on TLS), so it is left out of this one test.
@pytest.mark.parametrize("source", [s for s in SIGNED if s != "gitlab"])
def test_tampered_body_is_refused(source):
    meta = signing.SIGNERS[source](SECRETS[source], BODY)
    with pytest.raises(verification.VerificationFailed):
        senders.verify_delivery(hook(source), headers_of(meta), BODY + b" ", now=NOW)


@pytest.mark.parametrize("source", SIGNED)
def test_wrong_secret_is_refused(source):
    wrong = "whsec_" + "d3JvbmcgYnV0IHZhbGlkIGJhc2U2NA==" if source == "standard" else "wrong-secret-0123456789"
    meta = signing.SIGNERS[source](wrong, BODY)
    with pytest.raises(verification.VerificationFailed, match="mismatch"):
        senders.verify_delivery(hook(source), headers_of(meta), BODY, now=NOW)


@pytest.mark.parametrize("source", SIGNED)
def test_missing_signature_header_is_refused(source):
    meta = signing.SIGNERS[source](SECRETS[source], BODY)
    del meta[REQUIRED_HEADER[source]]
    with pytest.raises(verification.VerificationFailed, match="missing"):
        senders.verify_delivery(hook(source), headers_of(meta), BODY, now=NOW)


@pytest.mark.parametrize("source", ["stripe", "standard", "slack"])
@pytest.mark.parametrize("skew", [-301, 301])
def test_timestamp_beyond_300_seconds_is_refused(source, skew):
    meta = signing.SIGNERS[source](SECRETS[source], BODY, timestamp=int(NOW.timestamp()) + skew)
    with pytest.raises(verification.VerificationFailed, match="tolerance"):
        senders.verify_delivery(hook(source), headers_of(meta), BODY, now=NOW)


@pytest.mark.parametrize("source", ["stripe", "standard", "slack"])
@pytest.mark.parametrize("skew", [-290, 290])
def test_timestamp_within_300_seconds_is_accepted(source, skew):
    stamp = int(NOW.timestamp()) + skew
    meta = signing.SIGNERS[source](SECRETS[source], BODY, timestamp=stamp)
    senders.verify_delivery(hook(source), headers_of(meta), BODY, now=NOW)


@pytest.mark.parametrize("source", SIGNED)
def test_previous_secret_works_during_rotation_and_not_after(source):
    old = SECRETS[source]
    new = "whsec_bmV3LXNlY3JldC1mb3Itcm90YXRpb24=" if source == "standard" else "new-secret-0123456789abc"
    webhook = hook(source, secret=new, previous=old, previous_expires=NOW + timedelta(hours=1))
    meta = signing.SIGNERS[source](old, BODY)
    senders.verify_delivery(webhook, headers_of(meta), BODY, now=NOW)
    senders.verify_delivery(webhook, headers_of(signing.SIGNERS[source](new, BODY)), BODY, now=NOW)
    with pytest.raises(verification.VerificationFailed):
        senders.verify_delivery(webhook, headers_of(meta), BODY, now=NOW + timedelta(hours=2))


def test_forgejo_headers_verify_a_gitea_webhook():
    meta = signing.gitea(SECRETS["gitea"], BODY, event="pull_request", delivery="f-1", forgejo=True)
    envelope = senders.verify_delivery(hook("gitea"), headers_of(meta), BODY, now=NOW)
    assert (envelope.delivery_id, envelope.event) == ("f-1", "pull_request")


def test_gitlab_prefers_idempotency_key_as_delivery_id():
    meta = signing.gitlab(SECRETS["gitlab"], BODY, delivery="uuid-1")
    meta["HTTP_IDEMPOTENCY_KEY"] = "idem-1"
    envelope = senders.verify_delivery(hook("gitlab"), headers_of(meta), BODY, now=NOW)
    assert envelope.delivery_id == "idem-1"


def test_stripe_accepts_any_v1_and_signs_with_the_whole_whsec_string():
    secret = SECRETS["stripe"]
    stamp = int(NOW.timestamp())
    good = hmac.new(secret.encode(), f"{stamp}.".encode() + BODY, hashlib.sha256).hexdigest()
    meta = {"HTTP_STRIPE_SIGNATURE": f"t={stamp},v1={'0' * 64},v1={good},v0=ignored"}
    senders.verify_delivery(hook("stripe"), headers_of(meta), BODY, now=NOW)


def test_signed_webhook_without_a_secret_verifies_nothing():
    meta = signing.github("", BODY)
    with pytest.raises(verification.VerificationFailed, match="no secret"):
        senders.verify_delivery(hook("github", secret=""), headers_of(meta), BODY, now=NOW)


def test_unsigned_is_accepted_as_unverified():
    envelope = senders.verify_delivery(hook("unsigned"), headers_of({}), BODY, now=NOW)
    assert envelope.trust == "unverified"


def test_non_ascii_signature_header_is_a_mismatch_not_a_crash():
    meta = {"HTTP_X_HUB_SIGNATURE_256": "sha256=ünïcødé\udcff"}
    with pytest.raises(verification.VerificationFailed):
        senders.verify_delivery(hook("github"), headers_of(meta), BODY, now=NOW)
