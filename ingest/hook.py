"""``POST /hooks/<slug>``: a webhook delivery turned into todos, or refused.

The order of checks is chosen so that nothing unverified is parsed and nothing is written before
every check has passed: size (by Content-Length, then by a bounded read), webhook lookup, rate
limit, signature, then parsing, then the one write.

The hook is the hot path: ``answer_hook`` is a plain function from a
``switchboard.http.plain.Request`` to an ``Answer``, served straight from ASGI
(``switchboard/asgi.py``) in one thread hop, without Django's request machinery (see
switchboard/http/plain.py for why and what it keeps).
"""

import dataclasses
import logging
import re
import time
from urllib.parse import parse_qs

from django.conf import settings
from django.core.validators import slug_re
from django.db import DatabaseError
from django.utils import timezone
from django.utils.datastructures import CaseInsensitiveMapping

from switchboard import json_input, ratelimit, tracing
from switchboard import metrics as push_metrics
from switchboard.http import plain

from . import queries, senders, transitions, verification
from .models import Outcome, TrustMode, Webhook
from .problems import (MAX_ECHOED_SLUG_CHARS, Problem, check_declared_length, check_rate,
                       decode_utf8, is_json_type, media_type_of, one_line, parse_json_document,
                       storage_unavailable, too_large)

log = logging.getLogger("switchboard.ingest")

# The delivery id becomes part of an idempotency key (300 chars with slug and queue).
MAX_DELIVERY_ID_CHARS = 160
MAX_SLUG_CHARS = Webhook._meta.get_field("slug").max_length
# /hooks/<webhook_slug> (routed in switchboard/asgi.py), with an optional trailing slash served
# as is: senders do not follow redirects on POST.
HOOK_ROUTE_PATTERN = r"^hooks/(?P<webhook_slug>[^/]+)/?$"


# The whole 202 an anonymous sender of an unsigned webhook gets.
UNSIGNED_ACCEPTED = {"accepted": True}


def refusal_answer(status: int, code: str, message: str) -> plain.Answer:
    """Answers switchboard.http.plain gives without calling ``answer_hook`` (bad Host,
    internal error)."""
    return Problem(status, code, message).answer()


# Arrays and objects an unsigned body may hold, counted before decoding: a body costs per
# container far more than per byte (bench/ingest.py --anonymous).
UNSIGNED_MAX_JSON_CONTAINERS = 1000


def _check_anonymous_shape(text: str) -> None:
    cap = UNSIGNED_MAX_JSON_CONTAINERS
    if json_input.count_containers(text, cap) > cap:
        raise Problem(400, "too_complex",
                      f"unsigned webhooks take bodies of at most {cap} JSON arrays and objects")


def _parse_delivery_body(webhook, media_type: str, body: bytes) -> tuple[dict, bool]:
    """The payload, and whether it is known storable (``parse_json_document``)."""
    if is_json_type(media_type):
        text = decode_utf8(body)
        if not senders.get_sender(webhook.source).signed:
            _check_anonymous_shape(text)
        return parse_json_document(text)
    # A sender that posts forms (GitHub's and Gitea's "form" content type) puts the JSON in the
    # ``payload`` field; the signature covers the raw form body.
    takes_forms = senders.get_sender(webhook.source).takes_forms
    if media_type == "application/x-www-form-urlencoded" and takes_forms:
        try:
            fields = parse_qs(decode_utf8(body), strict_parsing=True, errors="strict")
        except (ValueError, UnicodeDecodeError):
            raise Problem(400, "malformed_body", "form body is malformed") from None
        if len(fields.get("payload", [])) != 1:
            raise Problem(400, "malformed_body", "form body needs exactly one payload field")
        return parse_json_document(fields["payload"][0], what="payload field")
    accepted = "application/json" + (
        " or application/x-www-form-urlencoded" if takes_forms else ""
    )
    raise Problem(415, "unsupported_media_type",
                  f"Content-Type must be {accepted}, got {media_type or 'none'}")


def _delivery_id(webhook, envelope, payload: dict) -> str:
    delivery_id = senders.get_sender(webhook.source).delivery_id(envelope, payload).strip()
    if len(delivery_id) > MAX_DELIVERY_ID_CHARS or not delivery_id.isprintable():
        raise Problem(400, "bad_delivery_id",
                      f"delivery id must be at most {MAX_DELIVERY_ID_CHARS} printable characters")
    return delivery_id


