"""Doorbells: waking an agent's live MCP session when a todo is ready (CONTRACT §7, SPEC-0011).

A doorbell is a ``notifications/claude/channel`` on one session's notification stream. It is
lossy by design and never gates correctness: the durable queue is the record, and every todo
a doorbell names stays pending and pullable whatever happens to the push.

Three parts, kept apart so each is tested on its own:

* Frames (pure): the notification's ``params`` — one legible line of ``content`` with any
  ``</channel>`` neutralized, and identifier-safe string ``meta``. No lease, payload or secret.
* Eligibility (pure): only ``signed`` or ``operator`` todos attributed to a human are pushed.
* Ringing: ``ring_ready_todo`` is a publish listener (after commit only); it picks ONE session
  of the owning endpoint with a guarded UPDATE (``transitions.choose_doorbell_session``) and
  hands the frame to the channel layer fire-and-forget (``publish.send_to_group``), so neither a
  slow Redis nor a dead one can block or fail the request that committed the todo.
"""

import logging
import re

from django.db import transaction
from django.utils import timezone

from . import mcp_transport, publish
from . import transitions as session_transitions

log = logging.getLogger("switchboard.doorbell")

CHANNEL_METHOD = "notifications/claude/channel"
# The trust modes that may ring (SPEC-0011 "Sender Gate"): verified by source signature, or
# handed over by the endpoint's authenticated owner. Unverified deliveries never ring.
PUSH_TRUST = frozenset({"signed", "operator"})
DIGEST_KIND = "digest"
# A closing tag in any spelling a lenient parser might accept: case, inner whitespace.
_CLOSING_TAG_RE = re.compile(r"<\s*/\s*channel\s*>", re.IGNORECASE)
CLOSING_TAG_SUBSTITUTE = "«/channel»"
# The channel standard silently drops meta keys that are not identifier-safe.
META_KEY_RE = re.compile(r"^[a-z_][a-z0-9_]*$")
# One line the harness shows in-session: long enough for a GitHub-style title, short enough
# that a webhook cannot flood the agent's context through the doorbell.
CONTENT_MAX_CHARS = 300
META_VALUE_MAX_CHARS = 200


# -- frames (pure) -------------------------------------------------------------------------------


def neutralize(text) -> str:
    """One line of untrusted text made safe inside ``<channel>…</channel>``: newlines and runs
    of whitespace folded to one space, every closing tag replaced by «/channel»."""
    folded = " ".join(str(text).split())
    return _CLOSING_TAG_RE.sub(CLOSING_TAG_SUBSTITUTE, folded)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _meta(pairs) -> dict:
    """String meta with identifier-safe keys; empty values are left out."""
    meta = {}
    for key, value in pairs:
        if not META_KEY_RE.match(key):
            raise ValueError(f"meta key {key!r} is not identifier-safe")
        if value is not None and str(value) != "":
            meta[key] = _clip(neutralize(value), META_VALUE_MAX_CHARS)
    return meta


def todo_doorbell(todo) -> dict:
    """The ``params`` of a todo doorbell: ``{content, meta}``.

    ``meta``: ``todo_id``, ``queue``, and ``kind`` / ``source`` when the todo has them. A todo
    whose own kind is ``digest`` (kind is copied from the payload, an open vocabulary) carries
    it as ``todo_kind``, so no todo doorbell can pass for a digest (SPEC-0011)."""
    kind = neutralize(todo.kind or "")
    kind_key = "todo_kind" if kind.strip().lower() == DIGEST_KIND else "kind"
    meta = _meta([("todo_id", todo.pk), ("queue", todo.queue), (kind_key, kind),
                  ("source", todo.source)])
    label = f" [{meta[kind_key]}]" if kind_key in meta else ""
    content = f"Todo {todo.pk} ready in {neutralize(todo.queue)}{label}: {neutralize(todo.title)}"
    return {"content": _clip(content, CONTENT_MAX_CHARS), "meta": meta}


