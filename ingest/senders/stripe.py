"""Stripe: HMAC-SHA256 of "<t>.<body>" in Stripe-Signature within the timestamp window, a
whsec_ secret Stripe mints, the event id in the body (docs/senders.md#the-other-sources-briefly)."""

import hashlib
import secrets

from . import Sender, standard
from ..models import Source, TrustMode
from ..titles import dig, text
from ..verification import (Envelope, VerificationFailed, accepted_secrets, as_bytes,
                            check_timestamp, hmac_hex, matches_any, require_header)


def verify(webhook, headers, body, now) -> Envelope:
    header = require_header(headers, "Stripe-Signature")
    stamps, signatures = [], []
    for part in header.split(","):
        key, _, value = part.strip().partition("=")
        if key == "t":
            stamps.append(value)
        elif key == "v1":
            signatures.append(as_bytes(value.lower()))
    if len(stamps) != 1 or not signatures:
        raise VerificationFailed("Stripe-Signature lacks t= or v1=")
    stamp = check_timestamp(stamps[0], now)
    signed = f"{stamp}.".encode() + body
    # Stripe's key is the whole "whsec_…" string, used as-is.
    expected = [hmac_hex(secret, signed) for secret in accepted_secrets(webhook, now)]
    if not matches_any(expected, signatures):
        raise VerificationFailed("signature mismatch")
    return Envelope(TrustMode.SIGNED, "", "", hashlib.sha256(signed).hexdigest())


def derive_kind(event: str, payload) -> str:
    return text(payload.get("type")) if isinstance(payload, dict) else ""


def derive_title(kind: str, payload: dict, webhook_slug: str = "") -> str:
    obj = dig(payload, "data", "object")
    ident = text(dig(obj, "id")) if isinstance(obj, dict) else ""
    return f"Stripe {kind or 'event'}" + (f": {ident}" if ident else "")


def delivery_id(envelope: Envelope, payload: dict) -> str:
    # The event id is in the body; the headers carry none.
    return payload.get("id") if isinstance(payload.get("id"), str) else ""


def mint_secret() -> str:
    return standard.SECRET_PREFIX + secrets.token_hex(24)


def setup_steps(hook_url: str, slug: str) -> list[str]:
    return [
        "Stripe mints the signing secret: Developers → Webhooks → Add endpoint, "
        f"endpoint URL {hook_url}, select the events.",
        "Its signing secret (whsec_…) is the one add_webhook … --secret took; when Stripe "
        f"rolls it, paste the new one: manage.py rotate_webhook_secret {slug} "
        "--secret 'whsec_…'.",
        f"Locally, without a public URL: stripe listen --forward-to {hook_url} "
        "prints a whsec_… secret of its own; paste that one the same way.",
        "Stripe's endpoint page lists every attempt and its answer.",
    ]


SENDER = Sender(
    source=Source.STRIPE, verify=verify, derive_kind=derive_kind, derive_title=derive_title,
    setup_steps=setup_steps, mints_own_secret=True, secret_example="whsec_…",
    local_forwarder="stripe listen --forward-to", mint_secret=mint_secret,
    delivery_id=delivery_id)
