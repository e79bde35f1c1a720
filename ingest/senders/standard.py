"""Standard Webhooks: webhook-id, webhook-timestamp and a v1 base64 HMAC-SHA256 signature
over "<id>.<timestamp>.<body>", keyed by the base64 after an optional whsec_
(docs/senders.md#the-other-sources-briefly)."""

import base64
import binascii
import hashlib
import hmac
import secrets

from . import Sender
from ..models import Source, TrustMode
from ..titles import text
from ..verification import (Envelope, VerificationFailed, accepted_secrets, as_bytes,
                            check_timestamp, matches_any, require_header)

SECRET_PREFIX = "whsec_"


def decode_secret(secret: str) -> bytes:
    """Standard Webhooks keys are base64 after an optional ``whsec_`` prefix."""
    raw = secret[len(SECRET_PREFIX):] if secret.startswith(SECRET_PREFIX) else secret
    return base64.b64decode(raw, validate=True)


def verify(webhook, headers, body, now) -> Envelope:
    message_id = require_header(headers, "webhook-id")
    stamp_header = require_header(headers, "webhook-timestamp")
    header = require_header(headers, "webhook-signature")
    check_timestamp(stamp_header, now)
    # The id and timestamp are signed as sent (no re-formatting), per the spec.
    signed = as_bytes(message_id) + b"." + as_bytes(stamp_header) + b"." + body
    given = []
    for entry in header.split():
        version, _, signature = entry.partition(",")
        if version == "v1" and signature:
            given.append(as_bytes(signature))
    if not given:
        raise VerificationFailed("webhook-signature has no v1 signature")
    expected = []
    for secret in accepted_secrets(webhook, now):
        try:
            key = decode_secret(secret)
        except (binascii.Error, ValueError):
            continue  # a malformed stored secret verifies nothing (add_webhook refuses them)
        expected.append(base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()))
    if not matches_any(expected, given):
        raise VerificationFailed("signature mismatch")
    return Envelope(TrustMode.SIGNED, message_id, "", hashlib.sha256(signed).hexdigest())


def derive_kind(event: str, payload) -> str:
    return text(payload.get("type")) if isinstance(payload, dict) else ""


def derive_title(kind: str, payload: dict, webhook_slug: str) -> str:
    return f"{webhook_slug}: {kind}" if kind else f"{webhook_slug}: delivery"


def delivery_id(envelope: Envelope, payload: dict) -> str:
    # Cairn signs its event_id inside the body; it is the stable id across redeliveries.
    if isinstance(payload.get("event_id"), str):
        return payload["event_id"]
    return envelope.delivery_id


def mint_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def check_secret(secret: str) -> None:
    try:
        decode_secret(secret)
    except ValueError:
        raise ValueError("a Standard Webhooks secret is whsec_ followed by base64") from None


def setup_steps(hook_url: str, slug: str) -> list[str]:
    return [
        f"Give the sender the URL {hook_url} and the whsec_… secret add_webhook printed.",
        "The sender signs as Standard Webhooks says: webhook-id, webhook-timestamp "
        "(within 300 s) and webhook-signature: v1,<base64 HMAC-SHA256>.",
    ]


SENDER = Sender(
    source=Source.STANDARD, verify=verify, derive_kind=derive_kind, derive_title=derive_title,
    setup_steps=setup_steps, secret_example="whsec_…", mint_secret=mint_secret,
    check_secret=check_secret, delivery_id=delivery_id, delivery_headers=("webhook-id",))
