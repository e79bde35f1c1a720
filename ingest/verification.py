"""Per-source verification of webhook deliveries (docs/senders.md).

Everything here is pure: headers and raw body in, a verdict out, nothing written. A verifier
raises ``VerificationFailed`` with a short reason that is safe to log (it never contains the
body, a secret or a signature); the view turns it into a 401.

Comparisons are constant-time (``hmac.compare_digest``) over bytes, and every secret that is
currently accepted (the current one and, during rotation, the previous one) is tried.
"""

import base64
import binascii
import hashlib
import hmac
from dataclasses import dataclass
from datetime import timedelta

from .models import Source, TrustMode

# Stripe, Standard Webhooks and Slack sign a timestamp; a delivery outside this window either way
# is a replay (or a sender with a broken clock) and is refused.
TIMESTAMP_TOLERANCE = timedelta(seconds=300)
# Linear signs its timestamp inside the body (webhookTimestamp, in milliseconds) and asks
# receivers to refuse anything more than a minute off.
LINEAR_TIMESTAMP_TOLERANCE = timedelta(seconds=60)
# Milliseconds since the epoch, as a JavaScript sender can write them exactly (2**53 - 1): a
# JSON integer has no size of its own, and a larger one overflows the float it is compared as.
MAX_LINEAR_TIMESTAMP_MS = 2**53 - 1

STANDARD_SECRET_PREFIX = "whsec_"


class VerificationFailed(Exception):
    """The delivery is not from whoever holds the webhook's secret. ``reason`` is loggable."""

    def __init__(self, reason: str, *, stale: bool = False, malformed: bool = False):
        super().__init__(reason)
        self.reason = reason
        # The signature scheme's timestamp is outside the tolerance (outcome stale_timestamp).
        self.stale = stale
        # A signed value outside its documented range: the sender's bad input (a 400), not a
        # failed proof of origin.
        self.malformed = malformed


@dataclass(frozen=True)
class Envelope:
    """What the headers of a verified delivery say; the body is parsed afterwards."""

    trust: str
    delivery_id: str  # "" when the headers carry none (Stripe and Cairn put it in the body)
    event: str  # the source's event header ("" when it has none)
    # Stripe, Standard and Slack sign a timestamp with the body (Linear inside it): the sha256
    # of exactly what was signed identifies this one request (the replay ledger's fingerprint);
    # "" elsewhere, where the body's own digest serves.
    signed_digest: str = ""


def _bytes(text: str) -> bytes:
    # Header values arrive as latin-1 text from servers but as anything from test clients;
    # surrogatepass keeps every str encodable so a comparison never raises.
    return text.encode("utf-8", "surrogatepass")


def _matches_any(expected: list[bytes], given: list[bytes]) -> bool:
    """Constant-time per pair; every pair is compared so timing does not tell which matched."""
    found = False
    for want in expected:
        for have in given:
            found |= hmac.compare_digest(want, have)
    return found


def accepted_secrets(webhook, now) -> list[str]:
    """The current secret, plus the previous one while its rotation grace lasts (no expiry set
    means the operator chose to keep it until cleared)."""
    accepted = [webhook.secret] if webhook.secret else []
    if webhook.previous_secret and (
        webhook.previous_secret_expires_at is None or webhook.previous_secret_expires_at > now
    ):
        accepted.append(webhook.previous_secret)
    return accepted


def _hmac_hex(secret: str, body: bytes) -> bytes:
    return hmac.new(_bytes(secret), body, hashlib.sha256).hexdigest().encode()


def _require(headers, name: str) -> str:
    value = headers.get(name)
    if not value:
        raise VerificationFailed(f"missing {name} header")
    return value


def _check_timestamp(raw: str, now, tolerance=TIMESTAMP_TOLERANCE) -> int:
    try:
        stamp = int(raw)
    except ValueError:
        raise VerificationFailed("timestamp is not an integer") from None
    _check_within(stamp, now, tolerance)
    return stamp


def _check_within(stamp_seconds: float, now, tolerance) -> None:
    if abs(now.timestamp() - stamp_seconds) > tolerance.total_seconds():
        raise VerificationFailed(
            f"timestamp outside the {int(tolerance.total_seconds())} s tolerance", stale=True)


