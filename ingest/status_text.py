"""The living status's text (docs/write-back.md#the-living-status): switchboard's own template
around the agent's words, written in each target's markup.

A source's client declares its markup (``WriteBackClient.markup``): GitHub, GitLab, Gitea and
Linear read Markdown, Slack its own ``mrkdwn``. Whatever the markup, what came from an agent
(its ``post_update`` line, the result's summary, an error) is shown as itself: markup escaped,
no HTML, mentions kept from pinging anyone, capped; the result's ``url`` is linked only when it
is a plain https URL. Never a payload field, a secret or a lease.
"""

import re
from dataclasses import dataclass
from datetime import timezone as dt_timezone
from urllib.parse import urlsplit

from django.conf import settings

from todos import transitions as todo_transitions
from todos.models import PRIORITY_DEFAULT, State, Todo, TodoEvent

# What the living status shows of the agent's words and of the whole (the forges' cap; a
# client may ask for less: Slack 3,000, Linear 2,000).
MAX_STATUS_CHARS = 4000
MAX_SUMMARY_CHARS = 2000
MAX_ERROR_CHARS = 500
# A zero-width space: after an "@" it keeps a mention from forming; after a Slack formatting
# character it keeps it from pairing with another.
_ZWSP = "\u200b"


def _printable(text, limit: int) -> str:
    text = "".join(ch for ch in str(text) if ch.isprintable() or ch == "\n")
    return text[:limit - 1] + "…" if len(text) > limit else text


class Markdown:
    """GitHub-, GitLab- and Gitea-flavoured Markdown, and Linear's."""

    name = "markdown"
    # ASCII punctuation that starts or ends markup; "<", ">" and "&" become entities so no HTML
    # gets through.
    _SPECIAL = re.compile(r"([\\`*_{}\[\]()#+\-.!|~])")

    def text(self, value, limit: int) -> str:
        text = _printable(value, limit)
        text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        return self._SPECIAL.sub(r"\\\1", text).replace("@", "@" + _ZWSP)

    def bold(self, text: str) -> str:
        return f"**{text}**"

    def code(self, slug: str) -> str:
        return f"`{slug}`"

    def link(self, url: str, label: str) -> str:
        return f"[{label}]({url})"

    def bare_link(self, url: str) -> str:
        return f"<{url}>"


class SlackMrkdwn:
    """Slack's ``mrkdwn``: only "&", "<" and ">" can be escaped (as entities), so an ``<@U…>`` or
    ``<!here>`` never forms; its formatting characters cannot be, so a zero-width space after
    each keeps it from pairing."""

    name = "slack"
    _FORMATTING = re.compile(r"([*_~`])")

    def text(self, value, limit: int) -> str:
        text = _printable(value, limit)
        text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        return self._FORMATTING.sub(r"\1" + _ZWSP, text).replace("@", "@" + _ZWSP)

    def bold(self, text: str) -> str:
        return f"*{text}*"

    def code(self, slug: str) -> str:
        return f"`{slug}`"

    def link(self, url: str, label: str) -> str:
        return f"<{url.replace('|', '%7C')}|{label}>"

    def bare_link(self, url: str) -> str:
        return f"<{url.replace('|', '%7C')}>"


MARKDOWN = Markdown()
SLACK = SlackMrkdwn()
MARKUPS = {MARKDOWN.name: MARKDOWN, SLACK.name: SLACK}


def markdown_text(text, limit: int) -> str:
    """``text`` shown as itself in Markdown (``Markdown.text``)."""
    return MARKDOWN.text(text, limit)


def safe_result_url(value) -> str:
    """The result's ``url`` when it is a plain https URL (shown as a link), else ""."""
    if not isinstance(value, str) or len(value) > 2000:
        return ""
    parts = urlsplit(value)
    if (parts.scheme != "https" or not parts.hostname or parts.username or parts.password
            or any(ch.isspace() or ch in "<>\"'`|" or not ch.isprintable() for ch in value)):
        return ""
    return value


# Why a todo was cancelled when its source ended the thread (docs/work-control.md#threads).
SOURCE_CLOSED = todo_transitions.SOURCE_CLOSED


