"""Linear: HMAC-SHA256 of the body in Linear-Signature, and its webhookTimestamp inside the
signed body within a minute; a secret Linear mints (docs/senders.md#linear). And the client of
its connections, an app installed with actor=app or an API key (docs/write-back.md#linear)."""

import hashlib
import re
import uuid
from datetime import datetime, timedelta, timezone as dt_timezone
from urllib.parse import urlsplit

from django.conf import settings

from todos.models import State

from . import ConnectionSpec, Identity, Sender, WriteBackClient
from .. import outbound, status_text
from ..actors import dict_of, text_of
from ..models import Source, TrustMode
from ..titles import dig, first, kind_with_action, text
from ..verification import (Envelope, VerificationFailed, accepted_secrets, as_bytes,
                            check_within, hmac_hex, matches_any, require_header)

# Linear signs its timestamp inside the body (webhookTimestamp, in milliseconds) and asks
# receivers to refuse anything more than a minute off.
TIMESTAMP_TOLERANCE = timedelta(seconds=60)
# Milliseconds since the epoch, as a JavaScript sender can write them exactly (2**53 - 1): a
# JSON integer has no size of its own, and a larger one overflows the float it is compared as.
MAX_TIMESTAMP_MS = 2**53 - 1
ACTION_WORDS = {"create": "created", "update": "updated", "remove": "removed"}


def verify(webhook, headers, body, now) -> Envelope:
    given = require_header(headers, "Linear-Signature")
    expected = [hmac_hex(secret, body) for secret in accepted_secrets(webhook, now)]
    if not matches_any(expected, [as_bytes(given.strip().lower())]):
        raise VerificationFailed("signature mismatch")
    # The body carries its own signed timestamp (checked once parsed: check_payload), so the
    # body is the signed request: timestamped, like Stripe's "<t>.<body>".
    return Envelope(TrustMode.SIGNED, headers.get("Linear-Delivery", ""),
                    headers.get("Linear-Event", ""), hashlib.sha256(body).hexdigest())


def check_payload(payload: dict, now) -> None:
    stamp = payload.get("webhookTimestamp")
    if stamp is None:
        raise VerificationFailed("missing webhookTimestamp in the body")
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
        raise VerificationFailed("webhookTimestamp is not a number of milliseconds")
    if not 0 <= stamp <= MAX_TIMESTAMP_MS:
        raise VerificationFailed(
            f"webhookTimestamp must be 0 to {MAX_TIMESTAMP_MS} milliseconds", malformed=True)
    check_within(stamp / 1000, now, TIMESTAMP_TOLERANCE)


def derive_kind(event: str, payload) -> str:
    # "<type>.<action>" from the signed body: Issue.create, AgentSessionEvent.created.
    return kind_with_action(payload.get("type"), payload) if isinstance(payload, dict) else ""


def derive_title(kind: str, payload: dict, webhook_slug: str = "") -> str:
    kind_type, _, action = kind.partition(".")
    done = ACTION_WORDS.get(action, action or "updated")
    data = payload.get("data") if isinstance(payload.get("data"), dict) else {}
    if kind_type == "Issue":
        return f"{text(data.get('identifier')) or 'Linear issue'} {done}: {text(data.get('title'))}"
    if kind_type == "Comment":
        issue = first(dig(data, "issue", "identifier"), dig(data, "issue", "title"))
        return f"{issue or 'Linear'} comment {done}: {text(data.get('body'))}"
    if kind_type == "AgentSessionEvent":
        session = payload.get("agentSession") if isinstance(payload.get("agentSession"), dict) else {}
        issue = text(dig(session, "issue", "identifier"))
        prompt = first(dig(payload, "agentActivity", "body"),
                       dig(payload, "agentActivity", "content", "body"),
                       dig(session, "comment", "body"), dig(session, "issue", "title"))
        return f"{issue or 'Linear'} agent session {action or 'event'}: {prompt}"
    what = first(data.get("identifier"), data.get("title"), data.get("name"), data.get("body"))
    return f"Linear {kind or 'event'}" + (f": {what}" if what else "")


def setup_steps(hook_url: str, slug: str) -> list[str]:
    return [
        "Linear mints the secret: Settings → API → Webhooks → New webhook, "
        f"URL {hook_url}, pick the resource types.",
        "Its signing secret (lin_wh_…) is the one add_webhook … --secret took; when "
        f"Linear's changes, paste the new one: manage.py rotate_webhook_secret {slug} "
        "--secret 'lin_wh_…'.",
    ]


# -- the connection's client (docs/write-back.md#linear) -------------------------------------------