def _verify_github(webhook, headers, body, now) -> Envelope:
    given = _require(headers, "X-Hub-Signature-256")
    if not given.startswith("sha256="):
        raise VerificationFailed("X-Hub-Signature-256 is not sha256=<hex>")
    expected = [_hmac_hex(secret, body) for secret in accepted_secrets(webhook, now)]
    if not _matches_any(expected, [_bytes(given[len("sha256="):].lower())]):
        raise VerificationFailed("signature mismatch")
    return Envelope(TrustMode.SIGNED, headers.get("X-GitHub-Delivery", ""),
                    headers.get("X-GitHub-Event", ""))


def _verify_gitea(webhook, headers, body, now) -> Envelope:
    # Forgejo sends its own X-Forgejo-* headers and, for compatibility, the X-Gitea-* ones.
    given = [headers.get(name) for name in ("X-Forgejo-Signature", "X-Gitea-Signature")]
    given = [_bytes(value.lower()) for value in given if value]
    if not given:
        raise VerificationFailed("missing X-Gitea-Signature / X-Forgejo-Signature header")
    expected = [_hmac_hex(secret, body) for secret in accepted_secrets(webhook, now)]
    if not _matches_any(expected, given):
        raise VerificationFailed("signature mismatch")
    delivery = headers.get("X-Forgejo-Delivery") or headers.get("X-Gitea-Delivery", "")
    event = headers.get("X-Forgejo-Event") or headers.get("X-Gitea-Event", "")
    return Envelope(TrustMode.SIGNED, delivery, event)


def _verify_gitlab(webhook, headers, body, now) -> Envelope:
    given = _require(headers, "X-Gitlab-Token")
    expected = [_bytes(secret) for secret in accepted_secrets(webhook, now)]
    if not _matches_any(expected, [_bytes(given)]):
        raise VerificationFailed("token mismatch")
    delivery = headers.get("Idempotency-Key") or headers.get("X-Gitlab-Event-UUID", "")
    return Envelope(TrustMode.SIGNED, delivery, headers.get("X-Gitlab-Event", ""))


def _verify_stripe(webhook, headers, body, now) -> Envelope:
    header = _require(headers, "Stripe-Signature")
    stamps, signatures = [], []
    for part in header.split(","):
        key, _, value = part.strip().partition("=")
        if key == "t":
            stamps.append(value)
        elif key == "v1":
            signatures.append(_bytes(value.lower()))
    if len(stamps) != 1 or not signatures:
        raise VerificationFailed("Stripe-Signature lacks t= or v1=")
    stamp = _check_timestamp(stamps[0], now)
    signed = f"{stamp}.".encode() + body
    # Stripe's key is the whole "whsec_…" string, used as-is.
    expected = [_hmac_hex(secret, signed) for secret in accepted_secrets(webhook, now)]
    if not _matches_any(expected, signatures):
        raise VerificationFailed("signature mismatch")
    return Envelope(TrustMode.SIGNED, "", "", hashlib.sha256(signed).hexdigest())


def decode_standard_secret(secret: str) -> bytes:
    """Standard Webhooks keys are base64 after an optional ``whsec_`` prefix."""
    raw = secret[len(STANDARD_SECRET_PREFIX):] if secret.startswith(STANDARD_SECRET_PREFIX) else secret
    return base64.b64decode(raw, validate=True)


def _verify_standard(webhook, headers, body, now) -> Envelope:
    message_id = _require(headers, "webhook-id")
    stamp_header = _require(headers, "webhook-timestamp")
    header = _require(headers, "webhook-signature")
    _check_timestamp(stamp_header, now)
    # The id and timestamp are signed as sent (no re-formatting), per the spec.
    signed = _bytes(message_id) + b"." + _bytes(stamp_header) + b"." + body
    given = []
    for entry in header.split():
        version, _, signature = entry.partition(",")
        if version == "v1" and signature:
            given.append(_bytes(signature))
    if not given:
        raise VerificationFailed("webhook-signature has no v1 signature")
    expected = []
    for secret in accepted_secrets(webhook, now):
        try:
            key = decode_standard_secret(secret)
        except (binascii.Error, ValueError):
            continue  # a malformed stored secret verifies nothing (add_webhook refuses them)
        expected.append(base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()))
    if not _matches_any(expected, given):
        raise VerificationFailed("signature mismatch")
    return Envelope(TrustMode.SIGNED, message_id, "", hashlib.sha256(signed).hexdigest())


