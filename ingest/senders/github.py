"""GitHub: HMAC-SHA256 of the body in X-Hub-Signature-256, JSON or form posts, the actor's
role from the object the event is about (docs/senders.md#the-other-sources-briefly); and the
client of its connections, an App or a token (docs/write-back.md#connections)."""

import threading
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone as dt_timezone
from urllib.parse import urlsplit

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from todos.models import State

from . import (ConnectionSpec, Identity, Sender, WriteBackClient, checked_page, find_marked,
               is_connection_identity, send_living_status)
from .. import outbound, status_text
from ..actors import Actor, dict_of, text_of
from ..models import Source, TrustMode
from ..titles import branch, commits, dig, first, kind_with_action, text, whole_number
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


# -- the connection's client (docs/write-back.md#connections) ----------------------------------

DEFAULT_API_URL = "https://api.github.com"
API_VERSION = "2022-11-28"
# GitHub refuses an App JWT whose exp is more than 10 minutes ahead; iat is set a minute back
# for clock drift, as GitHub advises, and exp 9 minutes ahead: 10 minutes in all.
APP_JWT_BACKDATE = timedelta(seconds=60)
APP_JWT_LIFETIME = timedelta(minutes=10)
# An installation token lives an hour; one is reused until this long before it expires, so a
# write-back never starts with a token about to lapse.
INSTALLATION_TOKEN_MARGIN = timedelta(minutes=5)


def _headers() -> dict:
    return {"Accept": "application/vnd.github+json", "X-GitHub-Api-Version": API_VERSION}


def check_private_key(pem: str) -> None:
    """ValueError unless ``pem`` is an RSA private key in PEM (what GitHub gives an App)."""
    try:
        key = serialization.load_pem_private_key(pem.encode(), password=None)
    except (ValueError, TypeError):
        raise ValueError("not a PEM private key without a passphrase (the .pem file GitHub "
                         "gave the App)") from None
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError("a GitHub App's private key is an RSA key")


def check_token(token: str) -> None:
    if not token or len(token) > 1000 or any(ch.isspace() or not ch.isprintable() for ch in token):
        raise ValueError("not a token: one word of printable characters")


def app_jwt(app_id: str, private_key: str, now: datetime) -> str:
    """The App's JWT (RS256; ``iss`` the App id, ``iat`` a minute back, ``exp`` nine minutes
    ahead): what ``GET /app`` and minting installation tokens take."""
    issued = now - APP_JWT_BACKDATE
    claims = {"iat": int(issued.timestamp()), "exp": int((issued + APP_JWT_LIFETIME).timestamp()),
              "iss": str(app_id)}
    return jwt.encode(claims, private_key, algorithm="RS256")


def identify(connection, now: datetime) -> Identity:
    """Who the connection is at GitHub: an App's bot login (``<slug>[bot]``, from ``GET /app``)
    and the App's id; a token's user (``GET /user``)."""
    if connection.kind == "github_app":
        answer = outbound.send(connection.api_url, "GET", "/app", headers=_headers(),
                               token=app_jwt(connection.app_id, connection.secret, now), now=now)
        app = answer.body if isinstance(answer.body, dict) else {}
        if not app.get("slug") or str(app.get("id")) != str(connection.app_id):
            raise outbound.SourceError("GET /app did not answer with this App's slug and id")
        return Identity(login=f"{app['slug']}[bot]", id=str(app["id"]))
    answer = outbound.send(connection.api_url, "GET", "/user", headers=_headers(),
                           token=connection.secret, now=now)
    user = answer.body if isinstance(answer.body, dict) else {}
    if not user.get("login"):
        raise outbound.SourceError("GET /user did not answer with a login")
    return Identity(login=str(user["login"]), id=str(user.get("id", "")))


@dataclass(frozen=True)
class _CachedToken:
    token: str
    expires_at: datetime


# Installation tokens per (connection, its App and key, installation): a process mints one and
# reuses it until INSTALLATION_TOKEN_MARGIN before it expires. Kept in memory only (never in
# the database or a log); a new key or App id on the connection misses the cache.
_installation_tokens: dict = {}
_installation_tokens_lock = threading.Lock()


