"""GitLab: the secret token itself in X-Gitlab-Token, kinds from the event header and the
object's action, the actor's username and no roles (docs/senders.md#the-other-sources-briefly)."""

from . import ConnectionSpec, Sender
from ..actors import Actor, dict_of, text_of
from ..models import Source, TrustMode
from ..titles import branch, commits, dig, first, text
from ..verification import (Envelope, VerificationFailed, accepted_secrets, as_bytes,
                            matches_any, require_header)


def verify(webhook, headers, body, now) -> Envelope:
    given = require_header(headers, "X-Gitlab-Token")
    expected = [as_bytes(secret) for secret in accepted_secrets(webhook, now)]
    if not matches_any(expected, [as_bytes(given)]):
        raise VerificationFailed("token mismatch")
    delivery = headers.get("Idempotency-Key") or headers.get("X-Gitlab-Event-UUID", "")
    return Envelope(TrustMode.SIGNED, delivery, headers.get("X-Gitlab-Event", ""))


def derive_kind(event: str, payload) -> str:
    # "Merge Request Hook" -> "merge_request"; the action lives in object_attributes.
    kind = text(event).lower().removesuffix(" hook").replace(" ", "_")
    action = dig(payload, "object_attributes", "action")
    if kind and isinstance(action, str) and action:
        kind = f"{kind}.{action}"
    return kind


def derive_title(kind: str, payload: dict, webhook_slug: str = "") -> str:
    event, _, action = kind.partition(".")
    project = first(dig(payload, "project", "path_with_namespace"), dig(payload, "project", "name"))
    where = project or "GitLab"
    attributes = dict_of(payload.get("object_attributes"))
    if event == "merge_request":
        return f"{where}!{text(attributes.get('iid'))} {action or 'updated'}: {text(attributes.get('title'))}"
    if event == "issue":
        return f"{where}#{text(attributes.get('iid'))} {action or 'updated'}: {text(attributes.get('title'))}"
    if event in ("push", "tag_push"):
        who = first(payload.get("user_username"), payload.get("user_name"))
        count = payload.get("total_commits_count")
        count = count if isinstance(count, int) else 0
        return f"{where}: {who or 'someone'} pushed {commits(count)} to {branch(payload.get('ref'))}"
    if event == "note":
        return (f"{where} comment by {first(dig(payload, 'user', 'username')) or 'someone'}: "
                f"{text(attributes.get('note'))}")
    return f"{where}: {kind or 'event'}"


def read_actor(kind: str, payload: dict) -> Actor:
    """``user.username`` (``user_username`` on push events). GitLab payloads carry no role at
    all, so a GitLab route can trust logins only."""
    return Actor(text_of(dict_of(payload.get("user")).get("username"))
                 or text_of(payload.get("user_username")))


def setup_steps(hook_url: str, slug: str) -> list[str]:
    return [
        "Project (or group) → Settings → Webhooks → Add new webhook.",
        f"URL: {hook_url}",
        "Secret token: the secret add_webhook printed (GitLab sends it as "
        "X-Gitlab-Token).",
        "Trigger: the events this webhook's routes take (Issues, Merge requests, "
        "Pipelines, …); “Edit” → “Recent events” shows each request.",
    ]


SENDER = Sender(
    source=Source.GITLAB, verify=verify, derive_kind=derive_kind, derive_title=derive_title,
    setup_steps=setup_steps, read_actor=read_actor, redelivers_under_its_id=True,
    kind_origin="the X-Gitlab-Event header, then object_attributes.action",
    event_headers=("x-gitlab-event",), delivery_headers=("idempotency-key", "x-gitlab-event-uuid"),
    # A project or group access token; no write-back client yet (docs/write-back.md).
    connections=(ConnectionSpec(kind="gitlab", default_api_url="https://gitlab.com/api/v4"),))