def _verify_linear(webhook, headers, body, now) -> Envelope:
    given = _require(headers, "Linear-Signature")
    expected = [_hmac_hex(secret, body) for secret in accepted_secrets(webhook, now)]
    if not _matches_any(expected, [_bytes(given.strip().lower())]):
        raise VerificationFailed("signature mismatch")
    # The body carries its own signed timestamp (checked once parsed: check_payload), so the
    # body is the signed request: timestamped, like Stripe's "<t>.<body>".
    return Envelope(TrustMode.SIGNED, headers.get("Linear-Delivery", ""),
                    headers.get("Linear-Event", ""), hashlib.sha256(body).hexdigest())


def _verify_slack(webhook, headers, body, now) -> Envelope:
    given = _require(headers, "X-Slack-Signature")
    stamp_header = _require(headers, "X-Slack-Request-Timestamp")
    version, _, signature = given.partition("=")
    if version != "v0" or not signature:
        raise VerificationFailed("X-Slack-Signature is not v0=<hex>")
    _check_timestamp(stamp_header, now)
    # Signed as sent: "v0:<timestamp header>:<raw body>".
    signed = b"v0:" + _bytes(stamp_header) + b":" + body
    expected = [_hmac_hex(secret, signed) for secret in accepted_secrets(webhook, now)]
    if not _matches_any(expected, [_bytes(signature.lower())]):
        raise VerificationFailed("signature mismatch")
    # The delivery id (event_id) is in the body; a retry re-signs with a fresh timestamp.
    return Envelope(TrustMode.SIGNED, "", "", hashlib.sha256(signed).hexdigest())


def _verify_sentry(webhook, headers, body, now) -> Envelope:
    given = _require(headers, "Sentry-Hook-Signature")
    expected = [_hmac_hex(secret, body) for secret in accepted_secrets(webhook, now)]
    if not _matches_any(expected, [_bytes(given.strip().lower())]):
        raise VerificationFailed("signature mismatch")
    return Envelope(TrustMode.SIGNED, headers.get("Request-ID", ""),
                    headers.get("Sentry-Hook-Resource", ""))


def _accept_unsigned(webhook, headers, body, now) -> Envelope:
    # No proof of origin: recorded as unverified, and never rung (docs/reference.md#trust).
    return Envelope(TrustMode.UNVERIFIED, "", "")


VERIFIERS = {
    Source.GITHUB: _verify_github,
    Source.GITEA: _verify_gitea,
    Source.GITLAB: _verify_gitlab,
    Source.STRIPE: _verify_stripe,
    Source.STANDARD: _verify_standard,
    Source.LINEAR: _verify_linear,
    Source.SLACK: _verify_slack,
    Source.SENTRY: _verify_sentry,
    Source.UNSIGNED: _accept_unsigned,
}


def verify_delivery(webhook, headers, body: bytes, *, now) -> Envelope:
    """Check ``body`` against the webhook's scheme and accepted secrets. Returns the envelope,
    or raises ``VerificationFailed``. A signed webhook without any secret verifies nothing."""
    if webhook.source != Source.UNSIGNED and not accepted_secrets(webhook, now):
        raise VerificationFailed("webhook has no secret configured")
    return VERIFIERS[webhook.source](webhook, headers, body, now)


def _check_linear_timestamp(payload: dict, now) -> None:
    stamp = payload.get("webhookTimestamp")
    if stamp is None:
        raise VerificationFailed("missing webhookTimestamp in the body")
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
        raise VerificationFailed("webhookTimestamp is not a number of milliseconds")
    if not 0 <= stamp <= MAX_LINEAR_TIMESTAMP_MS:
        raise VerificationFailed(
            f"webhookTimestamp must be 0 to {MAX_LINEAR_TIMESTAMP_MS} milliseconds",
            malformed=True)
    _check_within(stamp / 1000, now, LINEAR_TIMESTAMP_TOLERANCE)


# What a source signs inside the body, checked once the body is parsed (only after its
# signature verified: nothing unverified is parsed).
PAYLOAD_CHECKS = {
    Source.LINEAR: _check_linear_timestamp,
}


def check_payload(webhook, payload: dict, *, now) -> None:
    """The parsed body of a verified delivery against what its source signs inside it (Linear's
    webhookTimestamp within 60 s). Raises ``VerificationFailed`` (``stale`` when it is old)."""
    check = PAYLOAD_CHECKS.get(webhook.source)
    if check is not None:
        check(payload, now)