def installation_token(connection, installation_id, now: datetime) -> str:
    """A token of the App's installation ``installation_id`` (the delivery's
    ``installation.id``), minted with the App's JWT or reused from the cache."""
    installation = outbound.number_segment(installation_id)
    key = (connection.pk, connection.app_id, hash(connection.secret), connection.api_url,
           installation)
    with _installation_tokens_lock:
        cached = _installation_tokens.get(key)
    if cached is not None and cached.expires_at - INSTALLATION_TOKEN_MARGIN > now:
        return cached.token
    answer = outbound.send(
        connection.api_url, "POST", f"/app/installations/{installation}/access_tokens",
        headers=_headers(), token=app_jwt(connection.app_id, connection.secret, now), now=now)
    body = answer.body if isinstance(answer.body, dict) else {}
    try:
        minted = _CachedToken(token=str(body["token"]),
                              expires_at=datetime.fromisoformat(body["expires_at"]))
    except (KeyError, TypeError, ValueError):
        raise outbound.SourceError("the installation token answer had no token or expires_at")
    with _installation_tokens_lock:
        _installation_tokens[key] = minted
    return minted.token


def forget_installation_tokens() -> None:
    """Drop every cached installation token (tests; a connection's key was replaced)."""
    with _installation_tokens_lock:
        _installation_tokens.clear()


def connection_token(connection, payload: dict, now: datetime) -> str:
    """The bearer for writing back about a delivery's ``payload``: the installation's token for
    an App (its ``installation.id``), the connection's own token otherwise."""
    if connection.kind != "github_app":
        return connection.secret
    installation = payload.get("installation") if isinstance(payload, dict) else None
    if not isinstance(installation, dict) or "id" not in installation:
        raise outbound.SourceError("the delivery names no App installation (installation.id): "
                                   "is the webhook the App's own?")
    return installation_token(connection, installation["id"], now)


# -- writing back: the reaction and the living status (docs/write-back.md#what-is-written-back) --

# Where a comment an event is about lives, by event: its reactions' path differs.
_COMMENT_PATHS = {"issue_comment": "issues/comments",
                  "pull_request_review_comment": "pulls/comments"}
# The status comment carries this marker, so a send whose worker died after GitHub took it is
# found again instead of posted twice. An HTML comment: GitHub shows nothing of it.
STATUS_MARKER = "<!-- switchboard:todo:{todo_id} -->"
# How many comments a look for the marker reads (one page of those changed since the
# write-back was made).
MARKER_LOOK_PAGE = 100


# Pull-request events, whose payload names the head commit a check run goes on. A comment on
# a pull request (issue_comment) names none, so it gets the comment and the reaction only.
_CHECK_RUN_EVENTS = ("pull_request", "pull_request_review", "pull_request_review_comment")


def find_target(kind: str, payload: dict):
    """The issue or pull request a delivery is about, and the comment when it is about one:
    ``({"owner", "repo", "number", "comment", "comment_path", "installation"}, "owner/repo#N")``,
    with ``head_sha`` for a pull-request event (its head commit); or None for an event with
    nothing to react to (a push, a check run) or whose names do not pass ``outbound``'s
    checks."""
    event = kind.partition(".")[0]
    repository = dict_of(payload.get("repository"))
    subject = {"issues": "issue", "issue_comment": "issue"}.get(event, "pull_request")
    if event not in ("issues", "issue_comment", "pull_request", "pull_request_review",
                     "pull_request_review_comment"):
        return None
    try:
        target = {
            "owner": outbound.name_segment(dict_of(repository.get("owner")).get("login")),
            "repo": outbound.name_segment(repository.get("name")),
            "number": outbound.number_segment(first(dig(payload, subject, "number"),
                                                    payload.get("number"))),
            "comment": None, "comment_path": None,
            "installation": dig(payload, "installation", "id"),
        }
        if event in _COMMENT_PATHS:
            target["comment"] = outbound.number_segment(dig(payload, "comment", "id"))
            target["comment_path"] = _COMMENT_PATHS[event]
        if target["installation"] is not None:
            target["installation"] = outbound.number_segment(target["installation"])
        if event in _CHECK_RUN_EVENTS:
            target["head_sha"] = outbound.commit_segment(dig(payload, "pull_request", "head",
                                                             "sha"))
    except outbound.SourceError:
        return None
    label = f"{target['owner']}/{target['repo']}#{target['number']}"
    return target, label + (f" comment {target['comment']}" if target["comment"] else "")


