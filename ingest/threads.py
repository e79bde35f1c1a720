"""Threads (docs/work-control.md#threads): a delivery's thread key, from its sender or from a
route's ``--thread-key`` template, and what a route does with a delivery on a thread: its
follow-up policy and whether the delivery ends the thread."""

import re

from todos.models import THREAD_MAX_CHARS

from . import senders
from .models import FollowUps

# One placeholder: ``{a.b.c}``, dotted names of payload fields (a digit indexes a list).
_PLACEHOLDER_RE = re.compile(r"\{([A-Za-z0-9_\-]+(?:\.[A-Za-z0-9_\-]+)*)\}")
TEMPLATE_MAX_CHARS = 300


def check_template(template: str) -> None:
    """ValueError unless ``template`` is text with at least one well-formed ``{a.b.c}``
    placeholder and no other brace, at most TEMPLATE_MAX_CHARS printable characters."""
    if not isinstance(template, str) or not template.isprintable():
        raise ValueError("thread_key: printable text with {field.path} placeholders")
    if len(template) > TEMPLATE_MAX_CHARS:
        raise ValueError(f"thread_key: at most {TEMPLATE_MAX_CHARS} characters")
    for braced in re.findall(r"\{[^{}]*\}", template):
        if not _PLACEHOLDER_RE.fullmatch(braced):
            raise ValueError(f"thread_key: {braced} is not a placeholder: payload field names "
                             "joined by dots, as {issue.number}")
    if not _PLACEHOLDER_RE.search(template):
        raise ValueError("thread_key: name at least one payload field, as {issue.number}")
    if "{" in _PLACEHOLDER_RE.sub("", template) or "}" in _PLACEHOLDER_RE.sub("", template):
        raise ValueError("thread_key: a brace that is not a {field.path} placeholder")


def _field(payload, path: str) -> str:
    value = payload
    for name in path.split("."):
        if isinstance(value, list) and name.isdigit() and int(name) < len(value):
            value = value[int(name)]
        elif isinstance(value, dict):
            value = value.get(name)
        else:
            return ""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return ""
    return str(value)


def render_template(template: str, payload) -> str:
    """The template with each placeholder replaced by its payload field; "" when a field is
    missing, empty or not text or a whole number."""
    values = {}
    for path in _PLACEHOLDER_RE.findall(template):
        values[path] = _field(payload, path).strip()
        if not values[path]:
            return ""
    return _PLACEHOLDER_RE.sub(lambda match: values[match.group(1)], template)


def clean(key: str) -> str | None:
    """A thread key as stored: printable, whitespace folded, at most THREAD_MAX_CHARS; None
    for nothing."""
    key = " ".join("".join(ch for ch in str(key) if ch.isprintable()).split())
    return key[:THREAD_MAX_CHARS] or None


def thread_of(route, source: str, kind: str, payload) -> str | None:
    """The delivery's thread key on ``route``: its template's, else its sender's."""
    if not isinstance(payload, dict):
        return None
    if route.thread_key:
        return clean(render_template(route.thread_key, payload))
    read = senders.get_sender(source).thread_key
    return clean(read(kind or "", payload)) if read is not None else None


def follow_up_policy(route, source: str) -> str:
    """The route's follow-up policy: its own, else ``coalesce`` for a sender with threads (or
    a route with a template) and ``new`` for the others."""
    if route.follow_ups:
        return route.follow_ups
    threaded = route.thread_key or senders.get_sender(source).thread_key is not None
    return FollowUps.COALESCE if threaded else FollowUps.NEW


def stop_kinds(route, source: str) -> list | bool:
    """What ends a thread on this route, as its JSON says: the sender's stop kinds and the
    route's own, or False when the route does not stop (``--no-stop``)."""
    if not route.stop:
        return False
    return [*senders.get_sender(source).stop_kinds, *route.stop_kinds]


def ends_thread(route, source: str, kind: str, payload) -> bool:
    """Whether the delivery ends its thread on ``route``: a sender's stop (an issue closed), or
    a kind the route adds (``issues`` takes every ``issues.*``, as its kinds filter does)."""
    if not route.stop:
        return False
    event = kind.partition(".")[0]
    if kind in route.stop_kinds or event in route.stop_kinds:
        return True
    ends = senders.get_sender(source).ends_thread
    return ends is not None and isinstance(payload, dict) and bool(ends(kind, payload))


def live_key(webhook_id: int, thread: str, route_id=None) -> str:
    """The key a coalescing todo holds its thread by: one live todo per webhook and thread
    on an endpoint (index todo_live_thread). A further route of the webhook into the same
    endpoint (another queue) names itself, so each route keeps its own todo per thread, as
    its idempotency keys do."""
    return f"{webhook_id}:{thread}" if route_id is None else f"{webhook_id}r{route_id}:{thread}"
