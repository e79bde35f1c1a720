"""Sentry: HMAC-SHA256 of the body in Sentry-Hook-Signature, keyed by the integration's Client
Secret Sentry mints; kinds from Sentry-Hook-Resource and the action (docs/senders.md#sentry)."""

from . import Sender
from ..models import Source, TrustMode
from ..titles import dig, first, kind_with_action
from ..verification import (Envelope, VerificationFailed, accepted_secrets, as_bytes, hmac_hex,
                            matches_any, require_header)


def verify(webhook, headers, body, now) -> Envelope:
    given = require_header(headers, "Sentry-Hook-Signature")
    expected = [hmac_hex(secret, body) for secret in accepted_secrets(webhook, now)]
    if not matches_any(expected, [as_bytes(given.strip().lower())]):
        raise VerificationFailed("signature mismatch")
    return Envelope(TrustMode.SIGNED, headers.get("Request-ID", ""),
                    headers.get("Sentry-Hook-Resource", ""))


def derive_title(kind: str, payload: dict, webhook_slug: str = "") -> str:
    resource, _, action = kind.partition(".")
    data = payload.get("data") if isinstance(payload.get("data"), dict) else {}
    what = first(dig(data, "issue", "title"), dig(data, "event", "title"),
                 dig(data, "error", "title"), data.get("description_title"),
                 dig(data, "metric_alert", "title"), data.get("comment"),
                 dig(data, "installation", "app", "slug"))
    head = f"{resource or 'Sentry'} {action or 'event'}"
    return f"{head}: {what}" if what else f"Sentry {head}"


def setup_steps(hook_url: str, slug: str) -> list[str]:
    return [
        "Settings → Developer Settings → Custom Integrations → New Internal Integration; "
        f"Webhook URL {hook_url}; subscribe to issue (and error, comment as needed).",
        "Its Client Secret is the one add_webhook … --secret took; when Sentry's "
        f"changes, paste the new one: manage.py rotate_webhook_secret {slug} --secret ….",
        "Sentry does not retry: check this page's deliveries after setup.",
    ]


# What ends a thread (docs/work-control.md#threads): its issue resolved or ignored.
STOP_KINDS = ("issue.resolved", "issue.ignored")


def thread_key(kind: str, payload: dict) -> str:
    """The id of the Sentry issue the delivery is about (an issue, or an error or alert
    event of one)."""
    data = payload.get("data") if isinstance(payload.get("data"), dict) else {}
    return first(dig(data, "issue", "id"), dig(data, "event", "issue_id"),
                 dig(data, "error", "issue_id"))


def ends_thread(kind: str, payload: dict) -> bool:
    return kind in STOP_KINDS


# Sentry-Hook-Resource (issue, event_alert, metric_alert, …) plus the payload's action.
SENDER = Sender(
    source=Source.SENTRY, verify=verify, derive_kind=kind_with_action, derive_title=derive_title,
    setup_steps=setup_steps, mints_own_secret=True,
    kind_origin="the Sentry-Hook-Resource header, then the payload's action",
    event_headers=("sentry-hook-resource",), delivery_headers=("request-id",),
    thread_key=thread_key, ends_thread=ends_thread, stop_kinds=STOP_KINDS)