def _send(connection, target, method, path, now, body=None):
    token = connection_token(connection, {"installation": {"id": target["installation"]}}
                             if target.get("installation") else {}, now)
    base = (f"/repos/{outbound.name_segment(target['owner'])}/"
            f"{outbound.name_segment(target['repo'])}")
    return outbound.send(connection.api_url, method, base + path, token=token, json=body,
                         headers=_headers(), now=now)


def send_ack(connection, target, now) -> str:
    """The ``eyes`` reaction on the comment the delivery is about, else on the issue or pull
    request (a pull request's reactions are its issue's). GitHub answers 200 for one that
    is already there, so a repeat adds nothing."""
    if target.get("comment"):
        path = f"/{target['comment_path']}/{outbound.number_segment(target['comment'])}/reactions"
    else:
        path = f"/issues/{outbound.number_segment(target['number'])}/reactions"
    answer = _send(connection, target, "POST", path, now, {"content": "eyes"})
    return str(dict_of(answer.body).get("id", ""))


def send_status(connection, target, update, external_id: str, now, look_since) -> str:
    """The living status: the comment ``external_id`` edited, or one posted on the issue or
    pull request, the update's text after the todo's marker. A status comment someone deleted
    is posted again."""
    number = outbound.number_segment(target["number"])
    body = {"body": f"{STATUS_MARKER.format(todo_id=update.todo_id)}\n{update.text}"}
    return send_living_status(
        external_id, look_since,
        look=lambda: _find_marked_comment(connection, target, number, update.todo_id,
                                          look_since, now),
        edit=lambda found: _send(connection, target, "PATCH",
                                 f"/issues/comments/{outbound.number_segment(found)}", now, body),
        post=lambda: _send(connection, target, "POST", f"/issues/{number}/comments", now, body))


