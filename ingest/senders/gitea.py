"""Gitea and Forgejo: HMAC-SHA256 of the body (Forgejo sends its own X-Forgejo-* headers and,
for compatibility, the X-Gitea-* ones), GitHub's payload shapes, the sender's permission as
its role where it is the sender's own (docs/senders.md#the-other-sources-briefly)."""

from . import ConnectionSpec, Sender, github
from ..actors import Actor, dict_of, text_of
from ..models import Source, TrustMode
from ..titles import kind_with_action
from ..verification import (Envelope, VerificationFailed, accepted_secrets, as_bytes, hmac_hex,
                            matches_any)

# Event kinds whose repository.permissions are the sender's own: Gitea fills it with the
# sender's permission on comments and on opening an issue or pull request (the sender is the
# poster), and with the issue poster's or a fixed owner's on other events.
SENDER_PERMISSION_KINDS = ("issue_comment", "issues.opened", "pull_request.opened")


def verify(webhook, headers, body, now) -> Envelope:
    given = [headers.get(name) for name in ("X-Forgejo-Signature", "X-Gitea-Signature")]
    given = [as_bytes(value.lower()) for value in given if value]
    if not given:
        raise VerificationFailed("missing X-Gitea-Signature / X-Forgejo-Signature header")
    expected = [hmac_hex(secret, body) for secret in accepted_secrets(webhook, now)]
    if not matches_any(expected, given):
        raise VerificationFailed("signature mismatch")
    delivery = headers.get("X-Forgejo-Delivery") or headers.get("X-Gitea-Delivery", "")
    event = headers.get("X-Forgejo-Event") or headers.get("X-Gitea-Event", "")
    return Envelope(TrustMode.SIGNED, delivery, event)


def read_actor(kind: str, payload: dict) -> Actor:
    """``sender.login``; payloads carry no author_association but ``repository.permissions``,
    counted only where they are the sender's own: ``admin`` as OWNER, ``push`` as
    COLLABORATOR (MEMBER is never derived)."""
    sender = dict_of(payload.get("sender"))
    login = text_of(sender.get("login")) or text_of(sender.get("username"))
    if not (kind.startswith("issue_comment") or kind in SENDER_PERMISSION_KINDS):
        return Actor(login)
    permissions = dict_of(dict_of(payload.get("repository")).get("permissions"))
    if permissions.get("admin") is True:
        return Actor(login, frozenset({"OWNER"}))
    if permissions.get("push") is True:
        return Actor(login, frozenset({"COLLABORATOR"}))
    return Actor(login)


def setup_steps(hook_url: str, slug: str) -> list[str]:
    return [
        "Repository → Settings → Webhooks → Add webhook → Gitea (Forgejo: Forgejo).",
        f"Target URL: {hook_url}",
        "HTTP method POST, POST content type application/json.",
        "Secret: the secret add_webhook printed.",
        "Trigger on the events this webhook's routes take; the webhook's page lists "
        "recent deliveries with a “Test delivery” button.",
    ]


# Gitea mirrors GitHub's payload shapes, so its titles are GitHub's.
SENDER = Sender(
    source=Source.GITEA, verify=verify, derive_kind=kind_with_action,
    derive_title=github.derive_title, setup_steps=setup_steps, read_actor=read_actor,
    reads_roles=True, takes_forms=True, redelivers_under_its_id=True,
    event_headers=("x-forgejo-event", "x-gitea-event"),
    kind_origin="the X-Forgejo-Event or X-Gitea-Event header, then the payload's action",
    delivery_headers=("x-forgejo-delivery", "x-gitea-delivery"),
    # Gitea or Forgejo: a token and the instance's own api_url; no write-back client yet.
    connections=(ConnectionSpec(kind="gitea", default_api_url=""),))