def _arrival_answer(arrival) -> dict:
    event_id = arrival.delivery_event.pk if arrival.delivery_event else None
    if event_id is None and arrival.todos:
        event_id = arrival.todos[0][0].delivery_event_id
    answer = {
        "delivery": str(event_id) if event_id is not None else None,
        "todos": [_todo_answer(todo, created, arrival.followups) for todo, created in arrival.todos],
    }
    if arrival.stopped or arrival.outcome == Outcome.STOPPED:
        answer["stopped"] = list(arrival.stopped)
    return answer


def _todo_answer(todo, created: bool, followups) -> dict:
    # A follow-up names the thread's live todo it joined (docs/work-control.md#threads).
    followup = str(todo.pk) in followups
    answer = {"id": str(todo.pk), "endpoint": todo.endpoint.slug, "queue": todo.queue,
              "duplicate": not created and not followup}
    if followup:
        answer["followup"] = True
    return answer


def _could_be_slug(value: str) -> bool:
    return len(value) <= MAX_SLUG_CHARS and slug_re.match(value) is not None


# Event and kind names an agent, a route and a doorbell will see: anything else (quotes,
# spaces, markup) is refused rather than cleaned, so what is stored is what was sent. Shaped
# like a queue name: a "-" first would read as an option where an agent's command or prompt
# starts with the kind (docs/runner.md#placeholders).
KIND_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# A handshake's challenge is echoed back; Slack's own are 48 characters.
MAX_CHALLENGE_CHARS = 200


def _claimed(request, names) -> str:
    for name in names:
        value = request.header(name)
        if value:
            return one_line(value, 200)
    return ""


def _observe(request, body: bytes) -> transitions.Observed:
    """What the delivery log keeps of this request, as the sender claimed it (a body over the
    cap was not read: its declared length stands for its size)."""
    size = len(body)
    declared = request.header("content-length") or ""
    if request.too_large and declared.isdigit():
        size = int(declared)
    return transitions.Observed(
        address=request.client, size=min(size, 2**31 - 1),
        body_sha256=transitions.body_digest(body) if body else "",
        delivery_id=_claimed(request, senders.DELIVERY_HEADERS),
        kind=_claimed(request, senders.EVENT_HEADERS),
        headers=transitions.safe_headers(request.headers),
    )


def _check_kind(kind: str, source: str) -> None:
    if kind and not KIND_RE.match(kind):
        raise Problem(400, "bad_kind",
                      f"event/kind must start with a letter or digit and be 1-64 of A-Z a-z "
                      f"0-9 _ . - (from {senders.get_sender(source).kind_origin})")


# Slugs found recently pass an address's unknown-slug block, so others' typos from a shared
# egress address cut off no real webhook; a hint only (every delivery still looks it up).
FOUND_SLUG_MEMORY_SECONDS = 600.0
_found_slugs: dict[str, float] = {}


def _recently_found(slug: str) -> bool:
    return _found_slugs.get(slug, 0.0) > time.monotonic()


def _note_found(slug: str) -> None:
    _found_slugs.pop(slug, None)  # re-insert: dict order is recency
    _found_slugs[slug] = time.monotonic() + FOUND_SLUG_MEMORY_SECONDS
    while len(_found_slugs) > ratelimit.MAX_LOCAL_BUCKETS:
        _found_slugs.pop(next(iter(_found_slugs)))


def _refuse_blocked_address(request, webhook_slug: str) -> None:
    """Before the lookup: an address out of its unknown-slug budget (as this process last heard,
    no Redis call) is refused without a query, unless the slug is one this process found."""
    refused = ratelimit.refuse_failing_client("hook-unknown", request.client)
    if not refused.allowed and not _recently_found(webhook_slug):
        raise _rate_limited(refused, settings.SWITCHBOARD_UNKNOWN_CLIENT_PER_MINUTE)


