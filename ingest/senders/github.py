"""GitHub: HMAC-SHA256 of the body in X-Hub-Signature-256, JSON or form posts, the actor's
role from the object the event is about (docs/senders.md#the-other-sources-briefly)."""

from . import Sender
from ..actors import Actor, dict_of, text_of
from ..models import Source, TrustMode
from ..titles import branch, commits, dig, first, kind_with_action, text
from ..verification import (Envelope, VerificationFailed, accepted_secrets, as_bytes, hmac_hex,
                            matches_any, require_header)

# Where a payload keeps the object the event is about, most specific first.
SUBJECTS = ("comment", "review", "pull_request", "issue", "discussion")


def verify(webhook, headers, body, now) -> Envelope:
    given = require_header(headers, "X-Hub-Signature-256")
    if not given.startswith("sha256="):
        raise VerificationFailed("X-Hub-Signature-256 is not sha256=<hex>")
    expected = [hmac_hex(secret, body) for secret in accepted_secrets(webhook, now)]
    if not matches_any(expected, [as_bytes(given[len("sha256="):].lower())]):
        raise VerificationFailed("signature mismatch")
    return Envelope(TrustMode.SIGNED, headers.get("X-GitHub-Delivery", ""),
                    headers.get("X-GitHub-Event", ""))


def derive_title(kind: str, payload: dict, webhook_slug: str = "") -> str:
    event, _, action = kind.partition(".")
    repo = first(dig(payload, "repository", "full_name"), dig(payload, "repository", "name"))
    where = repo or "GitHub"
    if event == "issues":
        return (f"{where}#{text(dig(payload, 'issue', 'number'))} {action or 'updated'}: "
                f"{text(dig(payload, 'issue', 'title'))}")
    if event == "pull_request":
        number = first(dig(payload, "pull_request", "number"), payload.get("number"))
        return (f"{where}#{number} pull request {action or 'updated'}: "
                f"{text(dig(payload, 'pull_request', 'title'))}")
    if event == "issue_comment":
        who = first(dig(payload, "comment", "user", "login"), dig(payload, "sender", "login"))
        return (f"{where}#{text(dig(payload, 'issue', 'number'))} comment {action or 'added'} "
                f"by {who or 'someone'}: {text(dig(payload, 'issue', 'title'))}")
    if event == "push":
        who = first(dig(payload, "pusher", "name"), dig(payload, "pusher", "login"),
                    dig(payload, "pusher", "username"), dig(payload, "sender", "login"))
        pushed = payload.get("commits")
        count = len(pushed) if isinstance(pushed, list) else 0
        return f"{where}: {who or 'someone'} pushed {commits(count)} to {branch(payload.get('ref'))}"
    if event == "check_run":
        name = text(dig(payload, "check_run", "name"))
        outcome = first(dig(payload, "check_run", "conclusion"), dig(payload, "check_run", "status"))
        return f"{where} check {name} {action or 'updated'}: {outcome or 'unknown'}"
    if event == "ping":
        return f"{where} ping: {text(payload.get('zen'))}"
    return f"{where}: {kind or 'event'}"


def read_actor(kind: str, payload: dict) -> Actor:
    """``sender.login``; its role is the ``author_association`` of the object the event is
    about, but only when the sender wrote that object: on ``issues.labeled`` by a maintainer,
    the issue's association is the issue author's, not the labeller's, so the labeller
    qualifies by login only."""
    login = text_of(dict_of(payload.get("sender")).get("login"))
    for key in SUBJECTS:
        subject = dict_of(payload.get(key))
        if subject:
            author = text_of(dict_of(subject.get("user")).get("login"))
            association = text_of(subject.get("author_association"))
            if login and author.lower() == login.lower() and association:
                return Actor(login, frozenset({association.upper()}))
            break
    return Actor(login)


def setup_steps(hook_url: str, slug: str) -> list[str]:
    return [
        "Repository (or organisation) → Settings → Webhooks → Add webhook.",
        f"Payload URL: {hook_url}",
        "Content type: application/json",
        "Secret: the secret add_webhook printed (rotate_webhook_secret mints a new one).",
        "Which events: “Let me select individual events” and tick the ones this "
        "webhook's routes take (Issues, Pull requests, Workflow runs, …).",
        "After saving, the webhook's “Recent deliveries” tab shows each request and "
        "answer; “Redeliver” there re-sends one.",
    ]


SENDER = Sender(
    source=Source.GITHUB, verify=verify, derive_kind=kind_with_action, derive_title=derive_title,
    setup_steps=setup_steps, read_actor=read_actor, reads_roles=True, takes_forms=True,
    redelivers_under_its_id=True,
    kind_origin="the X-GitHub-Event header, then the payload's action",
    event_headers=("x-github-event",), delivery_headers=("x-github-delivery",))