DEFAULT_API_URL = "https://api.linear.app/graphql"
# A personal API key; anything else is an OAuth access token (docs/write-back.md#linear).
API_KEY_PREFIX = "lin_api_"
# Linear's ids: UUIDs. An issue's identifier is its team's key and number (ENG-123); a
# workspace's URL key is lower-case letters, digits and "-".
_UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.I)
_IDENTIFIER_RE = re.compile(r"([A-Z0-9][A-Z0-9_]{0,9})-[1-9][0-9]{0,9}")
_WORKSPACE_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
WEB_URL = "https://linear.app"
# The kinds a todo is written back on: an agent session (created, or prompted again), an issue
# or a comment (not its removal: nothing is left to write on).
AGENT_SESSION_ACTIONS = ("created", "prompted")
ENTITY_TYPES = ("Issue", "Comment")
# A GraphQL error's extensions.type, as @linear/sdk classifies errors by it.
RATELIMITED, AUTHENTICATION_ERROR = "ratelimited", "authentication error"

VIEWER_QUERY = "query Viewer { viewer { id name } }"
ACTIVITY_CREATE = ("mutation ActivityCreate($input: AgentActivityCreateInput!) {"
                   " agentActivityCreate(input: $input) { success agentActivity { id } } }")
ACTIVITY_FIND = "query ActivityFind($id: String!) { agentActivity(id: $id) { id } }"
ACTIVITY_KIND = ("query ActivityKind($id: String!) {"
                 " agentActivity(id: $id) { ephemeral content { __typename } } }")
REACTION_CREATE = ("mutation ReactionCreate($input: ReactionCreateInput!) {"
                   " reactionCreate(input: $input) { success reaction { id } } }")
COMMENT_CREATE = ("mutation CommentCreate($input: CommentCreateInput!) {"
                  " commentCreate(input: $input) { success comment { id } } }")
COMMENT_UPDATE = ("mutation CommentUpdate($id: String!, $input: CommentUpdateInput!) {"
                  " commentUpdate(id: $id, input: $input) { success comment { id } } }")
COMMENT_FIND = "query CommentFind($id: String!) { comment(id: $id) { id } }"


def check_secret(secret: str) -> None:
    if (not secret or len(secret) > 1000
            or any(ch.isspace() or not ch.isprintable() for ch in secret)):
        raise ValueError("not a Linear token: an OAuth access token or an API key (lin_api_…)")


def graphql(connection, query: str, variables: dict | None, now) -> dict:
    """``query`` with ``variables`` against the connection's api_url: the answer's ``data``, or
    SourceError. Linear takes an API key as the Authorization header itself and an OAuth
    token after "Bearer", as @linear/sdk sends them."""
    answer = outbound.send(
        connection.api_url, "POST", "", token=connection.secret, now=now,
        auth_scheme="" if connection.secret.startswith(API_KEY_PREFIX) else "Bearer",
        read_errors=read_errors,
        headers={"Content-Type": "application/json"},
        json={"query": query, "variables": variables or {}})
    data = dict_of(answer.body).get("data")
    if not isinstance(data, dict):
        raise outbound.SourceError("Linear answered without data")
    return data


def read_errors(response, now) -> outbound.SourceError | None:
    """Linear's GraphQL errors, whatever the HTTP status beside them: a rate limit waits until
    the window Linear names resets (``x-ratelimit-requests-reset`` or
    ``x-ratelimit-complexity-reset``, epoch milliseconds; ``Retry-After`` first); an
    authentication error is the connection's, recorded as a 401 whatever the status said;
    any other fails with Linear's own message. None when the body carries no error."""
    errors = dict_of(outbound.json_of(response)).get("errors")
    if not isinstance(errors, list) or not errors:
        return None
    error = dict_of(errors[0])
    extensions = dict_of(error.get("extensions"))
    kind = text_of(extensions.get("type")).lower()
    code = text_of(extensions.get("code")).upper()
    said = first(extensions.get("userPresentableMessage"), error.get("message")) or "error"
    message = f"{code or response.status_code}: {outbound.printable(said)}"
    if kind == RATELIMITED or code == "RATELIMITED" or response.status_code == 429:
        return outbound.SourceError(message, status=response.status_code, retryable=True,
                                    retry_at=_rate_limit_reset(response.headers, now))
    if kind == AUTHENTICATION_ERROR or code == "AUTHENTICATION_ERROR":
        return outbound.SourceError(message, status=401)
    if response.status_code >= 500:
        return outbound.SourceError(message, status=response.status_code, retryable=True)
    return outbound.SourceError(message, status=response.status_code)