def _refuse_unknown_webhook(request, webhook_slug: str) -> Problem:
    verdict = ratelimit.charge_client_failure(
        "hook-unknown", request.client, per_minute=settings.SWITCHBOARD_UNKNOWN_CLIENT_PER_MINUTE)
    if not verdict.allowed:
        return _rate_limited(verdict, settings.SWITCHBOARD_UNKNOWN_CLIENT_PER_MINUTE)
    return Problem(404, "unknown_webhook",
                   f"no active webhook {webhook_slug[:MAX_ECHOED_SLUG_CHARS]!r}")


def _rate_limited(verdict, per_minute: int) -> Problem:
    return Problem(429, "rate_limited",
                   f"more than {per_minute} requests a minute; "
                   f"retry in {verdict.retry_after_seconds} s",
                   headers={"Retry-After": str(verdict.retry_after_seconds)})


def _give_back_verified_token(webhook) -> None:
    """The webhook's verified budget is for work: a request refused after ``_verify`` took
    its token gives it back."""
    ratelimit.give_back_token("ingest", f"ingest:{webhook.pk}",
                              per_minute=settings.SWITCHBOARD_INGEST_RATE_PER_MINUTE)


def _charge_repeat_to_the_sender(webhook, request) -> None:
    """A repeated or replayed signed delivery spends the budget of the address that sent it,
    not the webhook's: re-sending one captured body must not push the real sender into 429.
    The token ``_verify`` took for it goes back."""
    _give_back_verified_token(webhook)
    verdict = ratelimit.charge_client_failure(
        "hook-failures", f"{webhook.pk}:{request.client}",
        per_minute=settings.SWITCHBOARD_INGEST_FAILURES_PER_MINUTE)
    if not verdict.allowed:
        raise _rate_limited(verdict, settings.SWITCHBOARD_INGEST_FAILURES_PER_MINUTE)


def _verify(webhook, request, now):
    """Verify, spending the right budget: a failure spends its client address's budget
    for this webhook (and is a 429 once that is gone), a success the webhook's own — so no
    number of failures can push a verified sender into 429."""
    try:
        envelope = senders.verify_delivery(
            webhook, CaseInsensitiveMapping(request.headers), request.body, now=now)
    except verification.VerificationFailed as failure:
        raise _not_verified(webhook, request, failure) from None
    check_rate(f"ingest:{webhook.pk}")
    return envelope


def _not_verified(webhook, request, failure) -> Problem:
    """The 401 of a failed verification, charged to the client address's failure budget (a
    429 once that is spent)."""
    log.warning("webhook verification failed",
                extra={"webhook": webhook.slug, "reason": failure.reason})
    verdict = ratelimit.charge_client_failure(
        "hook-failures", f"{webhook.pk}:{request.client}",
        per_minute=settings.SWITCHBOARD_INGEST_FAILURES_PER_MINUTE)
    if not verdict.allowed:
        return _rate_limited(verdict, settings.SWITCHBOARD_INGEST_FAILURES_PER_MINUTE)
    # A stale timestamp gets its own code, as in the delivery log: the sender's clock (or a
    # replay) is the problem, not its secret.
    code = Outcome.STALE_TIMESTAMP if failure.stale else Outcome.BAD_SIGNATURE
    return Problem(401, code, f"delivery not verified: {failure.reason}", outcome=code)


def _check_signed_payload(webhook, request, payload: dict, now) -> None:
    """What the source signs inside the body (Linear's timestamp). A failure here is a failed
    verification like any other (or a 400 for a value outside its range)."""
    try:
        senders.check_payload(webhook, payload, now=now)
    except verification.VerificationFailed as failure:
        if failure.malformed:
            raise Problem(400, "bad_timestamp", failure.reason) from None
        raise _not_verified(webhook, request, failure) from None


def _is_handshake(webhook, payload: dict) -> bool:
    """Whether the delivery is its sender's handshake (Slack's url_verification)."""
    is_handshake = senders.get_sender(webhook.source).is_handshake
    return is_handshake is not None and is_handshake(payload)


