"""Doorbells: waking an agent's live MCP session when a todo is ready (docs/reference.md#doorbells).

A doorbell is a ``notifications/claude/channel`` on one session's notification stream. It is
lossy by design and never gates correctness: the durable queue is the record, and every todo
a doorbell names stays pending and pullable whatever happens to the push.

Three parts, kept apart so each is tested on its own:

* Frames (pure): the notification's ``params`` — one legible line of ``content`` in which no
  tag can be spelled, and identifier-safe string ``meta`` over a small alphabet
  (``doorbell_text``). No lease, payload or secret.
* Eligibility (pure): only ``signed`` or ``operator`` todos attributed to a human are pushed.
* Ringing: ``ring_ready_todo`` is a publish listener (after commit only); it picks ONE
  attached session of the owning endpoint with a guarded UPDATE
  (``rings.choose_doorbell_session``) and hands the frame to the channel layer
  fire-and-forget (``session_notify``), so neither a slow Redis nor a dead one can block or
  fail the request that committed the todo. Every doorbell rung or dropped is one INFO line.
* Digests (docs/reference.md#digests): ``digest_on_endpoint_change`` reacts to an endpoint's
  committed change (presence turned in, work resumed; ``endpoints.transitions`` announces it).
"""

import functools
import logging

from collections import Counter

from django.db import transaction
from django.utils import timezone

from endpoints.models import Presence
from switchboard import harness_text, metrics, tracing
from switchboard.db import statements
from todos import queries as todo_queries
from todos import ring_budget
from todos import usage

from channels_push.bus import publish
from channels_push.sessions import notify as session_notify
from channels_push.sessions import queries

from . import rings
from . import text as doorbell_text

log = logging.getLogger("switchboard.doorbell")

# The doorbell's JSON-RPC method: Claude Code's channel extension.
CHANNEL_METHOD = "notifications/claude/channel"

# The trust modes that may ring (the sender gate): verified by source signature, or handed
# over by the endpoint's authenticated owner. Unverified deliveries never ring. The same gate
# as SQL is todos.queries.RING_TRUST_SQL.
PUSH_TRUST = frozenset({"signed", "operator"})
DIGEST_KIND = "digest"
# One line the harness shows in-session: long enough for a GitHub-style title, short enough
# that a webhook cannot flood the agent's context through the doorbell.
CONTENT_MAX_CHARS = 300


# -- frames (pure) -------------------------------------------------------------------------------


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def todo_doorbell(todo) -> dict:
    """The ``params`` of a todo doorbell: ``{content, meta}``.

    ``meta``: ``todo_id``, ``queue``, ``kind`` / ``source`` when the todo has them, and its
    ``trust``, so the agent can weigh the content line (third-party text whatever the trust)
    without a round trip. A todo whose own kind is ``digest`` (kind is copied from the payload,
    an open vocabulary) carries it as ``todo_kind``, so no todo doorbell can pass for a
    digest."""
    kind = harness_text.sanitize_meta_value(todo.kind or "")
    kind_key = "todo_kind" if kind.lower() == DIGEST_KIND else "kind"
    meta = doorbell_text.build_meta([("todo_id", todo.pk), ("queue", todo.queue), (kind_key, kind),
                                     ("source", todo.source), ("trust", todo.trust)])
    label = f" [{meta[kind_key]}]" if kind_key in meta else ""
    content = (f"Todo {todo.pk} ready in {harness_text.sanitize_content(todo.queue)}{label}: "
               f"{harness_text.sanitize_content(todo.title)}")
    return {"content": _clip(content, CONTENT_MAX_CHARS), "meta": meta}


DIGEST_REASONS = frozenset({"clock_in", "operator", "shift_start", "override_end", "reconnect",
                            "resumed", "budget"})