def _rate_limit_reset(headers, now) -> datetime | None:
    said = outbound.retry_at(headers, now)
    if said is not None:
        return said
    resets = [int(value) for value in (headers.get("x-ratelimit-requests-reset", "").strip(),
                                       headers.get("x-ratelimit-complexity-reset", "").strip())
              if value.isdigit()]
    return datetime.fromtimestamp(max(resets) / 1000, tz=dt_timezone.utc) if resets else None


def identify(connection, now) -> Identity:
    """Who the connection is at Linear: the ``viewer`` (an app installed with actor=app is its
    own app user), its name and id."""
    viewer = dict_of(graphql(connection, VIEWER_QUERY, None, now).get("viewer"))
    if not viewer.get("id") or not viewer.get("name"):
        raise outbound.SourceError("viewer did not answer with an id and a name")
    return Identity(login=str(viewer["name"]), id=str(viewer["id"]))


# -- writing back (docs/write-back.md#linear) -----------------------------------------------------


def _linear_id(value) -> str:
    """A Linear id taken from a payload (a UUID), or SourceError."""
    if not isinstance(value, str) or not _UUID_RE.fullmatch(value):
        raise outbound.SourceError(f"not a Linear id: {str(value)[:60]!r}")
    return value.lower()


def _issue_page(issue: dict) -> dict:
    """The parts of an issue's page on linear.app, each checked: the workspace's URL key (read
    from the issue's url, whose host must be linear.app) and the identifier (its team's key
    when the payload names the team). Empty when any does not pass."""
    identifier = text_of(issue.get("identifier"))
    parts = urlsplit(text_of(issue.get("url")))
    segments = parts.path.split("/")
    team_key = text_of(dict_of(issue.get("team")).get("key"))
    found = _IDENTIFIER_RE.fullmatch(identifier)
    if (parts.scheme != "https" or parts.netloc != "linear.app" or len(segments) < 4
            or not _WORKSPACE_RE.fullmatch(segments[1]) or segments[2] != "issue"
            or found is None or (team_key and found.group(1) != team_key)):
        return {}
    return {"workspace": segments[1], "identifier": identifier}


def find_target(kind: str, payload: dict):
    """What a delivery writes back on: an agent session (``session``, and the prompt's
    activity for ``prompted``), else the issue and the comment it is about; with the issue's
    page parts. None for other kinds or ids that do not pass."""
    kind_type, _, action = kind.partition(".")
    try:
        if kind_type == "AgentSessionEvent" and action in AGENT_SESSION_ACTIONS:
            session = dict_of(payload.get("agentSession"))
            prompt = dict_of(payload.get("agentActivity")).get("id")
            issue = dict_of(session.get("issue"))
            target = {"session": _linear_id(session.get("id")),
                      "prompt": _linear_id(prompt) if prompt else "", **_issue_page(issue)}
            return target, f"{issue.get('identifier') or 'Linear'} agent session"
        if kind_type not in ENTITY_TYPES or action == "remove":
            return None
        data = dict_of(payload.get("data"))
        if kind_type == "Issue":
            target = {"issue": _linear_id(data.get("id")), "comment": "", **_issue_page(data)}
        else:
            target = {"issue": _linear_id(data.get("issueId")),
                      "comment": _linear_id(data.get("id")),
                      **_issue_page(dict_of(data.get("issue")))}
    except outbound.SourceError:
        return None
    label = target.get("identifier") or "Linear issue"
    return target, label + (" comment" if target["comment"] else "")


def target_url(connection, target) -> str:
    """The issue's page on linear.app from its checked workspace key and identifier, or ""."""
    workspace, identifier = target.get("workspace", ""), target.get("identifier", "")
    if not (_WORKSPACE_RE.fullmatch(workspace) and _IDENTIFIER_RE.fullmatch(identifier)):
        return ""
    return f"{WEB_URL}/{workspace}/issue/{identifier}"


def stable_id(*parts) -> str:
    """A UUID in version 4's form (what Linear takes as a client-chosen id) that is the same
    for the same ``parts``: a send repeated after its worker died names the entity the first
    one created, so Linear refuses a second and the repeat finds the first."""
    digest = hashlib.sha256("\x1f".join(str(part) for part in parts).encode()).digest()
    return str(uuid.UUID(bytes=digest[:16], version=4))