def _answer_handshake(webhook, request, body: bytes, payload: dict, envelope, now):
    """A sender's handshake when its request URL is saved (Slack's url_verification): a signed
    body whose ``challenge`` is answered as is (200). No todo; the delivery log records it, and
    the replay ledger holds it, so the same request again is a duplicate charged to its sender."""
    kind = senders.get_sender(webhook.source).handshake_kind
    challenge = payload.get("challenge")
    if (not isinstance(challenge, str) or not challenge or len(challenge) > MAX_CHALLENGE_CHARS
            or not challenge.isprintable()):
        raise Problem(400, "malformed_body",
                      f"{kind} needs a challenge of 1-{MAX_CHALLENGE_CHARS} printable "
                      "characters")
    answer = plain.json_answer(200, {"challenge": challenge})

    def observe():
        return dataclasses.replace(_observe(request, body), kind=kind)

    if not transitions.take_url_verification(webhook, fingerprint=envelope.signed_digest,
                                             now=now):
        _charge_repeat_to_the_sender(webhook, request)
        transitions.record_refused(webhook, outcome=Outcome.DUPLICATE, status=200, now=now,
                                   observe=observe,
                                   reason=f"this signed {kind} was already answered")
        return answer
    transitions.record_refused(webhook, outcome=Outcome.ACCEPTED, status=200, now=now,
                               observe=observe, reason=f"{kind}: challenge answered, no todo")
    log.info(f"{webhook.source} {kind} answered", extra={"webhook": webhook.slug})
    return answer


def _retry_note(webhook, request) -> str:
    """The delivery log's note when the sender says this request is its retry."""
    note = senders.get_sender(webhook.source).retry_note
    return "" if note is None else note(request.header)


def _check_body_size(webhook, request) -> None:
    if request.too_large:
        raise too_large()
    check_declared_length(request.header("content-length"))
    if (not senders.get_sender(webhook.source).signed
            and len(request.body) > settings.SWITCHBOARD_UNSIGNED_MAX_BODY_BYTES):
        raise Problem(413, "too_large",
                      f"unsigned webhooks take bodies of at most "
                      f"{settings.SWITCHBOARD_UNSIGNED_MAX_BODY_BYTES} bytes")


def _duplicate_answer(event_id) -> dict:
    """A repeated timestamped request: the todos its first arrival created, as duplicates."""
    todos = queries.todos_of_delivery_event(event_id) if event_id else []
    return {
        "delivery": str(event_id) if event_id is not None else None,
        "todos": [{"id": str(todo.pk), "endpoint": todo.endpoint.slug, "queue": todo.queue,
                   "duplicate": True} for todo in todos],
    }


# The delivery's span carries the route, never the slug: an unsigned webhook's URL is all it
# takes to post to it.
HOOK_SPAN_NAME = "POST /hooks/{slug}"


def answer_hook(request: plain.Request) -> plain.Answer:
    """Verify one delivery and turn it into todos (202), or say why not. Runs in one thread
    hop (switchboard.http.plain): lookup, verification, rate limit and the one write. Every
    request naming a webhook is logged (``DeliveryRecord``): accepted ones in the delivery's own
    statement, refused ones capped per minute (``transitions.record_refused``). The delivery's
    span starts its trace, or continues the request's ``traceparent`` (docs/operating.md#traces)."""
    with tracing.delivery(HOOK_SPAN_NAME, request.header("traceparent"),
                          **{"http.request.method": request.method,
                             "http.route": "/hooks/{slug}"}) as span:
        answer = _answer_delivery(request, span)
        span.set(**{"http.response.status_code": answer.status})
    return answer