def describe_age(age) -> str:
    """A waiting time as people say it: "45 s", "12 min", "3 h 5 min", "2 d 4 h"."""
    seconds = max(0, int(age.total_seconds()))
    if seconds < 60:
        return f"{seconds} s"
    minutes = seconds // 60
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def digest_doorbell(counts: dict, oldest_age, reason: str, *, unverified: int = 0) -> dict:
    """The ``params`` of a digest (docs/reference.md#digests): how much waits, where, and for
    how long — counts and queue names only (queue names are the operator's routing config, not
    webhook text), never a title or payload. ``counts``: queue -> pending count (what
    claim_next would hand); ``unverified``: how many of them came from an unauthenticated
    sender."""
    if reason not in DIGEST_REASONS:
        raise ValueError(f"unknown digest reason {reason!r}")
    queues = sorted(counts)
    pending = sum(counts.values())
    per_queue = ", ".join(f"{harness_text.sanitize_content(queue)} {counts[queue]}"
                          for queue in queues)
    content = (f"Digest ({reason}): {pending} pending todo{'s' if pending != 1 else ''} "
               f"({per_queue}), {unverified} unverified; oldest waiting "
               f"{describe_age(oldest_age)}. Drain them with claim_next.")
    meta = doorbell_text.build_meta([("kind", DIGEST_KIND), ("pending", pending),
                                     ("queues", queues), ("reason", reason),
                                     ("unverified", str(unverified))])
    return {"content": _clip(content, CONTENT_MAX_CHARS), "meta": meta}


