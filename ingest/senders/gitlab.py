"""GitLab: the secret token itself in X-Gitlab-Token, kinds from the event header and the
object's action, the actor's username and no roles (docs/senders.md#the-other-sources-briefly);
and the client of its connections, a project, group or personal access token
(docs/write-back.md#gitlab)."""

from . import (ConnectionSpec, Identity, Sender, WriteBackClient, checked_page, find_marked,
               github, is_connection_identity, send_living_status)
from .. import outbound
from ..actors import Actor, dict_of, text_of
from ..models import Source, TrustMode
from ..titles import branch, commits, dig, first, text, whole_number
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


# -- the connection's client (docs/write-back.md#gitlab) ----------------------------------------

DEFAULT_API_URL = "https://gitlab.com/api/v4"
# Where a delivery's issue or merge request lives in the API and on the web, by the event (an
# issue's, a merge request's) or, for a note, by its noteable_type; a note on a commit or a
# snippet has nothing switchboard writes on.
_NOUNS = {"issue": "issues", "confidential_issue": "issues", "merge_request": "merge_requests"}
_NOTEABLES = {"Issue": ("issues", "issue"), "MergeRequest": ("merge_requests", "merge_request")}
# The marker look reads the newest notes first, one page of them: the status was posted by the
# send that died, a minute or so before, so it is among the latest changed.
MARKER_LOOK_PAGE = 100


def identify(connection, now) -> Identity:
    """The token's user at GitLab (``GET /user``): its username and id. A project or group
    access token has a bot user of its own (``project_123_bot_…``)."""
    answer = outbound.send(connection.api_url, "GET", "/user", token=connection.secret, now=now)
    user = dict_of(answer.body)
    if not user.get("username"):
        raise outbound.SourceError("GET /user did not answer with a username")
    return Identity(login=str(user["username"]), id=str(user.get("id", "")))


def find_target(kind: str, payload: dict):
    """The issue or merge request a delivery is about, and the note when it is about one:
    ``({"project", "path", "noun", "iid", "note"}, "group/project#N")`` (``!N`` for a merge
    request), or None for an event with nothing to react to (a push, a pipeline, a note on a
    commit) or whose ids do not pass ``outbound``'s checks."""
    event = kind.partition(".")[0]
    attributes = dict_of(payload.get("object_attributes"))
    if event in _NOUNS:
        noun, iid, note = _NOUNS[event], attributes.get("iid"), None
    elif event in ("note", "confidential_note") and attributes.get("noteable_type") in _NOTEABLES:
        noun, subject = _NOTEABLES[attributes["noteable_type"]]
        iid, note = dig(payload, subject, "iid"), attributes.get("id")
    else:
        return None
    project = dict_of(payload.get("project"))
    try:
        target = {"project": outbound.number_segment(first(project.get("id"),
                                                           payload.get("project_id"))),
                  "path": _checked_path(project.get("path_with_namespace")),
                  "noun": noun, "iid": outbound.number_segment(iid),
                  "note": outbound.number_segment(note) if note is not None else None}
    except outbound.SourceError:
        return None
    sign = "!" if noun == "merge_requests" else "#"
    label = f"{target['path'] or 'project ' + target['project']}{sign}{target['iid']}"
    return target, label + (f" note {target['note']}" if target["note"] else "")


def _checked_path(path) -> str:
    """A project's ``group/sub/project`` for its web page, each part a name; "" otherwise."""
    if not isinstance(path, str) or not path:
        return ""
    try:
        return "/".join(outbound.name_segment(part) for part in path.split("/"))
    except outbound.SourceError:
        return ""


def _noun(target) -> str:
    # The API's and the web pages' word for it alike: issues, merge_requests.
    if target.get("noun") not in ("issues", "merge_requests"):
        raise outbound.SourceError(f"not an issue or merge request: {target.get('noun')!r}")
    return target["noun"]


def _send(connection, target, method, path, now, body=None):
    base = (f"/projects/{outbound.number_segment(target['project'])}/{_noun(target)}/"
            f"{outbound.number_segment(target['iid'])}")
    return outbound.send(connection.api_url, method, base + path, token=connection.secret,
                         json=body, now=now)


