"""How a delivery is described: its kind and a legible one-line title, per source (docs/senders.md).

Payloads are untrusted and arbitrary: every lookup tolerates missing keys and wrong types, and
falls back to a generic title rather than fail. ``create_todo`` folds whitespace and truncates;
the doorbell neutralises ``</channel>`` — titles here only have to be readable.
"""

import re

from switchboard import harness_text
from todos.models import Todo

from .models import Source

MAX_KIND_CHARS = Todo._meta.get_field("kind").max_length


def _dig(payload, *path):
    """payload[a][b]… or None when any step is missing or not a mapping."""
    value = payload
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _text(value) -> str:
    if value is None or isinstance(value, (dict, list)):
        return ""
    return " ".join(str(value).split())


def _first(*values) -> str:
    for value in values:
        text = _text(value)
        if text:
            return text
    return ""


def _branch(ref) -> str:
    ref = _text(ref)
    for prefix in ("refs/heads/", "refs/tags/"):
        if ref.startswith(prefix):
            return ref[len(prefix):]
    return ref


def _commits(count) -> str:
    return "1 commit" if count == 1 else f"{count} commits"


def _clean_kind(kind: str) -> str:
    if not kind.isprintable():  # else there is nothing to drop: skip the walk
        kind = "".join(ch for ch in kind if ch.isprintable())
    return kind.strip()[:MAX_KIND_CHARS]


# Slack's notice that a thread changed (a reply was posted): a message event with no author of
# its own, carrying the thread's first message. It is nobody's new message, so it has a kind of
# its own, which only a route naming it exactly takes (``OPT_IN_KINDS``).
SLACK_THREAD_NOTICE_KIND = "message.thread_notice"
OPT_IN_KINDS = frozenset({SLACK_THREAD_NOTICE_KIND})
# What Slack updates on a thread's first message when somebody replies to it.
_SLACK_REPLY_METADATA = frozenset({"reply_count", "reply_users", "reply_users_count",
                                   "latest_reply", "replies", "subscribed", "last_read",
                                   "thread_ts", "is_locked"})


def _without_reply_metadata(message: dict) -> dict:
    return {key: value for key, value in message.items() if key not in _SLACK_REPLY_METADATA}


def is_slack_thread_notice(event) -> bool:
    """A Slack ``message`` event without an author of its own that only reports on a thread:
    ``message_replied``, a ``hidden`` notice without a subtype, or a ``message_changed`` whose
    message differs from its previous version in reply metadata alone. An edit (its text or
    files changed) and a deletion are not notices: they are about their author's message."""
    if not isinstance(event, dict) or event.get("type") != "message":
        return False
    if _text(event.get("user")) or _text(event.get("bot_id")):
        return False
    subtype = event.get("subtype")
    if subtype == "message_replied":
        return True
    if subtype == "message_changed":
        after, before = event.get("message"), event.get("previous_message")
        return (isinstance(after, dict) and isinstance(before, dict)
                and _without_reply_metadata(after) == _without_reply_metadata(before))
    return subtype is None and event.get("hidden") is True


def derive_kind(source: str, event: str, payload: dict) -> str:
    """The todo's kind: the source's event name, ``.action`` appended when the payload has one
    (``issues.opened``), so routes can filter on either the event or the event and action."""
    action = payload.get("action") if isinstance(payload, dict) else None
    if source in (Source.GITHUB, Source.GITEA):
        kind = _text(event)
        if kind and isinstance(action, str) and action:
            kind = f"{kind}.{action}"
    elif source == Source.GITLAB:
        # "Merge Request Hook" -> "merge_request"; the action lives in object_attributes.
        kind = _text(event).lower().removesuffix(" hook").replace(" ", "_")
        action = _dig(payload, "object_attributes", "action")
        if kind and isinstance(action, str) and action:
            kind = f"{kind}.{action}"
    elif source in (Source.STRIPE, Source.STANDARD, Source.UNSIGNED):
        kind = _text(payload.get("type")) if isinstance(payload, dict) else ""
    elif source == Source.LINEAR:
        # "<type>.<action>" from the signed body: Issue.create, AgentSessionEvent.created.
        kind = _text(payload.get("type")) if isinstance(payload, dict) else ""
        if kind and isinstance(action, str) and action:
            kind = f"{kind}.{action}"
    elif source == Source.SLACK:
        # Events API: the inner event's type (app_mention, message); an envelope without one
        # (url_verification, app_rate_limited) is kinded by its own type.
        kind = ""
        if isinstance(payload, dict):
            kind = _text(_dig(payload, "event", "type")) if payload.get("type") == "event_callback" else ""
            kind = kind or _text(payload.get("type"))
            if kind == "message" and is_slack_thread_notice(payload.get("event")):
                kind = SLACK_THREAD_NOTICE_KIND
    elif source == Source.SENTRY:
        # Sentry-Hook-Resource (issue, event_alert, metric_alert, …) plus the payload's action.
        kind = _text(event)
        if kind and isinstance(action, str) and action:
            kind = f"{kind}.{action}"
    else:
        kind = _text(event)
    return _clean_kind(kind)