def is_digest(params: dict) -> bool:
    """The consumer's rule: a notification is a digest only when ``meta.kind`` is
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
    """Hand one frame to the session's stream(s), wherever they are, without waiting. Its one
    INFO line tells the outcome where it is known: the stream logs "doorbell rung" when it
    writes the frame, or "doorbell dropped" when its buffer or backlog refuses it; here only a
    send the channel layer refused is logged ("doorbell dropped", counted). A line saying
    "rung" once the layer took it would be followed by the stream's drop for the same
    doorbell."""

    def dropped(reason, error):
        drop_doorbell(reason, {**context, "error": error} if error else context)

    return session_notify.notify_session(
        session_id, CHANNEL_METHOD, params, context=context,
        on_sent=lambda: log.debug("doorbell handed to the channel layer", extra=context),
        on_dropped=dropped)


def drop_doorbell(reason: str, context: dict) -> None:
    """A doorbell that reaches nobody: one INFO line (ids only) and the drop counter."""
    log.info(f"doorbell dropped: {reason}", extra=context)
    metrics.count_doorbell("dropped", reason)


def skip_doorbell(reason: str, context: dict) -> None:
    """A doorbell with nothing left to ring for (an agent claimed the todo first): one INFO
    line and a counter of its own, never counted as a drop."""
    log.info(f"doorbell skipped: {reason}", extra=context)
    metrics.count_doorbell("skipped", reason)


def _ring_session(session_id: str, has_stream: bool, params: dict, context: dict) -> None:
    """Send to one chosen session, or, when it has no open stream (attached by a recent request
    only), record the drop: the ring is spent either way, and it is never silent."""
    context = {**context, "session": session_id[:8]}
    if not has_stream:
        drop_doorbell("session has no open stream", context)
        return
    send_doorbell(session_id, params, context)


@functools.cache
def _endpoint_for_ring_select() -> str:
    """The endpoint's columns (built once per process: this runs after every commit that makes
    a todo ready)."""
    from endpoints.models import Endpoint

    return statements.model_columns(Endpoint, "e")[0]


def _find_endpoint_for_ring(endpoint_id: int, now):
    """The endpoint, fresh, with ``has_attached_session`` set, in one statement; None when it
    is gone."""
    from endpoints.models import Endpoint

    params = {"endpoint_id": endpoint_id}
    sql = (f"SELECT {_endpoint_for_ring_select()}, EXISTS (SELECT 1 FROM channels_push_mcpsession s"
           f" WHERE s.endpoint_id = e.id AND {queries.attached_sql('s', params, now)})"
           " FROM endpoints_endpoint e WHERE e.id = %(endpoint_id)s")
    # The hot path of every accepted delivery (after commit): prepared, C loaders, no
    # Model.__init__ on PostgreSQL (through Django's cursor it was a large share of a
    # delivery's CPU: bench/PROFILES.md).
    row = next(iter(statements.fetch_all(sql, params)), None)
    if row is None:
        return None
    endpoint = statements.instance_from_fetched(Endpoint, "e", row[:-1])
    endpoint.has_attached_session = bool(row[-1])
    return endpoint


def ring_todo(todo, *, now=None, charged: bool = False) -> str | None:
    """Ring one attached session of ``todo``'s endpoint for it, counting the ring toward the
    todo's ring budget in the statement that picks the session (``charged``: the caller's
    statement already did, as the sweep's does). Returns the session id rung (its push may
    still be dropped at the transport), or None when the todo may not ring (gate, scope), is
    held (presence out, work paused) or nobody is attached (then the drop is logged, nothing
    is spent: the todo stays pending for pull)."""
    if todo.trust not in PUSH_TRUST:
        return None
    if not publish.can_reach_streams():
        # A command on the in-memory layer: no stream is reachable, so nothing is recorded.
        return None
    if not tracing.enabled():
        return _ring_todo(todo, now=now, charged=charged)
    with tracing.span("doorbell", parent=todo.traceparent,
                      **{"switchboard.todo_id": str(todo.pk),
                         "switchboard.queue": todo.queue}) as span:
        session_id = _ring_todo(todo, now=now, charged=charged)
        span.set(**{"switchboard.doorbell.rung": session_id is not None})
    return session_id


def _ring_todo(todo, *, now, charged: bool) -> str | None:
    now = now or timezone.now()
    # Read fresh: the instance the todo carries may predate a clock out or a pause in this
    # very request or process, and those decide whether anything may ring at all.
    endpoint = _find_endpoint_for_ring(todo.endpoint_id, now)
    if endpoint is None or not endpoint.active or not endpoint.covers(todo.queue):
        return None
    context = _context(todo, endpoint.slug)
    if endpoint.presence_at(now) != Presence.IN or endpoint.is_paused(todo.queue):
        # Held (docs/reference.md#presence, docs/reference.md#pausing): no doorbell and no ring
        # recorded; the todo stays pending and pullable, and the digest on return (clock in,
        # resume) summarizes it.
        log.info("doorbell held: endpoint is out or the queue is paused", extra=context)
        return None
    if endpoint.has_budget and usage.over_budget(endpoint, now):
        # Held like a pause (docs/reference.md#usage-and-budgets): nothing could be claimed;
        # the next day's digest, or a raise's, summarizes it.
        log.info("doorbell held: endpoint is over its daily budget", extra=context)
        return None
    # One guarded statement picks the session and re-checks the todo; with no attached session
    # (the commonest case) it is skipped.
    chosen = rings.choose_doorbell_session(
        endpoint_id=endpoint.pk, todo_id=todo.pk, charge=not charged, now=now,
    ) if endpoint.has_attached_session else None
    if chosen is None:
        drop_doorbell("no attached session", context)
        return None
    if chosen is rings.NOT_RINGABLE:
        # Sessions are attached, and an agent took the todo (or an operator cancelled it)
        # between its commit and this ring: nothing was lost. Rare, so it may cost a read.
        cancelled = todo_queries.find_todo_state(todo.pk) == "cancelled"
        skip_doorbell("cancelled" if cancelled else "already claimed", context)
        return None
    session_id, has_stream = chosen
    _ring_session(session_id, has_stream, todo_doorbell(todo), context)
    return session_id


def ring_ready_todo(todo, change: dict) -> None:
    """Publish listener (after commit): ring for a todo that just became ready — created,
    retried, re-queued, or back to pending from a lapsed lease or a release."""
    if change.get("action") not in publish.READY_ACTIONS or todo.trust not in PUSH_TRUST:
        return
    if todo.state != "pending":  # a lapse on the last attempt dead-letters instead
        return
    if todo.not_before is not None:  # scheduled: rung when it comes due (the "due" change)
        return
    ring_todo(todo)


def ring_on_commit(todos) -> None:
    """Ring for ``todos`` (already charged to their ring budget) once the caller commits."""
    todos = list(todos)
    if todos:
        transaction.on_commit(lambda: [ring_todo(todo, charged=True) for todo in todos])


# -- the holder's doorbell (docs/work-control.md#threads) ----------------------------------------

# What a holder is rung for, and the line it reads: ids only, never the follow-up's text.
HOLDER_KINDS = {
    "followup": "Todo {id} has a new follow-up: call heartbeat to get it.",
    "cancel_requested": "Todo {id} is asked to stop: end it with cancel (or complete it if "
                        "the work is done).",
}


def holder_doorbell(todo, kind: str) -> dict:
    """The ``params`` of a doorbell to a todo's holder: ``meta.kind`` (``followup`` or
    ``cancel_requested``) and ``meta.todo_id``; the content names only the todo."""
    return {"content": HOLDER_KINDS[kind].format(id=todo.pk),
            "meta": doorbell_text.build_meta([("kind", kind), ("todo_id", todo.pk)])}


def ring_holder(todo, kind: str) -> bool:
    """Ring the session that holds ``todo`` (its ``lease_owner``), and no other, for ``kind``.
    Fire-and-forget like every doorbell; False when nothing was sent (not claimed, no stream
    reachable from this process, or the send dropped at once). Any trust: the holder already
    took the todo, and the frame carries no sender text."""
    if todo.state != "claimed" or not todo.lease_owner or not publish.can_reach_streams():
        return False
    context = {"todo_id": str(todo.pk), "kind": kind}
    return send_doorbell(todo.lease_owner, holder_doorbell(todo, kind), context)


def ring_holder_on_change(todo, change: dict) -> None:
    """Publish listener (after commit): a follow-up of a held todo, or a held todo asked to
    stop, rings its holder."""
    if change.get("action") in HOLDER_KINDS:
        ring_holder(todo, change["action"])


# -- digests and reconnect (docs/reference.md#digests) --------------------------------------------

def build_digest(endpoint, reason: str, now, *, cooldown=None) -> dict | None:
    """Mark what claim_next would hand ``endpoint`` as rung (no attempt spent) and build the
    digest that summarizes it; None when nothing is pending, or (with ``cooldown``) when every
    one of them was rung or digested within it (no digest is sent)."""
    counted = ring_budget.record_digest(endpoint=endpoint, now=now, cooldown=cooldown)
    if not counted:
        return None
    counts = Counter(queue for queue, _, _ in counted)
    oldest = min(created for _, created, _ in counted)
    unverified = sum(1 for _, _, trust in counted if trust not in PUSH_TRUST)
    return digest_doorbell(dict(counts), now - oldest, reason, unverified=unverified)


def send_digest(endpoint, reason: str, *, now=None) -> int:
    """One digest to at most min(pending, attached sessions) sessions of ``endpoint``, chosen
    as todo doorbells are (open streams first, then whoever was rung least recently): one
    waiting todo wakes one worker, never the whole pool. Returns how many sessions it went to;
    0 when none is attached (then nothing is marked: the reconnect digest will summarize
    instead) or nothing is pending."""
    now = now or timezone.now()
    context = {"endpoint": endpoint.slug, "reason": reason}
    if not publish.can_reach_streams():
        # Nothing marked: the digest would reach nobody, and the reconnect digest (sent by the
        # server, which can reach its streams) summarizes instead.
        log.info("doorbell digest not sent: no stream reachable from this process", extra=context)
        return 0
    if endpoint.paused_all or endpoint.presence_at(now) != Presence.IN:
        return 0
    if usage.over_budget(endpoint, now):
        return 0
    if not queries.has_attached_session(endpoint.pk, now):
        return 0
    params = build_digest(endpoint, reason, now)
    if params is None:
        return 0
    pending = int(params["meta"]["pending"])
    chosen = rings.choose_sessions(endpoint_id=endpoint.pk, limit=pending, now=now)
    for session_id, has_stream in chosen:
        _ring_session(session_id, has_stream, params, {**context, "pending": str(pending)})
    log.info("doorbell digest", extra={**context, "pending": str(pending), "sessions": len(chosen)})
    return len(chosen)


def digest_on_endpoint_change(endpoint, change: dict) -> None:
    """Endpoint listener (after commit): presence turned in, paused work resumed, or a budget
    raised above the day's spend — send the waiting work as one digest."""
    if change.get("action") == "budget_raised" and not usage.was_lifted(
            endpoint, change.get("before") or {}, change.get("at") or timezone.now()):
        return  # it was not held by the old budget, or is still over the new one
    if change.get("action") in ("presence_in", "resumed", "budget_raised"):
        send_digest(endpoint, change["reason"], now=change.get("at"))


def reconnect_frames(*, endpoint_id: int, session_id: str, now=None) -> list[tuple[dict, dict]]:
    """What a stream opening on ``session_id`` gets at once, for THAT stream only: one
    reconnect digest when its endpoint is in and anything is pending that was not rung or
    digested within RECONNECT_COOLDOWN, nothing while it is out. Returns ``[(params, log
    context)]``."""
    from endpoints.models import Endpoint

    now = now or timezone.now()
    endpoint = Endpoint.objects.get(pk=endpoint_id)
    if endpoint.presence_at(now) != Presence.IN or usage.over_budget(endpoint, now):
        return []
    # The cooldown: a stream that flaps (three reconnects in three seconds) gets one digest,
    # not three; a todo that arrived or went unrung meanwhile lifts it.
    params = build_digest(endpoint, "reconnect", now,
                          cooldown=rings.RECONNECT_COOLDOWN)
    if params is None:
        return []
    log.info("doorbell digest", extra={"endpoint": endpoint.slug, "reason": "reconnect",
                                       "pending": params["meta"]["pending"],
                                       "session": session_id[:8]})
    return [(params, {"endpoint": endpoint.slug, "session": session_id[:8], "reason": "reconnect"})]