def thread_subject(source: str, kind: str, payload) -> str:
    """What a todo's thread is about, as people call it: "PR", "MR", "issue", "agent session",
    "thread", from its source, kind and payload (a delivery on a thread is about one object
    throughout, so the todo's first delivery says it)."""
    payload = payload if isinstance(payload, dict) else {}
    event = (kind or "").partition(".")[0]
    if source in ("github", "gitea"):
        issue = payload.get("issue")
        on_pull = isinstance(issue, dict) and bool(issue.get("pull_request"))
        return "PR" if event.startswith("pull_request") or on_pull else "issue"
    if source == "gitlab":
        attributes = payload.get("object_attributes")
        noteable = attributes.get("noteable_type") if isinstance(attributes, dict) else None
        return "MR" if event == "merge_request" or noteable == "MergeRequest" else "issue"
    if source == "linear":
        return "agent session" if event == "AgentSessionEvent" else "issue"
    if source == "slack":
        return "thread"
    return "issue"


# What the source did to end the thread, by what the thread is about.
_STOPPED_BY = {"agent session": "the agent session was stopped",
               "thread": "the Slack thread asked it to stop"}
_STOPPED_BY_SOURCE = {"linear": "the issue was completed or cancelled",
                      "sentry": "the issue was resolved or ignored"}


def stopped_words(todo: Todo) -> str:
    """``"the PR was closed"``: why the source stopped ``todo`` (cancelled with reason
    ``source_closed``), in the words of what its thread is about."""
    subject = thread_subject(todo.source, todo.kind, todo.payload)
    return (_STOPPED_BY.get(subject) or _STOPPED_BY_SOURCE.get(todo.source)
            or f"the {subject} was closed")


def source_stopped(todo: Todo, cancel_reason) -> bool:
    """Whether the cancelled ``todo`` was stopped by its source: cancelled with reason
    ``source_closed``, or ended (by its holder, whatever reason it gave, or a lapse) after its
    source asked its holder to stop."""
    if cancel_reason == SOURCE_CLOSED:
        return True
    if todo.cancel_requested_at is None:
        return False
    asked = (TodoEvent.objects.filter(todo_id=todo.pk, action="cancel_request")
             .order_by("-id").values_list("detail", flat=True).first())
    return isinstance(asked, dict) and asked.get("reason") == SOURCE_CLOSED


def _when(moment) -> str:
    return moment.astimezone(dt_timezone.utc).strftime("%Y-%m-%d %H:%M UTC") if moment else ""


_HEADLINES = {
    State.AWAITING_APPROVAL: "⏸️ Waiting for an operator's approval",
    State.PENDING: "📥 Queued",
    State.CLAIMED: "🛠️ Being worked on",
    State.DONE: "✅ Done",
    State.CANCELLED: "🚫 Cancelled",
}


# The operators' decisions a status names, by the event that records them and the state the
# todo must be in for it to be the news, and the words the headline gains.
_DECISIONS = {
    "approve": (State.PENDING, " (approved by {actor})"),
    "cancel": (State.CANCELLED, " by {actor}"),
    "reject": (State.CANCELLED, " (rejected by {actor})"),
}
# Actors that are switchboard itself, named as people read them.
_SYSTEM_ACTORS = {"approval-timeout": "switchboard: nobody approved it in time"}


def _operator_decision(todo: Todo, markup):
    """``(headline words, reason)`` of the operator's approve, reject or cancel that put the
    todo where it is, or None. The operator is named by username (as the console names them),
    switchboard's own sweeps by what they did; both in ``markup``."""
    wanted = [action for action, (state, _) in _DECISIONS.items() if state == todo.state]
    # Queued again after an attempt: the approval is no longer the news.
    if not wanted or (todo.state == State.PENDING and todo.attempts):
        return None
    event = (TodoEvent.objects.filter(todo_id=todo.pk, action__in=wanted)
             .order_by("-at", "-id").only("action", "actor", "detail").first())
    if event is None:
        return None
    detail = event.detail if isinstance(event.detail, dict) else {}
    # An agent's actor is its session id, a handle of its session: never shown at the source.
    system = "its agent" if detail.get("by_holder") else _SYSTEM_ACTORS.get(event.actor)
    actor = system or markup.text(event.actor, 100)
    reason = detail.get("reason") if not system else ""
    return (_DECISIONS[event.action][1].format(actor=actor),
            reason if isinstance(reason, str) else "")


@dataclass(frozen=True)
class StatusUpdate:
    """What a client's ``status`` call writes: the todo's living status as it is now. ``text``
    is in the client's markup; ``state`` and ``dead`` let a source that records a trail rather
    than one edited object (a Linear agent session's activities) say which kind of entry this
    is; ``final``: nothing will follow (done, dead-lettered, cancelled). ``headline``: the
    state in a few words, for a target with a title of its own (a check run's)."""

    todo_id: int
    state: str
    dead: bool
    text: str
    headline: str = ""

    @property
    def final(self) -> bool:
        return self.state in (State.DONE, State.CANCELLED) or self.dead