def _github_title(kind: str, payload: dict) -> str:
    event, _, action = kind.partition(".")
    repo = _first(_dig(payload, "repository", "full_name"), _dig(payload, "repository", "name"))
    where = repo or "GitHub"
    if event == "issues":
        return (f"{where}#{_text(_dig(payload, 'issue', 'number'))} {action or 'updated'}: "
                f"{_text(_dig(payload, 'issue', 'title'))}")
    if event == "pull_request":
        number = _first(_dig(payload, "pull_request", "number"), payload.get("number"))
        return (f"{where}#{number} pull request {action or 'updated'}: "
                f"{_text(_dig(payload, 'pull_request', 'title'))}")
    if event == "issue_comment":
        who = _first(_dig(payload, "comment", "user", "login"), _dig(payload, "sender", "login"))
        return (f"{where}#{_text(_dig(payload, 'issue', 'number'))} comment {action or 'added'} "
                f"by {who or 'someone'}: {_text(_dig(payload, 'issue', 'title'))}")
    if event == "push":
        who = _first(_dig(payload, "pusher", "name"), _dig(payload, "pusher", "login"),
                     _dig(payload, "pusher", "username"), _dig(payload, "sender", "login"))
        commits = payload.get("commits")
        count = len(commits) if isinstance(commits, list) else 0
        return f"{where}: {who or 'someone'} pushed {_commits(count)} to {_branch(payload.get('ref'))}"
    if event == "check_run":
        name = _text(_dig(payload, "check_run", "name"))
        outcome = _first(_dig(payload, "check_run", "conclusion"), _dig(payload, "check_run", "status"))
        return f"{where} check {name} {action or 'updated'}: {outcome or 'unknown'}"
    if event == "ping":
        return f"{where} ping: {_text(payload.get('zen'))}"
    return f"{where}: {kind or 'event'}"


def _gitlab_title(kind: str, payload: dict) -> str:
    event, _, action = kind.partition(".")
    project = _first(_dig(payload, "project", "path_with_namespace"), _dig(payload, "project", "name"))
    where = project or "GitLab"
    attributes = payload.get("object_attributes") if isinstance(payload.get("object_attributes"), dict) else {}
    if event == "merge_request":
        return f"{where}!{_text(attributes.get('iid'))} {action or 'updated'}: {_text(attributes.get('title'))}"
    if event == "issue":
        return f"{where}#{_text(attributes.get('iid'))} {action or 'updated'}: {_text(attributes.get('title'))}"
    if event in ("push", "tag_push"):
        who = _first(payload.get("user_username"), payload.get("user_name"))
        count = payload.get("total_commits_count")
        count = count if isinstance(count, int) else 0
        return f"{where}: {who or 'someone'} pushed {_commits(count)} to {_branch(payload.get('ref'))}"
    if event == "note":
        return f"{where} comment by {_first(_dig(payload, 'user', 'username')) or 'someone'}: " \
               f"{_text(attributes.get('note'))}"
    return f"{where}: {kind or 'event'}"


def _stripe_title(kind: str, payload: dict) -> str:
    obj = _dig(payload, "data", "object")
    ident = _text(_dig(obj, "id")) if isinstance(obj, dict) else ""
    return f"Stripe {kind or 'event'}" + (f": {ident}" if ident else "")


LINEAR_ACTION_WORDS = {"create": "created", "update": "updated", "remove": "removed"}
# A Slack message's text is one part of a one-line title: enough to tell what was asked.
MAX_SLACK_TEXT_CHARS = 200
# Slack's markup: <@U123>, <@U123|ana>, <#C123|general>, <!here>, <!subteam^S1|@team>,
# <https://x|label>, <https://x>. Rendered as the text a reader of the channel saw.
_SLACK_MARKUP_RE = re.compile(r"<([^<>]*)>")
_SLACK_ENTITIES = (("&lt;", "<"), ("&gt;", ">"), ("&amp;", "&"))