def _create_once(connection, create: str, find: str, variables: dict, now, *,
                 look_first: bool) -> bool:
    """Create the entity whose client-chosen id is ``variables["input"]["id"]``, once: True
    when this call created it, False when it was there already (looked for first when
    ``look_first``; else found after Linear refused the id as taken)."""
    entity_id = variables["input"]["id"]
    if look_first and _exists(connection, find, entity_id, now):
        return False
    try:
        graphql(connection, create, variables, now)
    except outbound.SourceError as failed:
        if failed.retryable or failed.status == 401 or not _exists(connection, find, entity_id,
                                                                   now):
            raise
        return False
    return True


def _exists(connection, find: str, entity_id: str, now) -> bool:
    try:
        graphql(connection, find, {"id": entity_id}, now)
    except outbound.SourceError as failed:
        if failed.retryable or failed.status == 401 or not _is_not_found(failed):
            raise
        return False
    return True


def _is_not_found(failed: outbound.SourceError) -> bool:
    # Linear's answer for an id that names nothing: "Entity not found: Comment".
    return "not found" in failed.message.lower() or "could not find" in failed.message.lower()


def _todo_page(todo_id) -> str:
    return f"{settings.SWITCHBOARD_PUBLIC_URL}/todos/{todo_id}/"


def send_ack(connection, target, now) -> str:
    """An agent session: a ``thought`` activity saying the work is queued (for a follow-up's
    prompt: passed to the todo's agent), with the todo's page (what Linear waits 10 s for). An
    issue or comment: an ``eyes`` reaction on it."""
    if target.get("session"):
        activity_id = stable_id(connection.pk, "ack", target["session"], target.get("prompt"),
                                target["todo_id"])
        page = status_text.MARKDOWN.link(_todo_page(target["todo_id"]),
                                         f"todo {target['todo_id']} on switchboard")
        # A follow-up (a prompt in the session of a live todo) goes to the todo's agent.
        body = (f"Passed to the agent working on {page}: it hears of this prompt while it works."
                if target.get("followup") else
                f"Queued for an agent: {page}. Progress shows here as it is made.")
        content = {"type": "thought", "body": body}
        _create_once(connection, ACTIVITY_CREATE, ACTIVITY_FIND, {"input": {
            "id": activity_id, "agentSessionId": _linear_id(target["session"]),
            "content": content}},
            now, look_first=False)
        return activity_id
    subject = ({"commentId": _linear_id(target["comment"])} if target.get("comment")
               else {"issueId": _linear_id(target["issue"])})
    data = graphql(connection, REACTION_CREATE, {"input": {**subject, "emoji": "eyes"}}, now)
    return text_of(dict_of(dict_of(data.get("reactionCreate")).get("reaction")).get("id"))


def activity_content(update: status_text.StatusUpdate, *, progress: bool = False) -> dict:
    """The activity a transition appends to an agent session: ``action`` when claimed (a
    ``thought`` for the claim's ``progress``: the agent's latest line), ``response`` when
    done, ``error`` when failed (retrying or for good) or cancelled, a ``thought`` while it
    waits (queued again, scheduled, awaiting approval)."""
    if update.state == State.CLAIMED and progress:
        return {"type": "thought", "body": update.text}
    if update.state == State.CLAIMED:
        return {"type": "action", "action": "Working on",
                "parameter": f"switchboard todo {update.todo_id}", "result": update.text}
    if update.state == State.DONE:
        return {"type": "response", "body": update.text}
    if update.state in (State.FAILED, State.CANCELLED) or update.dead:
        return {"type": "error", "body": update.text}
    return {"type": "thought", "body": update.text}


def send_status(connection, target, update, external_id: str, now, look_since) -> str:
    """An agent session: one activity per send, appended (Linear's activities cannot be
    edited); its id follows from the one before it and the state, so a send repeated after
    its worker died is the same activity. An issue or comment: one comment on the issue,
    edited in place, posted again under a new id when someone deleted it."""
    if target.get("session"):
        activity_id = stable_id(connection.pk, "status", target["session"], update.todo_id,
                                external_id, update.state, update.dead)
        # A claim already reported: this send is the agent's progress, an ephemeral thought
        # that the next activity replaces, rather than one more action in the trail.
        progress = (update.state == State.CLAIMED and bool(external_id)
                    and _reported_work(connection, external_id, now))
        _create_once(connection, ACTIVITY_CREATE, ACTIVITY_FIND, {"input": {
            "id": activity_id, "agentSessionId": _linear_id(target["session"]),
            "content": activity_content(update, progress=progress), "ephemeral": progress}},
            now, look_first=look_since is not None)
        return activity_id
    if external_id:
        try:
            _update_comment(connection, external_id, update.text, now)
            return external_id
        except outbound.SourceError as failed:
            if failed.retryable or failed.status == 401 or not _is_not_found(failed):
                raise
    comment_id = stable_id(connection.pk, "comment", update.todo_id, external_id)
    created = _create_once(connection, COMMENT_CREATE, COMMENT_FIND, {"input": {
        "id": comment_id, "issueId": _linear_id(target["issue"]), "body": update.text}},
        now, look_first=look_since is not None)
    if not created:  # an earlier send posted it: it shows this update from now on
        _update_comment(connection, comment_id, update.text, now)
    return comment_id


