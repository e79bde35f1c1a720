"""Lease holders and event actors as an operator sees them: ``claude-code 2.1 · Ab3dEf9h``.

An agent's actor is its MCP session id, a bearer-like handle of that session: the whole id
never reaches a page. What an operator needs is which agent it is, so the session keeps the
client's ``clientInfo`` name and version from ``initialize`` (sanitised to the doorbell meta
alphabet and capped: it is text from the open internet) and a holder is shown as that plus the
session's hint. Operators (usernames) and sweeps (``reaper``) are shown as they are.
"""

import re

from switchboard.harness_text import sanitize_meta_value
from channels_push.models import McpSession

CLIENT_INFO_MAX_CHARS = 64
SESSION_HINT_CHARS = 8
# What ``models.mint_session_id`` mints: 43 URL-safe characters. An actor of that shape that
# names no session row (the session was pruned) still shows only its hint.
_SESSION_ID_RE = re.compile(r"^[A-Za-z0-9_-]{40,64}$")
UNNAMED_CLIENT = "unnamed client"


def clean_client_field(value) -> str:
    """A ``clientInfo`` name or version as stored: a string sanitised like doorbell meta and
    capped at CLIENT_INFO_MAX_CHARS; anything else (missing, a number, an object) is empty."""
    if not isinstance(value, str):
        return ""
    return sanitize_meta_value(value)[:CLIENT_INFO_MAX_CHARS]


def session_hint(session_id: str) -> str:
    return session_id[:SESSION_HINT_CHARS]


def session_label(client_name: str, client_version: str, session_id: str) -> str:
    client = " ".join(part for part in (client_name, client_version) if part) or UNNAMED_CLIENT
    return f"{client} · {session_hint(session_id)}"


def looks_like_session_id(actor: str) -> bool:
    return bool(actor) and bool(_SESSION_ID_RE.match(actor))


def holder_labels(actors) -> dict[str, str]:
    """``{actor: label}`` for every actor given, in one query at most: sessions as ``client
    version · hint``, a session id whose row is gone as ``session · hint``, anything else
    (an operator's username, ``reaper``) unchanged."""
    actors = {actor for actor in actors if actor}
    candidates = [actor for actor in actors if looks_like_session_id(actor)]
    sessions = {}
    if candidates:
        sessions = {row[0]: row for row in McpSession.objects.filter(pk__in=candidates)
                    .values_list("pk", "client_name", "client_version")}
    labels = {}
    for actor in actors:
        if actor in sessions:
            _, name, version = sessions[actor]
            labels[actor] = session_label(name, version, actor)
        elif looks_like_session_id(actor):
            labels[actor] = f"session · {session_hint(actor)}"
        else:
            labels[actor] = actor
    return labels


def label_todo_holders(todos) -> None:
    """Set each todo's ``holder_label`` (the board's lease column): a session as ``client
    version · hint``, anything else as the owner's hint, as before; one query for them all."""
    labels = holder_labels(todo.lease_owner for todo in todos)
    for todo in todos:
        label = labels.get(todo.lease_owner)
        todo.holder_label = label if label != todo.lease_owner else todo.lease_owner_hint
