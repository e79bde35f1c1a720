"""Linear: HMAC-SHA256 of the body in Linear-Signature, and its webhookTimestamp inside the
signed body within a minute; a secret Linear mints (docs/senders.md#linear)."""

import hashlib
from datetime import timedelta

from . import ConnectionSpec, Sender
from ..models import Source, TrustMode
from ..titles import dig, first, kind_with_action, text
from ..verification import (Envelope, VerificationFailed, accepted_secrets, as_bytes,
                            check_within, hmac_hex, matches_any, require_header)

# Linear signs its timestamp inside the body (webhookTimestamp, in milliseconds) and asks
# receivers to refuse anything more than a minute off.
TIMESTAMP_TOLERANCE = timedelta(seconds=60)
# Milliseconds since the epoch, as a JavaScript sender can write them exactly (2**53 - 1): a
# JSON integer has no size of its own, and a larger one overflows the float it is compared as.
MAX_TIMESTAMP_MS = 2**53 - 1
ACTION_WORDS = {"create": "created", "update": "updated", "remove": "removed"}


def verify(webhook, headers, body, now) -> Envelope:
    given = require_header(headers, "Linear-Signature")
    expected = [hmac_hex(secret, body) for secret in accepted_secrets(webhook, now)]
    if not matches_any(expected, [as_bytes(given.strip().lower())]):
        raise VerificationFailed("signature mismatch")
    # The body carries its own signed timestamp (checked once parsed: check_payload), so the
    # body is the signed request: timestamped, like Stripe's "<t>.<body>".
    return Envelope(TrustMode.SIGNED, headers.get("Linear-Delivery", ""),
                    headers.get("Linear-Event", ""), hashlib.sha256(body).hexdigest())


def check_payload(payload: dict, now) -> None:
    stamp = payload.get("webhookTimestamp")
    if stamp is None:
        raise VerificationFailed("missing webhookTimestamp in the body")
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
        raise VerificationFailed("webhookTimestamp is not a number of milliseconds")
    if not 0 <= stamp <= MAX_TIMESTAMP_MS:
        raise VerificationFailed(
            f"webhookTimestamp must be 0 to {MAX_TIMESTAMP_MS} milliseconds", malformed=True)
    check_within(stamp / 1000, now, TIMESTAMP_TOLERANCE)


def derive_kind(event: str, payload) -> str:
    # "<type>.<action>" from the signed body: Issue.create, AgentSessionEvent.created.
    return kind_with_action(payload.get("type"), payload) if isinstance(payload, dict) else ""


def derive_title(kind: str, payload: dict, webhook_slug: str = "") -> str:
    kind_type, _, action = kind.partition(".")
    done = ACTION_WORDS.get(action, action or "updated")
    data = payload.get("data") if isinstance(payload.get("data"), dict) else {}
    if kind_type == "Issue":
        return f"{text(data.get('identifier')) or 'Linear issue'} {done}: {text(data.get('title'))}"
    if kind_type == "Comment":
        issue = first(dig(data, "issue", "identifier"), dig(data, "issue", "title"))
        return f"{issue or 'Linear'} comment {done}: {text(data.get('body'))}"
    if kind_type == "AgentSessionEvent":
        session = payload.get("agentSession") if isinstance(payload.get("agentSession"), dict) else {}
        issue = text(dig(session, "issue", "identifier"))
        prompt = first(dig(payload, "agentActivity", "body"),
                       dig(payload, "agentActivity", "content", "body"),
                       dig(session, "comment", "body"), dig(session, "issue", "title"))
        return f"{issue or 'Linear'} agent session {action or 'event'}: {prompt}"
    what = first(data.get("identifier"), data.get("title"), data.get("name"), data.get("body"))
    return f"Linear {kind or 'event'}" + (f": {what}" if what else "")


def setup_steps(hook_url: str, slug: str) -> list[str]:
    return [
        "Linear mints the secret: Settings → API → Webhooks → New webhook, "
        f"URL {hook_url}, pick the resource types.",
        "Its signing secret (lin_wh_…) is the one add_webhook … --secret took; when "
        f"Linear's changes, paste the new one: manage.py rotate_webhook_secret {slug} "
        "--secret 'lin_wh_…'.",
    ]


SENDER = Sender(
    source=Source.LINEAR, verify=verify, derive_kind=derive_kind, derive_title=derive_title,
    setup_steps=setup_steps, mints_own_secret=True, check_payload=check_payload,
    kind_origin="the payload's type, then its action", event_headers=("linear-event",),
    delivery_headers=("linear-delivery",),
    # An app's OAuth token (actor=app) or an API key; no write-back client yet.
    connections=(ConnectionSpec(kind="linear", default_api_url="https://api.linear.app/graphql"),))