def _reported_work(connection, activity_id: str, now) -> bool:
    """The session's last status activity reported the claim or its progress (an action, or
    an ephemeral thought); False when Linear no longer has it."""
    try:
        data = graphql(connection, ACTIVITY_KIND, {"id": _linear_id(activity_id)}, now)
    except outbound.SourceError as failed:
        if failed.retryable or failed.status == 401 or not _is_not_found(failed):
            raise
        return False
    activity = dict_of(data.get("agentActivity"))
    kind = text_of(dict_of(activity.get("content")).get("__typename"))
    return kind == "AgentActivityActionContent" or (
        kind == "AgentActivityThoughtContent" and activity.get("ephemeral") is True)


def _update_comment(connection, comment_id: str, body: str, now) -> None:
    graphql(connection, COMMENT_UPDATE, {"id": _linear_id(comment_id), "input": {"body": body}},
            now)


def is_own_write_back(connection, kind: str, payload: dict) -> bool:
    """Linear content the connection's own user wrote: an Issue or Comment delivery whose
    ``actor`` is the connection's viewer, or a comment whose author (``userId``) is (an app's
    comment may name its OAuth client as the actor); an agent session event prompted by an
    activity the app wrote itself."""
    own = connection.identity_id
    if not own:
        return False
    if kind.partition(".")[0] == "AgentSessionEvent":
        activity = dict_of(payload.get("agentActivity"))
        if not activity:
            return text_of(dict_of(payload.get("agentSession")).get("creatorId")) == own
        return own in (text_of(activity.get("userId")),
                       text_of(dict_of(activity.get("user")).get("id")))
    data = dict_of(payload.get("data"))
    authors = [text_of(dict_of(payload.get("actor")).get("id"))]
    if kind.partition(".")[0] == "Comment":
        authors += [text_of(data.get("userId")), text_of(dict_of(data.get("user")).get("id"))]
    return own in authors


# What ends a thread (docs/work-control.md#threads): an agent session's stop signal (an
# AgentActivity's ``signal``, @linear/sdk's AgentActivitySignal), or an issue moved to a
# workflow state of one of these types.
STOP_SIGNAL = "stop"
CLOSED_STATE_TYPES = ("completed", "canceled")
STOP_KINDS = ("AgentSessionEvent.prompted (signal stop)",
              "Issue.update (state completed or canceled)")


def thread_key(kind: str, payload: dict) -> str:
    """The agent session's id for an ``AgentSessionEvent``, else the issue's identifier
    (``ENG-123``) for an issue or a comment on one."""
    kind_type = kind.partition(".")[0]
    if kind_type == "AgentSessionEvent":
        return text(dig(payload, "agentSession", "id"))
    if kind_type == "Issue":
        return text(dig(payload, "data", "identifier"))
    if kind_type == "Comment":
        return text(dig(payload, "data", "issue", "identifier"))
    return ""


def ends_thread(kind: str, payload: dict) -> bool:
    if kind == "AgentSessionEvent.prompted":
        return dig(payload, "agentActivity", "signal") == STOP_SIGNAL
    return kind == "Issue.update" and dig(payload, "data", "state", "type") in CLOSED_STATE_TYPES


SENDER = Sender(
    source=Source.LINEAR, verify=verify, derive_kind=derive_kind, derive_title=derive_title,
    setup_steps=setup_steps, mints_own_secret=True, check_payload=check_payload,
    kind_origin="the payload's type, then its action", event_headers=("linear-event",),
    delivery_headers=("linear-delivery",),
    # An app's OAuth token (actor=app) or an API key.
    connections=(ConnectionSpec(kind="linear", default_api_url=DEFAULT_API_URL,
                                identify=identify, check_secret=check_secret),),
    write_back=WriteBackClient(find_target=find_target, ack=send_ack, status=send_status,
                               target_url=target_url, max_status_chars=2000),
    is_own_write_back=is_own_write_back, thread_key=thread_key, ends_thread=ends_thread,
    stop_kinds=STOP_KINDS)
