"""What every sender's verification is made of (docs/senders.md): the verdict, the accepted
secrets, constant-time comparisons, timestamp windows. Each sender's own scheme is its
``verify`` in ``ingest/senders/``.

Everything here is pure: headers and raw body in, a verdict out, nothing written. A verifier
raises ``VerificationFailed`` with a short reason that is safe to log (it never contains the
body, a secret or a signature); the hook turns it into a 401.

Comparisons are constant-time (``hmac.compare_digest``) over bytes, and every secret that is
currently accepted (the current one and, during rotation, the previous one) is tried.
"""

import hashlib
import hmac
from dataclasses import dataclass
from datetime import timedelta

# Stripe, Standard Webhooks and Slack sign a timestamp; a delivery outside this window either way
# is a replay (or a sender with a broken clock) and is refused.
TIMESTAMP_TOLERANCE = timedelta(seconds=300)


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


def as_bytes(text: str) -> bytes:
    # Header values arrive as latin-1 text from servers but as anything from test clients;
    # surrogatepass keeps every str encodable so a comparison never raises.
    return text.encode("utf-8", "surrogatepass")


def matches_any(expected: list[bytes], given: list[bytes]) -> bool:
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


def hmac_hex(secret: str, body: bytes) -> bytes:
    return hmac.new(as_bytes(secret), body, hashlib.sha256).hexdigest().encode()


def require_header(headers, name: str) -> str:
    value = headers.get(name)
    if not value:
        raise VerificationFailed(f"missing {name} header")
    return value


def check_timestamp(raw: str, now, tolerance=TIMESTAMP_TOLERANCE) -> int:
    try:
        stamp = int(raw)
    except ValueError:
        raise VerificationFailed("timestamp is not an integer") from None
    check_within(stamp, now, tolerance)
    return stamp


def check_within(stamp_seconds: float, now, tolerance) -> None:
    if abs(now.timestamp() - stamp_seconds) > tolerance.total_seconds():
        raise VerificationFailed(
            f"timestamp outside the {int(tolerance.total_seconds())} s tolerance", stale=True)