def _answer_delivery(request: plain.Request, span) -> plain.Answer:
    webhook_slug = request.slug
    webhook = None
    # Whether this request holds a token of the webhook's verified budget (``_verify``).
    holds_verified_token = False
    now = timezone.now()
    try:
        if request.method != "POST":
            raise Problem(405, "method_not_allowed", "POST a webhook delivery here",
                          headers={"Allow": "POST"})
        _refuse_blocked_address(request, webhook_slug)
        # A path that cannot be a slug (a NUL, say, which PostgreSQL refuses outright and
        # which turned into a 503) is answered like any unknown webhook, without a query.
        webhook, routes = (queries.find_webhook_with_routes(webhook_slug)
                           if _could_be_slug(webhook_slug) else (None, None))
        if webhook is None:
            raise _refuse_unknown_webhook(request, webhook_slug)
        _note_found(webhook_slug)
        _check_body_size(webhook, request)
        envelope = _verify(webhook, request, now)
        holds_verified_token = True
        body = request.body
        payload, payload_storable = _parse_delivery_body(
            webhook, media_type_of(request.header("content-type")), body)
        _check_signed_payload(webhook, request, payload, now)
        if _is_handshake(webhook, payload):
            holds_verified_token = False  # a repeat gives it back, the first one keeps it
            return _answer_handshake(webhook, request, body, payload, envelope, now)
        kind = senders.derive_kind(webhook.source, envelope.event, payload)
        _check_kind(kind, webhook.source)
        delivery_id = _delivery_id(webhook, envelope, payload)
        observed = _observe(request, body)
        if kind or delivery_id:
            observed = dataclasses.replace(observed, kind=kind or observed.kind,
                                           delivery_id=delivery_id or observed.delivery_id)
        body_sha256 = observed.body_sha256 or transitions.body_digest(body)
        try:
            arrival = transitions.ingest_delivery(
                webhook=webhook, routes=routes, trust=envelope.trust, delivery_id=delivery_id,
                kind=kind, title=senders.derive_title(webhook.source, kind, payload,
                                                      webhook_slug=webhook.slug),
                payload=payload, payload_storable=payload_storable, body_sha256=body_sha256,
                observed=observed,
                # Unsigned bodies prove nothing, so they have no replay to refuse.
                fingerprint="" if envelope.trust == TrustMode.UNVERIFIED
                else envelope.signed_digest or body_sha256,
                timestamped=bool(envelope.signed_digest), note=_retry_note(webhook, request),
                now=now,
            )
        except transitions.Refused as refused:
            holds_verified_token = False
            _charge_repeat_to_the_sender(webhook, request)
            if refused.outcome == Outcome.REPLAY:
                log.warning("webhook replay refused", extra={"webhook": webhook.slug,
                                                             "delivery_id": delivery_id[:64]})
                raise Problem(409, "replay",
                              "this signed body was already accepted as another delivery (another "
                              "delivery id, or another event); a sender's redelivery repeats "
                              "the first one's delivery id and event",
                              reason="body already accepted as another delivery") from None
            answer = _duplicate_answer(refused.duplicate_event_id)
            transitions.record_refused(webhook, outcome=Outcome.DUPLICATE, status=202,
                                       observe=lambda: observed, now=now,
                                       todo_ids=[t["id"] for t in answer["todos"]],
                                       reason="this signed request was already accepted")
            return plain.json_answer(202, answer)
    except Problem as problem:
        push_metrics.INGEST_REJECTED.labels(reason=problem.code).inc()
        if holds_verified_token:
            _give_back_verified_token(webhook)
        if webhook is not None:
            transitions.record_refused(
                webhook, outcome=problem.outcome, status=problem.status,
                observe=lambda: _observe(request, request.body), reason=problem.reason, now=now)
        return problem.answer()
    except DatabaseError as exc:
        push_metrics.INGEST_REJECTED.labels(reason="storage_unavailable").inc()
        return storage_unavailable(exc, webhook=webhook_slug)
    if arrival.outcome == Outcome.DUPLICATE:
        # A redelivery of a live delivery: a duplicate, charged as a repeat, yet still a 202
        # past the repeat budget, as its work is recorded (docs/reference.md#idempotency).
        try:
            _charge_repeat_to_the_sender(webhook, request)
        except Problem:
            pass
    push_metrics.INGEST_ACCEPTED.labels(source=webhook.source).inc()
    if tracing.enabled():
        span.set(**{"switchboard.webhook_id": webhook.pk, "switchboard.source": webhook.source,
                    "switchboard.kind": kind, "switchboard.delivery.size": len(body),
                    "switchboard.todo_ids": [str(todo.pk) for todo, _ in arrival.todos]})
    log.info("webhook delivery accepted", extra={
        "webhook": webhook.slug, "kind": kind, "todos": len(arrival.todos),
        "todos_created": sum(1 for _, created in arrival.todos if created),
    })
    if not senders.get_sender(webhook.source).signed:
        # Anyone who knows the URL may post here: they learn that it was taken, not which
        # endpoints and queues it reached or the ids of the rows it made.
        return plain.json_answer(202, UNSIGNED_ACCEPTED)
    return plain.json_answer(202, _arrival_answer(arrival))
