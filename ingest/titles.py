"""How every sender reads a payload for its kind and its one-line title (docs/senders.md); each
sender's own reading is its ``derive_kind`` and ``derive_title`` in ``ingest/senders/``.

Payloads are untrusted and arbitrary: every lookup tolerates missing keys and wrong types, and
falls back to a generic title rather than fail. ``create_todo`` folds whitespace and truncates;
the doorbell neutralises ``</channel>`` — titles here only have to be readable.
"""

from todos.models import Todo

MAX_KIND_CHARS = Todo._meta.get_field("kind").max_length


def dig(payload, *path):
    """payload[a][b]… or None when any step is missing or not a mapping."""
    value = payload
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def text(value) -> str:
    if value is None or isinstance(value, (dict, list)):
        return ""
    return " ".join(str(value).split())


def first(*values) -> str:
    for value in values:
        found = text(value)
        if found:
            return found
    return ""


def branch(ref) -> str:
    ref = text(ref)
    for prefix in ("refs/heads/", "refs/tags/"):
        if ref.startswith(prefix):
            return ref[len(prefix):]
    return ref


def commits(count) -> str:
    return "1 commit" if count == 1 else f"{count} commits"


def clean_kind(kind: str) -> str:
    if not kind.isprintable():  # else there is nothing to drop: skip the walk
        kind = "".join(ch for ch in kind if ch.isprintable())
    return kind.strip()[:MAX_KIND_CHARS]


def kind_with_action(event, payload) -> str:
    """``<event>.<action>`` when the payload has an ``action`` (``issues.opened``), else the
    event alone: the kind GitHub, Gitea, Linear and Sentry deliveries get."""
    kind = text(event)
    action = payload.get("action") if isinstance(payload, dict) else None
    if kind and isinstance(action, str) and action:
        kind = f"{kind}.{action}"
    return kind


def whole_number(value) -> str:
    """A whole number (an int, or a string of digits) as text; "" for anything else: what a
    thread key takes from a payload's ``number`` or ``iid``."""
    if isinstance(value, bool):
        return ""
    if isinstance(value, int):
        return str(value)
    return value if isinstance(value, str) and value.isascii() and value.isdigit() else ""