def send_ack(connection, target, now) -> str:
    """The ``eyes`` award emoji on the note the delivery is about, else on the issue or merge
    request. GitLab refuses a second award of the same emoji by the same user (404, "has
    already been taken"): that one counts as done."""
    path = f"/notes/{outbound.number_segment(target['note'])}" if target.get("note") else ""
    try:
        answer = _send(connection, target, "POST", f"{path}/award_emoji", now, {"name": "eyes"})
    except outbound.SourceError as failed:
        if failed.status == 404 and "has already been taken" in failed.message:
            return ""
        raise
    return str(dict_of(answer.body).get("id", ""))


def send_status(connection, target, update, external_id: str, now, look_since) -> str:
    """The living status: the note ``external_id`` edited (``PUT``), or one posted on the issue
    or merge request, the update's text after the todo's marker; posted again when someone
    deleted it."""
    marker = github.STATUS_MARKER.format(todo_id=update.todo_id)
    body = {"body": f"{marker}\n{update.text}"}

    def look():
        answer = _send(connection, target, "GET",
                       f"/notes?order_by=updated_at&sort=desc&per_page={MARKER_LOOK_PAGE}", now)
        return find_marked(answer.body, marker, connection.identity, body_key="body",
                           author_of=lambda note: text_of(dict_of(note.get("author"))
                                                          .get("username")))

    return send_living_status(
        external_id, look_since, look=look,
        post=lambda: _send(connection, target, "POST", "/notes", now, body),
        edit=lambda found: _send(connection, target, "PUT",
                                 f"/notes/{outbound.number_segment(found)}", now, body))


def target_url(connection, target) -> str:
    """The issue, merge request or note on GitLab's web pages: the ``api_url`` without its
    ``/api/v4``, then the project's path (from the delivery, each part checked)."""
    path = _checked_path(target.get("path"))
    if not path:
        return ""
    return checked_page(lambda: (f"{outbound.web_root(connection.api_url, '/api/v4')}/{path}/-/"
                                 f"{_noun(target)}/{outbound.number_segment(target['iid'])}"),
                        "note_", target.get("note"))


def is_own_write_back(connection, kind: str, payload: dict) -> bool:
    """The delivery's ``user`` (``user_username``/``user_id`` on a push) is the token's own:
    its username or its id."""
    user = dict_of(payload.get("user"))
    return is_connection_identity(
        connection, text_of(user.get("username")) or text_of(payload.get("user_username")),
        first(user.get("id"), payload.get("user_id")))


# What ends a thread (docs/work-control.md#threads): an issue closed, a merge request closed
# or merged (GitLab's object_attributes.action).
STOP_KINDS = ("issue.close", "confidential_issue.close", "merge_request.close",
              "merge_request.merge")


def thread_key(kind: str, payload: dict) -> str:
    """``<project path>#<iid>`` of an issue, ``<project path>!<iid>`` of a merge request, for
    their events and the notes on them; "" otherwise."""
    event = kind.partition(".")[0]
    attributes = dict_of(payload.get("object_attributes"))
    if event in _NOUNS:
        noun, iid = _NOUNS[event], attributes.get("iid")
    elif event in ("note", "confidential_note") and attributes.get("noteable_type") in _NOTEABLES:
        noun, subject = _NOTEABLES[attributes["noteable_type"]]
        iid = dig(payload, subject, "iid")
    else:
        return ""
    path, iid = text(dig(payload, "project", "path_with_namespace")), whole_number(iid)
    sign = "!" if noun == "merge_requests" else "#"
    return f"{path}{sign}{iid}" if path and iid else ""


def ends_thread(kind: str, payload: dict) -> bool:
    return kind in STOP_KINDS


SENDER = Sender(
    source=Source.GITLAB, verify=verify, derive_kind=derive_kind, derive_title=derive_title,
    setup_steps=setup_steps, read_actor=read_actor, redelivers_under_its_id=True,
    kind_origin="the X-Gitlab-Event header, then object_attributes.action",
    event_headers=("x-gitlab-event",), delivery_headers=("idempotency-key", "x-gitlab-event-uuid"),
    connections=(ConnectionSpec(kind="gitlab", default_api_url=DEFAULT_API_URL, identify=identify,
                                check_secret=github.check_token),),
    write_back=WriteBackClient(find_target=find_target, ack=send_ack, status=send_status,
                               target_url=target_url),
    is_own_write_back=is_own_write_back, thread_key=thread_key, ends_thread=ends_thread,
    stop_kinds=STOP_KINDS)