def is_digest(params: dict) -> bool:
    """The consumer's rule (SPEC-0011): a notification is a digest only when ``meta.kind`` is
    ``digest`` and it names no ``todo_id``."""
    meta = (params or {}).get("meta") or {}
    return meta.get("kind") == DIGEST_KIND and "todo_id" not in meta


# -- eligibility (pure) --------------------------------------------------------------------------


def is_push_eligible(trust: str, attributed_to_id) -> bool:
    """The sender gate: verified (signed) or operator-authored, and attributed to a human."""
    return trust in PUSH_TRUST and attributed_to_id is not None


# -- ringing -------------------------------------------------------------------------------------


def _context(todo, endpoint_slug: str) -> dict:
    # Ids only: never the bearer, the title or the payload.
    return {"endpoint": endpoint_slug, "todo_id": str(todo.pk)}


def send_doorbell(session_id: str, params: dict, context: dict) -> bool:
    """Hand one frame to the session's stream(s), wherever they are, without waiting."""
    return mcp_transport.notify_session(session_id, CHANNEL_METHOD, params, context=context)


def ring_todo(todo, *, now=None) -> str | None:
    """Ring one session of ``todo``'s endpoint for it. Returns the session id rung, or None
    when the todo may not ring (gate, scope) or no session is attached (silently dropped: the
    todo stays pending for pull)."""
    if todo.trust not in PUSH_TRUST:
        return None
    endpoint = todo.endpoint
    if not endpoint.active or not endpoint.covers(todo.queue):
        return None
    now = now or timezone.now()
    # One guarded statement picks the session AND re-checks the todo (still pending, trusted,
    # attributed to a human), so an ineligible or already-claimed todo rings nobody.
    session_id = session_transitions.choose_doorbell_session(
        endpoint_id=endpoint.pk, todo_id=todo.pk, now=now)
    context = _context(todo, endpoint.slug)
    if session_id is None:
        log.debug("doorbell not sent: no attached session", extra=context)
        return None
    send_doorbell(session_id, todo_doorbell(todo), {**context, "session": session_id[:8]})
    return session_id


def ring_ready_todo(todo, change: dict) -> None:
    """Publish listener (after commit): ring for a todo that just became ready."""
    if change.get("action") not in publish.READY_ACTIONS or todo.trust not in PUSH_TRUST:
        return
    ring_todo(todo)


def ring_on_commit(todos) -> None:
    """Ring for ``todos`` (already charged to their ring budget) once the caller commits."""
    todos = list(todos)
    if todos:
        transaction.on_commit(lambda: [ring_todo(todo) for todo in todos])


# -- reconnect -----------------------------------------------------------------------------------

# At most this many oldest waiting todos are rung on a stream (re)open (SPEC-0011): enough to
# get a restarted agent going, few enough not to flood it; the rest it drains by pull.
RECONNECT_RING_LIMIT = 5


def reconnect_frames(*, endpoint_id: int, session_id: str, now=None) -> list[tuple[dict, dict]]:
    """The doorbells a stream opening on ``session_id`` gets at once: its endpoint's oldest
    pending push-eligible todos in scope (≤ RECONNECT_RING_LIMIT), each charged to its ring
    budget and skipped while inside the reconnect cooldown. Returns ``[(params, log context)]``
    for the caller to write into THAT stream only."""
    now = now or timezone.now()
    endpoint, todos = session_transitions.record_reconnect_rings(
        endpoint_id=endpoint_id, limit=RECONNECT_RING_LIMIT, now=now)
    frames = []
    for todo in todos:
        context = {**_context(todo, endpoint.slug), "session": session_id[:8], "reason": "reconnect"}
        frames.append((todo_doorbell(todo), context))
    if frames:
        log.info("doorbell reconnect rings", extra={"endpoint": endpoint.slug,
                                                     "session": session_id[:8], "rung": len(frames)})
    return frames