def status_update(todo: Todo, *, now, markup=MARKDOWN,
                  max_chars: int = MAX_STATUS_CHARS) -> StatusUpdate:
    """``todo``'s living status rendered in ``markup``, at most ``max_chars`` long."""
    headline, text = _render(todo, markup=markup, max_chars=max_chars)
    return StatusUpdate(todo_id=todo.pk, state=todo.state, dead=bool(todo.dead_lettered_at),
                        text=text, headline=headline)


def todo_page_url(todo_id) -> str:
    """The todo's page on the console, which every status links to."""
    return f"{settings.SWITCHBOARD_PUBLIC_URL}/todos/{todo_id}/"


def _state_headline(todo: Todo, markup) -> str:
    if todo.state == State.FAILED:
        return ("💀 Failed for good (no attempts left)" if todo.dead_lettered_at
                else f"⚠️ Failed; retrying at {_when(todo.retry_at)}")
    if todo.state == State.PENDING and todo.not_before:
        return f"🕒 Scheduled for {_when(todo.not_before)}"
    if todo.state == State.PENDING and todo.attempts:
        return f"🔁 Queued again (attempt {todo.attempts + 1} of {todo.max_attempts})"
    return _HEADLINES.get(todo.state, markup.text(todo.state, 32))


def render_status(todo: Todo, *, now, markup=MARKDOWN, max_chars: int = MAX_STATUS_CHARS) -> str:
    """The living status of ``todo``: it names the todo's state (and the operator's decision
    that put it there, or the source's stop), its agent (the endpoint), its times and a link to
    its page; a cancel requested and how many follow-ups were folded in; while claimed, the
    agent's latest ``post_update`` line; when done, the result's ``summary`` and ``https``
    ``url``; when failed, the error."""
    return _render(todo, markup=markup, max_chars=max_chars)[1]


def _render(todo: Todo, *, markup, max_chars: int) -> tuple[str, str]:
    """``(headline, text)`` of ``todo``'s status: the headline is the text's first words."""
    page = todo_page_url(todo.pk)
    agent = todo.endpoint.slug  # a slug: nothing in it is markup, even outside the code span
    headline = _state_headline(todo, markup)
    decision = _operator_decision(todo, markup)
    if (decision is not None and todo.state == State.CANCELLED
            and source_stopped(todo, decision[1])):
        headline, decision = f"🛑 Stopped: {stopped_words(todo)}", None
    elif decision is not None:
        headline += decision[0]
    stopping = todo.state == State.CLAIMED and todo.cancel_requested_at is not None
    if stopping:
        headline += " · cancel requested"
    lines = [
        f"{markup.bold(headline)} · agent {markup.code(agent)} · "
        f"{markup.link(page, f'todo {todo.pk} on switchboard')}",
        "",
        f"Taken in {_when(todo.created_at)} · last change {_when(todo.updated_at)}"
        + (f" · attempt {todo.attempts} of {todo.max_attempts}"
           if todo.state == State.CLAIMED else "")
        + (f" · priority {todo.priority}" if todo.priority != PRIORITY_DEFAULT else ""),
    ]
    if decision is not None and decision[1]:
        lines += ["", "Reason: " + markup.text(decision[1], MAX_ERROR_CHARS)]
    if stopping:
        lines += ["", f"A cancel was requested at {_when(todo.cancel_requested_at)}: the agent"
                      " is asked to stop."]
    if todo.followup_count:
        lines += ["", f"Follow-ups folded in: {todo.followup_count} later event"
                      f"{'s' if todo.followup_count != 1 else ''} on this thread"
                      + (" passed to the agent" if todo.state == State.CLAIMED else "")
                      + "."]
    if todo.state == State.CLAIMED and todo.progress:
        lines += ["", "Latest from the agent: " + markup.text(todo.progress, MAX_SUMMARY_CHARS)]
    result = todo.result if isinstance(todo.result, dict) else {}
    if todo.state == State.DONE and isinstance(result.get("summary"), str) and result["summary"]:
        lines += ["", markup.text(result["summary"], MAX_SUMMARY_CHARS)]
    url = safe_result_url(result.get("url")) if todo.state == State.DONE else ""
    if url:
        lines += ["", f"Result: {markup.bare_link(url)}"]
    if todo.state == State.FAILED and todo.last_error:
        lines += ["", "Error: " + markup.text(todo.last_error, MAX_ERROR_CHARS)]
    # The parts are capped already; the whole is too, leaving the client room for its marker.
    return headline, "\n".join(lines)[:max_chars - 100]
