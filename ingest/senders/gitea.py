"""Gitea and Forgejo: HMAC-SHA256 of the body (Forgejo sends its own X-Forgejo-* headers and,
for compatibility, the X-Gitea-* ones), GitHub's payload shapes, the sender's permission as
its role where it is the sender's own (docs/senders.md#the-other-sources-briefly); and the
client of its connections, a token and the instance's api_url
(docs/write-back.md#gitea-and-forgejo)."""

from datetime import timezone as dt_timezone

from . import (ConnectionSpec, Identity, Sender, WriteBackClient, checked_page, find_marked,
               github, is_connection_identity, send_living_status)
from .. import outbound
from ..actors import Actor, dict_of, text_of
from ..models import Source, TrustMode
from ..titles import dig, first, kind_with_action, text, whole_number
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


# -- the connection's client (docs/write-back.md#gitea-and-forgejo) ----------------------------

# Gitea's description takes a token as "Authorization: token <token>", which every Gitea and
# Forgejo release reads (Bearer only on the newer ones).
AUTH_SCHEME = "token"
# The events whose payload names an issue or pull request (Gitea's X-Gitea-Event values; a pull
# request's review and review comments come as pull_request_approved, _rejected, _comment).
_SUBJECTS = {"issues": "issue", "issue_comment": "issue", "pull_request": "pull_request",
             "pull_request_approved": "pull_request", "pull_request_rejected": "pull_request",
             "pull_request_comment": "pull_request"}


def identify(connection, now) -> Identity:
    """The token's user at the instance (``GET /user``): its login and id."""
    answer = outbound.send(connection.api_url, "GET", "/user", token=connection.secret,
                           auth_scheme=AUTH_SCHEME, now=now)
    user = dict_of(answer.body)
    if not user.get("login"):
        raise outbound.SourceError("GET /user did not answer with a login")
    return Identity(login=str(user["login"]), id=str(user.get("id", "")))


def find_target(kind: str, payload: dict):
    """The issue or pull request a delivery is about (a pull request is an issue of the same
    index), and the comment on an ``issue_comment``: ``({"owner", "repo", "number",
    "comment"}, "owner/repo#N")``, or None for an event with nothing to react to (a push, a
    release) or whose names do not pass ``outbound``'s checks."""
    event = kind.partition(".")[0]
    if event not in _SUBJECTS:
        return None
    repository = dict_of(payload.get("repository"))
    owner = dict_of(repository.get("owner"))
    try:
        target = {
            "owner": outbound.name_segment(first(owner.get("login"), owner.get("username"))),
            "repo": outbound.name_segment(repository.get("name")),
            "number": outbound.number_segment(first(dig(payload, _SUBJECTS[event], "number"),
                                                    payload.get("number"))),
            "comment": (outbound.number_segment(dig(payload, "comment", "id"))
                        if event == "issue_comment" else None),
        }
    except outbound.SourceError:
        return None
    label = f"{target['owner']}/{target['repo']}#{target['number']}"
    return target, label + (f" comment {target['comment']}" if target["comment"] else "")


def _send(connection, target, method, path, now, body=None):
    base = (f"/repos/{outbound.name_segment(target['owner'])}/"
            f"{outbound.name_segment(target['repo'])}/issues")
    return outbound.send(connection.api_url, method, base + path, token=connection.secret,
                         auth_scheme=AUTH_SCHEME, json=body, now=now)


def send_ack(connection, target, now) -> str:
    """The ``eyes`` reaction on the comment the delivery is about, else on the issue or pull
    request. Gitea answers 200 for one that is already there, so a repeat adds nothing; a
    reaction has no id of its own ("" is kept)."""
    if target.get("comment"):
        path = f"/comments/{outbound.number_segment(target['comment'])}/reactions"
    else:
        path = f"/{outbound.number_segment(target['number'])}/reactions"
    answer = _send(connection, target, "POST", path, now, {"content": "eyes"})
    return str(dict_of(answer.body).get("id", ""))


def send_status(connection, target, update, external_id: str, now, look_since) -> str:
    """The living status: the comment ``external_id`` edited, or one posted on the issue or
    pull request, the update's text after the todo's marker; posted again when someone
    deleted it."""
    number = outbound.number_segment(target["number"])
    marker = github.STATUS_MARKER.format(todo_id=update.todo_id)
    body = {"body": f"{marker}\n{update.text}"}

    def look():
        # Only comments changed since the write-back was made: one answer holds them, however
        # long the thread.
        since = look_since.astimezone(dt_timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        answer = _send(connection, target, "GET", f"/{number}/comments?since={since}", now)
        return find_marked(answer.body, marker, connection.identity, body_key="body",
                           author_of=github.comment_author)

    return send_living_status(
        external_id, look_since, look=look,
        post=lambda: _send(connection, target, "POST", f"/{number}/comments", now, body),
        edit=lambda found: _send(connection, target, "PATCH",
                                 f"/comments/{outbound.number_segment(found)}", now, body))


def target_url(connection, target) -> str:
    """The issue, pull request or comment on the instance's web pages: the ``api_url``
    without its ``/api/v1``. Gitea sends an ``/issues/N`` of a pull request on to its
    ``/pulls/N``."""
    return checked_page(lambda: (f"{outbound.web_root(connection.api_url, '/api/v1')}/"
                                 f"{outbound.name_segment(target['owner'])}/"
                                 f"{outbound.name_segment(target['repo'])}/issues/"
                                 f"{outbound.number_segment(target['number'])}"),
                        "issuecomment-", target.get("comment"))


def is_own_write_back(connection, kind: str, payload: dict) -> bool:
    """The delivery's ``sender`` is the token's user: its login or its id."""
    sender = dict_of(payload.get("sender"))
    return is_connection_identity(
        connection, text_of(sender.get("login")) or text_of(sender.get("username")),
        sender.get("id"))


# Gitea mirrors GitHub's payload shapes, so its titles are GitHub's.
def thread_key(kind: str, payload: dict) -> str:
    """``<owner>/<repo>#<number>`` for the issue and pull request events and their comments
    and reviews (Gitea names more of them than GitHub: ``pull_request_approved`` …)."""
    event = kind.partition(".")[0]
    if not event.startswith(("issue", "pull_request")):
        return ""
    number = (whole_number(dig(payload, "issue", "number"))
              or whole_number(dig(payload, "pull_request", "number"))
              or whole_number(payload.get("number")))
    repo = text(dig(payload, "repository", "full_name"))
    return f"{repo}#{number}" if repo and number else ""


SENDER = Sender(
    source=Source.GITEA, verify=verify, derive_kind=kind_with_action,
    derive_title=github.derive_title, setup_steps=setup_steps, read_actor=read_actor,
    reads_roles=True, takes_forms=True, redelivers_under_its_id=True,
    event_headers=("x-forgejo-event", "x-gitea-event"),
    kind_origin="the X-Forgejo-Event or X-Gitea-Event header, then the payload's action",
    delivery_headers=("x-forgejo-delivery", "x-gitea-delivery"),
    # Gitea or Forgejo: a token and the instance's own api_url (no default).
    connections=(ConnectionSpec(kind="gitea", default_api_url="", identify=identify,
                                check_secret=github.check_token),),
    write_back=WriteBackClient(find_target=find_target, ack=send_ack, status=send_status,
                               target_url=target_url),
    is_own_write_back=is_own_write_back, thread_key=thread_key,
    ends_thread=github.ends_thread, stop_kinds=github.STOP_KINDS)