def _find_marked_comment(connection, target, number, todo_id, since, now) -> str:
    # Only comments changed since the write-back was made: one page holds them, however long
    # the thread.
    marker = STATUS_MARKER.format(todo_id=todo_id)
    since = since.astimezone(dt_timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    answer = _send(connection, target, "GET",
                   f"/issues/{number}/comments?since={since}&per_page={MARKER_LOOK_PAGE}", now)
    return find_marked(answer.body, marker, connection.identity, body_key="body",
                       author_of=comment_author)


def comment_author(comment: dict) -> str:
    """The login of a comment's author (GitHub's and Gitea's comments alike)."""
    return text_of(dict_of(comment.get("user")).get("login"))


# -- the check run on a pull request's head commit (docs/write-back.md#the-check-run) ----------

# The check's name on the pull request, and what a look for a lost check run asks for.
CHECK_NAME = "switchboard"


def wants_check_run(connection, target) -> bool:
    """A check run goes on a pull request's head commit, and only under an App: GitHub lets
    only Apps write check runs (a token is refused)."""
    return connection.kind == "github_app" and bool(target.get("head_sha"))


def _check_run_state(update) -> dict:
    """GitHub's status and conclusion of the check run for the todo's state: queued while it
    waits (approval, queued, scheduled, retrying), in progress while claimed, then completed:
    success when done, failure when dead-lettered, cancelled when cancelled."""
    if update.state == State.DONE:
        return {"status": "completed", "conclusion": "success"}
    if update.state == State.CANCELLED:
        return {"status": "completed", "conclusion": "cancelled"}
    if update.state == State.FAILED and update.dead:
        return {"status": "completed", "conclusion": "failure"}
    return {"status": "in_progress" if update.state == State.CLAIMED else "queued"}


def send_check_run(connection, target, update, external_id: str, now, look_since) -> str:
    """The todo's check run on the pull request's head commit: ``external_id`` edited in place
    (PATCH), or created; with ``look_since``, an earlier send may have created it before its
    worker died, so it is looked for by its ``external_id`` (the todo's id) first."""
    state = _check_run_state(update)
    body = {"name": CHECK_NAME, "details_url": status_text.todo_page_url(update.todo_id),
            "external_id": str(update.todo_id), **state,
            "output": {"title": update.headline or CHECK_NAME, "summary": update.text}}
    if state["status"] == "completed":
        body["completed_at"] = now.astimezone(dt_timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    if not external_id and look_since is not None:
        external_id = _find_check_run(connection, target, update.todo_id, now)
    if external_id:
        try:
            _send(connection, target, "PATCH",
                  f"/check-runs/{outbound.number_segment(external_id)}", now, body)
            return external_id
        except outbound.SourceError as failed:
            if failed.status != 404:
                raise
    body["head_sha"] = outbound.commit_segment(target["head_sha"])
    answer = _send(connection, target, "POST", "/check-runs", now, body)
    return str(dict_of(answer.body).get("id", ""))


def _find_check_run(connection, target, todo_id, now) -> str:
    # GitHub keeps a commit's check runs by name; this App's run of this todo is the one
    # whose external_id is the todo's id (one page: a commit has few runs of one name).
    sha = outbound.commit_segment(target["head_sha"])
    answer = _send(connection, target, "GET",
                   f"/commits/{sha}/check-runs?check_name={CHECK_NAME}&filter=all"
                   f"&app_id={outbound.number_segment(connection.app_id)}"
                   f"&per_page={MARKER_LOOK_PAGE}", now)
    runs = dict_of(answer.body).get("check_runs")
    for run in runs if isinstance(runs, list) else []:
        run = dict_of(run)
        if text_of(run.get("external_id")) == str(todo_id):
            return str(run.get("id", ""))
    return ""


def target_url(connection, target) -> str:
    """The issue, pull request or comment on GitHub's web pages: github.com for the public API,
    the host itself for an Enterprise Server (``https://host/api/v3``). GitHub sends an
    ``/issues/N`` of a pull request on to its ``/pull/N``."""
    parts = urlsplit(connection.api_url)
    if parts.netloc == "api.github.com":
        web = "https://github.com"
    else:
        web = outbound.web_root(connection.api_url, "/api/v3")
    anchor = ("discussion_r" if target.get("comment_path") == "pulls/comments"
              else "issuecomment-")
    return checked_page(lambda: (f"{web}/{outbound.name_segment(target['owner'])}/"
                                 f"{outbound.name_segment(target['repo'])}/issues/"
                                 f"{outbound.number_segment(target['number'])}"),
                        anchor, target.get("comment"))


def is_own_write_back(connection, kind: str, payload: dict) -> bool:
    """The delivery's ``sender`` is the connection's own login (the App's bot, or the token's
    user), or the object it is about was written through the App
    (``performed_via_github_app.id`` is the App's id)."""
    if is_connection_identity(connection, text_of(dict_of(payload.get("sender")).get("login"))):
        return True
    if connection.kind != "github_app" or not connection.app_id:
        return False
    for key in SUBJECTS:
        app = dict_of(dict_of(payload.get(key)).get("performed_via_github_app"))
        if str(app.get("id", "")) == connection.app_id:
            return True
    return False


# Threads (docs/work-control.md#threads): the events about one issue or pull request, and
# where their payload keeps it.
THREAD_SUBJECTS = {"issues": "issue", "issue_comment": "issue", "pull_request": "pull_request",
                   "pull_request_review": "pull_request",
                   "pull_request_review_comment": "pull_request",
                   "pull_request_review_thread": "pull_request"}
STOP_KINDS = ("issues.closed", "pull_request.closed")


def thread_key(kind: str, payload: dict) -> str:
    """``<owner>/<repo>#<number>`` of the issue or pull request the event is about; a check
    run or suite only when it names exactly one pull request; "" otherwise."""
    event = kind.partition(".")[0]
    if event in THREAD_SUBJECTS:
        number = whole_number(dig(payload, THREAD_SUBJECTS[event], "number")) or whole_number(
            payload.get("number"))
    elif event in ("check_run", "check_suite"):
        pulls = dig(payload, event, "pull_requests")
        one = pulls[0] if isinstance(pulls, list) and len(pulls) == 1 else None
        number = whole_number(dig(one, "number"))
    else:
        return ""
    repo = text(dig(payload, "repository", "full_name"))
    return f"{repo}#{number}" if repo and number else ""


def ends_thread(kind: str, payload: dict) -> bool:
    """An issue or pull request closed (a pull request merged or not)."""
    return kind in STOP_KINDS


SENDER = Sender(
    source=Source.GITHUB, verify=verify, derive_kind=kind_with_action, derive_title=derive_title,
    setup_steps=setup_steps, read_actor=read_actor, reads_roles=True, takes_forms=True,
    redelivers_under_its_id=True,
    kind_origin="the X-GitHub-Event header, then the payload's action",
    event_headers=("x-github-event",), delivery_headers=("x-github-delivery",),
    connections=(
        ConnectionSpec(kind="github_app", default_api_url=DEFAULT_API_URL, identify=identify,
                       check_secret=check_private_key, needs_app_id=True),
        ConnectionSpec(kind="github_token", default_api_url=DEFAULT_API_URL, identify=identify,
                       check_secret=check_token),
    ),
    write_back=WriteBackClient(find_target=find_target, ack=send_ack, status=send_status,
                               target_url=target_url, check_run=send_check_run,
                               wants_check_run=wants_check_run),
    is_own_write_back=is_own_write_back, thread_key=thread_key, ends_thread=ends_thread,
    stop_kinds=STOP_KINDS)


# -- repository tokens for agents (docs/write-back.md#repository-tokens-for-agents) ----------

# The permissions an installation token may be asked for, with their levels: GitHub's own
# list (the access-token request's ``permissions`` in GitHub's OpenAPI description; a test
# compares the two).
APP_PERMISSION_LEVELS = {
    "actions": ("read", "write"),
    "administration": ("read", "write"),
    "artifact_metadata": ("read", "write"),
    "attestations": ("read", "write"),
    "checks": ("read", "write"),
    "code_quality": ("read", "write"),
    "codespaces": ("read", "write"),
    "contents": ("read", "write"),
    "dependabot_secrets": ("read", "write"),
    "deployments": ("read", "write"),
    "discussions": ("read", "write"),
    "environments": ("read", "write"),
    "issues": ("read", "write"),
    "merge_queues": ("read", "write"),
    "metadata": ("read", "write"),
    "packages": ("read", "write"),
    "pages": ("read", "write"),
    "pull_requests": ("read", "write"),
    "repository_custom_properties": ("read", "write"),
    "repository_hooks": ("read", "write"),
    "repository_projects": ("read", "write", "admin"),
    "secret_scanning_alerts": ("read", "write"),
    "secrets": ("read", "write"),
    "security_events": ("read", "write"),
    "single_file": ("read", "write"),
    "statuses": ("read", "write"),
    "vulnerability_alerts": ("read", "write"),
    "workflows": ("write",),
    "custom_properties_for_organizations": ("read", "write"),
    "members": ("read", "write"),
    "organization_administration": ("read", "write"),
    "organization_custom_roles": ("read", "write"),
    "organization_custom_org_roles": ("read", "write"),
    "organization_custom_properties": ("read", "write", "admin"),
    "organization_copilot_seat_management": ("read", "write"),
    "organization_copilot_agent_settings": ("read", "write"),
    "organization_announcement_banners": ("read", "write"),
    "organization_events": ("read",),
    "organization_hooks": ("read", "write"),
    "organization_personal_access_tokens": ("read", "write"),
    "organization_personal_access_token_requests": ("read", "write"),
    "organization_plan": ("read",),
    "organization_projects": ("read", "write", "admin"),
    "organization_packages": ("read", "write"),
    "organization_secrets": ("read", "write"),
    "organization_self_hosted_runners": ("read", "write"),
    "organization_user_blocking": ("read", "write"),
    "email_addresses": ("read", "write"),
    "followers": ("read", "write"),
    "git_ssh_keys": ("read", "write"),
    "gpg_keys": ("read", "write"),
    "interaction_limits": ("read", "write"),
    "profile": ("write",),
    "starring": ("read", "write"),
    "enterprise_custom_properties_for_organizations": ("read", "write", "admin"),
}



# Those of them that act on a repository: GitHub's organization, account and enterprise
# permissions are not narrowed by ``repositories``, so a token for one repository never gets
# them (docs/write-back.md#repository-tokens-for-agents).
REPOSITORY_PERMISSIONS = frozenset(list(APP_PERMISSION_LEVELS)[
    :list(APP_PERMISSION_LEVELS).index("workflows") + 1])


def parse_agent_permissions(text: str) -> dict:
    """``contents:write,pull_requests:write`` as ``{"contents": "write", …}``; ValueError
    naming the first name or level GitHub does not know. "" is no permissions ({})."""
    permissions = {}
    for item in (part.strip() for part in (text or "").split(",")):
        if not item:
            continue
        name, _, level = item.partition(":")
        name, level = name.strip(), level.strip()
        if name not in APP_PERMISSION_LEVELS:
            raise ValueError(f"{name!r} is not a GitHub App permission (e.g. contents, "
                             "pull_requests, issues, checks)")
        if name not in REPOSITORY_PERMISSIONS:
            raise ValueError(f"{name} is an organization, account or enterprise permission, "
                             "which naming one repository does not narrow: a repository token "
                             "takes repository permissions only (e.g. contents, pull_requests)")
        if not level:
            raise ValueError(f"{name} needs a level: write it as {name}:"
                             f"{'|'.join(APP_PERMISSION_LEVELS[name])}")
        if level not in APP_PERMISSION_LEVELS[name]:
            raise ValueError(f"{name} takes {' or '.join(APP_PERMISSION_LEVELS[name])}, "
                             f"not {level!r} (write it as {name}:LEVEL)")
        if name in permissions:
            raise ValueError(f"{name} is named twice")
        permissions[name] = level
    return permissions


def mint_repository_token(connection, installation_id, repository: str, permissions: dict,
                          now: datetime) -> tuple[str, datetime, dict]:
    """A new installation token for ``repository`` (a name in the installation's account)
    alone, with exactly ``permissions``: ``(token, expires_at, permissions GitHub granted)``.
    Never cached: it is the agent's, and is revoked when its lease ends."""
    installation = outbound.number_segment(installation_id)
    answer = outbound.send(
        connection.api_url, "POST", f"/app/installations/{installation}/access_tokens",
        headers=_headers(), json={"repositories": [outbound.name_segment(repository)],
                                  "permissions": dict(permissions)},
        token=app_jwt(connection.app_id, connection.secret, now), now=now)
    body = answer.body if isinstance(answer.body, dict) else {}
    try:
        token, expires_at = str(body["token"]), datetime.fromisoformat(body["expires_at"])
    except (KeyError, TypeError, ValueError):
        raise outbound.SourceError("the installation token answer had no token or expires_at")
    granted = body.get("permissions")
    return token, expires_at, granted if isinstance(granted, dict) else dict(permissions)


def revoke_installation_token(connection, token: str, now: datetime) -> None:
    """Revoke an installation token with itself (``DELETE /installation/token``). A token
    GitHub no longer knows (401: expired or revoked already) counts as revoked."""
    try:
        outbound.send(connection.api_url, "DELETE", "/installation/token", headers=_headers(),
                      token=token, now=now)
    except outbound.SourceError as failed:
        if failed.status != 401:
            raise