def _linear_title(kind: str, payload: dict) -> str:
    kind_type, _, action = kind.partition(".")
    done = LINEAR_ACTION_WORDS.get(action, action or "updated")
    data = payload.get("data") if isinstance(payload.get("data"), dict) else {}
    if kind_type == "Issue":
        return f"{_text(data.get('identifier')) or 'Linear issue'} {done}: {_text(data.get('title'))}"
    if kind_type == "Comment":
        issue = _first(_dig(data, "issue", "identifier"), _dig(data, "issue", "title"))
        return f"{issue or 'Linear'} comment {done}: {_text(data.get('body'))}"
    if kind_type == "AgentSessionEvent":
        session = payload.get("agentSession") if isinstance(payload.get("agentSession"), dict) else {}
        issue = _text(_dig(session, "issue", "identifier"))
        prompt = _first(_dig(payload, "agentActivity", "body"),
                        _dig(payload, "agentActivity", "content", "body"),
                        _dig(session, "comment", "body"), _dig(session, "issue", "title"))
        return f"{issue or 'Linear'} agent session {action or 'event'}: {prompt}"
    what = _first(data.get("identifier"), data.get("title"), data.get("name"), data.get("body"))
    return f"Linear {kind or 'event'}" + (f": {what}" if what else "")


def _slack_markup(match) -> str:
    inner = match.group(1)
    target, _, label = inner.partition("|")
    if target.startswith("@"):
        return f"@{label or target[1:]}"
    if target.startswith("#"):
        return f"#{label or target[1:]}"
    if target.startswith("!"):
        return label if label.startswith("@") else f"@{label or target[1:].split('^')[0]}"
    return label or target


def slack_text(text) -> str:
    """A Slack message's text as its reader saw it — mentions, channels and links as plain
    words, entities decoded — then sanitised as doorbells are (one line, no control or format
    characters, no angle brackets) and cut to MAX_SLACK_TEXT_CHARS."""
    text = _SLACK_MARKUP_RE.sub(_slack_markup, _text(text))
    for entity, char in _SLACK_ENTITIES:
        text = text.replace(entity, char)
    text = harness_text.sanitize_content(text)
    return text if len(text) <= MAX_SLACK_TEXT_CHARS else text[:MAX_SLACK_TEXT_CHARS - 1] + "…"


def _slack_title(kind: str, payload: dict) -> str:
    event = payload.get("event") if isinstance(payload.get("event"), dict) else {}
    channel = _first(event.get("channel"), _dig(event, "item", "channel"))
    user = _first(event.get("user"), event.get("username"), event.get("bot_id"))
    where = f"#{channel}" if channel else "Slack"
    who = f" @{user}" if user else ""
    return f"{where}{who}: {slack_text(event.get('text')) or kind or 'event'}"


def _sentry_title(kind: str, payload: dict) -> str:
    resource, _, action = kind.partition(".")
    data = payload.get("data") if isinstance(payload.get("data"), dict) else {}
    what = _first(_dig(data, "issue", "title"), _dig(data, "event", "title"),
                  _dig(data, "error", "title"), data.get("description_title"),
                  _dig(data, "metric_alert", "title"), data.get("comment"),
                  _dig(data, "installation", "app", "slug"))
    head = f"{resource or 'Sentry'} {action or 'event'}"
    return f"{head}: {what}" if what else f"Sentry {head}"


def derive_title(source: str, kind: str, payload: dict, *, webhook_slug: str) -> str:
    """One legible line for a todo created from this delivery."""
    payload = payload if isinstance(payload, dict) else {}
    if source in (Source.GITHUB, Source.GITEA):
        title = _github_title(kind, payload)  # Gitea mirrors GitHub's payload shapes.
    elif source == Source.GITLAB:
        title = _gitlab_title(kind, payload)
    elif source == Source.STRIPE:
        title = _stripe_title(kind, payload)
    elif source == Source.LINEAR:
        title = _linear_title(kind, payload)
    elif source == Source.SLACK:
        title = _slack_title(kind, payload)
    elif source == Source.SENTRY:
        title = _sentry_title(kind, payload)
    else:
        title = f"{webhook_slug}: {kind}" if kind else f"{webhook_slug}: delivery"
    return " ".join(title.split())
