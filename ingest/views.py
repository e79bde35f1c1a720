"""HTTP surfaces of ingest (CONTRACT §5): ``POST /hooks/<slug>`` and the operator API
``POST /api/v1/endpoints/<slug>/todos``.

Both answer JSON for everything, errors included: ``{"error": {"code", "message"}}``. The order
of checks is chosen so that nothing unverified is parsed and nothing is written before every
check has passed: size (by Content-Length, then by a bounded read), webhook lookup, rate limit,
signature, then parsing, then the one write.

The hook is the hot path: ``answer_hook`` is a plain function from a
``switchboard.http.plain.Request`` to an ``Answer``, served straight from ASGI
(``switchboard/asgi.py``) in one thread hop, without Django's request machinery (see
switchboard/http/plain.py for why and what it keeps). The operator API is an ordinary Django view: it needs
sessions, CSRF and OIDC sign-in, and is not a hot path.
"""

import dataclasses
import logging
import re
import time
from pathlib import Path
from urllib.parse import parse_qs

from django.conf import settings
from django.contrib import messages
from django.core.validators import slug_re
from django.db import DatabaseError
from django.http import Http404, JsonResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST
from django.middleware.csrf import CsrfViewMiddleware
from django.utils import timezone
from django.utils.datastructures import CaseInsensitiveMapping
from django.views.decorators.csrf import csrf_exempt

from switchboard import metrics as push_metrics
from switchboard.http import plain
from channels_push.sessions import queries as push_queries
from endpoints.models import Endpoint, queue_name_validator
from switchboard import health, json_input, ratelimit
from todos import queries as todo_queries
from todos import transitions as todo_transitions
from todos import views as todo_views
from todos.models import Todo

from . import queries, sender_setup, titles, transitions, verification
from .models import DeliveryRecord, Outcome, Source, TrustMode, Webhook

log = logging.getLogger("switchboard.ingest")

# The delivery id becomes part of an idempotency key (300 chars with slug and queue).
MAX_DELIVERY_ID_CHARS = 160
MAX_TITLE_CHARS = 500
MAX_KIND_CHARS = 200
MAX_IDEMPOTENCY_KEY_CHARS = 200
MAX_SECRETS = 50
MAX_SECRET_NAME_CHARS = 100
MAX_SECRET_VALUE_CHARS = 64 * 1024
# An unknown slug is quoted back in the 404, cut short: the path is the caller's to fill.
MAX_ECHOED_SLUG_CHARS = 64
MAX_SLUG_CHARS = 64  # Webhook.slug's max_length
# /hooks/<webhook_slug> (routed in switchboard/asgi.py), with an optional trailing slash served
# as is: senders do not follow redirects on POST.
HOOK_ROUTE_PATTERN = r"^hooks/(?P<webhook_slug>[^/]+)/?$"
# Forms are accepted where the source can send them (GitHub's and Gitea's "form" content
# type: the JSON is in the ``payload`` field, the signature covers the raw form body).
FORM_SOURCES = (Source.GITHUB, Source.GITEA)


# The whole 202 an anonymous sender of an unsigned webhook gets.
UNSIGNED_ACCEPTED = {"accepted": True}

# Refusals the delivery log records, by status, unless the Problem names its own outcome.
OUTCOME_FOR_STATUS = {400: Outcome.MALFORMED, 401: Outcome.BAD_SIGNATURE, 409: Outcome.REPLAY,
                      413: Outcome.TOO_LARGE, 415: Outcome.UNSUPPORTED_TYPE,
                      429: Outcome.RATE_LIMITED}


class Problem(Exception):
    """An answer other than success: HTTP status, machine code, human message."""

    def __init__(self, status: int, code: str, message: str, headers=None, *, outcome=None,
                 reason=None):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = headers or {}
        # For the delivery log: the outcome when the status alone does not say it, and the
        # reason when the message is not the line to keep.
        self.outcome = outcome or OUTCOME_FOR_STATUS.get(status, Outcome.MALFORMED)
        self.reason = reason or message

    def payload(self) -> dict:
        return {"error": {"code": self.code, "message": self.message}}

    def response(self) -> JsonResponse:
        answer = JsonResponse(self.payload(), status=self.status)
        for name, value in self.headers.items():
            answer[name] = value
        return answer

    def answer(self) -> plain.Answer:
        return plain.json_answer(self.status, self.payload(), self.headers)


def refusal_answer(status: int, code: str, message: str) -> plain.Answer:
    """Answers switchboard.http.plain gives without calling ``answer_hook`` (bad Host, internal error)."""
    return Problem(status, code, message).answer()


# -- shared steps --------------------------------------------------------------------------------


def _check_declared_length(declared: str | None) -> None:
    declared = declared or ""
    if declared.strip():
        try:
            length = int(declared)
        except ValueError:
            raise Problem(400, "bad_request", "Content-Length is not a number") from None
        if length > settings.SWITCHBOARD_MAX_BODY_BYTES:
            raise _too_large()


def _too_large() -> Problem:
    return Problem(413, "too_large",
                   f"body exceeds the {settings.SWITCHBOARD_MAX_BODY_BYTES}-byte limit")


def _read_body(request) -> bytes:
    """Read the raw body once, never more than the cap plus one byte (a body without a
    Content-Length, e.g. chunked, is cut off here)."""
    body = request.read(settings.SWITCHBOARD_MAX_BODY_BYTES + 1)
    if len(body) > settings.SWITCHBOARD_MAX_BODY_BYTES:
        raise _too_large()
    return body


def _check_rate(scope: str) -> None:
    verdict = ratelimit.take_token("ingest", scope,
                                   per_minute=settings.SWITCHBOARD_INGEST_RATE_PER_MINUTE)
    if not verdict.allowed:
        raise Problem(429, "rate_limited",
                      f"more than {settings.SWITCHBOARD_INGEST_RATE_PER_MINUTE} requests a minute; "
                      f"retry in {verdict.retry_after_seconds} s",
                      headers={"Retry-After": str(verdict.retry_after_seconds)})


def _media_type(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def _is_json_type(media_type: str) -> bool:
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


def _parse_json_document(text: str, *, what: str = "body",
                         walk: bool = True) -> tuple[dict, bool]:
    """The JSON object in ``text`` (a Problem otherwise), and whether it is known storable:
    plainly (``json_input.is_plainly_storable``, no walk needed) or walked here, so the todos
    made of it never walk it again. ``walk=False``: the caller checks the fields itself,
    naming the one at fault (the second value then says only "plainly storable")."""
    # Strict JSON: NaN/Infinity and literals that overflow to inf (valid JSON such as 1e400,
    # which jsonb cannot store) are a 400 naming the problem, not a failed write later.
    try:
        value = json_input.loads_strict(text)
    except json_input.TooDeep as exc:
        raise Problem(400, "too_deep", f"{what}: {exc}") from None
    except ValueError as exc:
        # The decoder's messages give a position or name a number (cut to 40 characters);
        # they never quote the body beyond that.
        raise Problem(400, "malformed_body", f"{what} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise Problem(400, "malformed_body", f"{what} must be a JSON object")
    plain = json_input.is_plainly_storable(text)
    if not plain and walk:  # else there is nothing for the walk to find (is_plainly_storable)
        # PostgreSQL's jsonb refuses NUL characters and lone surrogates that Python's json
        # accepts: a 400 here instead of a failed write. Walked once, here, for every route.
        reason = json_input.unstorable_reason(value)
        if reason is not None:
            raise Problem(400, "malformed_body", f"{what}: a JSON value {reason}")
        return value, True
    return value, plain


def _decode_utf8(body: bytes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise Problem(400, "malformed_body", "body is not UTF-8") from None


def _storage_unavailable(exc, **context) -> Problem:
    """The database failed: nothing was committed, so the sender should retry (every source
    retries on 5xx). Only the error's type is logged: a driver's message can quote row values,
    which here means the body."""
    health.note_database_unavailable(exc, route="ingest", **context)
    return Problem(503, "unavailable", "could not store the delivery; nothing was kept, retry",
                   headers=health.unavailable_headers())


def _one_line(value: str, limit: int) -> str:
    if not value.isprintable():  # else there is nothing to drop: skip the walk
        value = "".join(ch for ch in value if ch.isprintable())
    return value.strip()[:limit]


# -- POST /hooks/<slug> --------------------------------------------------------------------------


def _parse_delivery_body(webhook, media_type: str, body: bytes) -> tuple[dict, bool]:
    """The payload, and whether it is known storable (``_parse_json_document``)."""
    if _is_json_type(media_type):
        return _parse_json_document(_decode_utf8(body))
    if media_type == "application/x-www-form-urlencoded" and webhook.source in FORM_SOURCES:
        try:
            fields = parse_qs(_decode_utf8(body), strict_parsing=True, errors="strict")
        except (ValueError, UnicodeDecodeError):
            raise Problem(400, "malformed_body", "form body is malformed") from None
        if len(fields.get("payload", [])) != 1:
            raise Problem(400, "malformed_body", "form body needs exactly one payload field")
        return _parse_json_document(fields["payload"][0], what="payload field")
    accepted = "application/json" + (
        " or application/x-www-form-urlencoded" if webhook.source in FORM_SOURCES else ""
    )
    raise Problem(415, "unsupported_media_type",
                  f"Content-Type must be {accepted}, got {media_type or 'none'}")


def _delivery_id(webhook, envelope, payload: dict) -> str:
    delivery_id = envelope.delivery_id
    if webhook.source == Source.STRIPE:
        delivery_id = payload.get("id") if isinstance(payload.get("id"), str) else ""
    elif webhook.source == Source.STANDARD and isinstance(payload.get("event_id"), str):
        # Cairn signs its event_id inside the body; it is the stable id across redeliveries.
        delivery_id = payload["event_id"]
    elif webhook.source == Source.SLACK:
        # Slack's retries (X-Slack-Retry-Num) keep the event_id: they fold into the live todo.
        delivery_id = payload.get("event_id") if isinstance(payload.get("event_id"), str) else ""
    delivery_id = delivery_id.strip()
    if len(delivery_id) > MAX_DELIVERY_ID_CHARS or not delivery_id.isprintable():
        raise Problem(400, "bad_delivery_id",
                      f"delivery id must be at most {MAX_DELIVERY_ID_CHARS} printable characters")
    return delivery_id


def _arrival_answer(arrival) -> dict:
    event_id = arrival.delivery_event.pk if arrival.delivery_event else None
    if event_id is None and arrival.todos:
        event_id = arrival.todos[0][0].delivery_event_id
    return {
        "delivery": str(event_id) if event_id is not None else None,
        "todos": [
            {"id": str(todo.pk), "endpoint": todo.endpoint.slug, "queue": todo.queue,
             "duplicate": not created}
            for todo, created in arrival.todos
        ],
    }


def _could_be_slug(value: str) -> bool:
    return len(value) <= MAX_SLUG_CHARS and slug_re.match(value) is not None


# Event and kind names an agent, a route and a doorbell will see (CONTRACT §12): anything else
# (quotes, spaces, markup) is refused rather than cleaned, so what is stored is what was sent.
KIND_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# The event header each source names its event in (the claimed kind in the delivery log).
EVENT_HEADERS = ("x-github-event", "x-forgejo-event", "x-gitea-event", "x-gitlab-event",
                 "linear-event", "sentry-hook-resource")
DELIVERY_HEADERS = ("x-github-delivery", "x-forgejo-delivery", "x-gitea-delivery",
                    "idempotency-key", "x-gitlab-event-uuid", "webhook-id", "linear-delivery",
                    "request-id")
# Slack's url_verification challenge is echoed back; Slack's own are 48 characters.
MAX_CHALLENGE_CHARS = 200


def _claimed(request, names) -> str:
    for name in names:
        value = request.header(name)
        if value:
            return _one_line(value, 200)
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
        delivery_id=_claimed(request, DELIVERY_HEADERS), kind=_claimed(request, EVENT_HEADERS),
        headers=transitions.safe_headers(request.headers),
    )


def _check_kind(kind: str) -> None:
    if kind and not KIND_RE.match(kind):
        raise Problem(400, "bad_kind",
                      "event/kind must be 1-64 of A-Z a-z 0-9 _ . - (from the event header and "
                      "the payload's action or type)")


# Webhook slugs this process found recently, and until when they pass an address's
# unknown-slug block: a shared egress address (a CI fleet, a source's own senders) spent by
# somebody's typos must not cut off the webhooks it really delivers to. Only a hint: every
# delivery still looks its webhook up. Bounded like the rate limiter's local state.
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


def _charge_repeat_to_the_sender(webhook, request) -> None:
    """A repeated or replayed signed delivery spends the budget of the address that sent it,
    not the webhook's (§12): re-sending one captured body must not push the real sender into
    429. The token ``_verify`` took for it goes back."""
    ratelimit.give_back_token("ingest", f"ingest:{webhook.pk}",
                              per_minute=settings.SWITCHBOARD_INGEST_RATE_PER_MINUTE)
    verdict = ratelimit.charge_client_failure(
        "hook-failures", f"{webhook.pk}:{request.client}",
        per_minute=settings.SWITCHBOARD_INGEST_FAILURES_PER_MINUTE)
    if not verdict.allowed:
        raise _rate_limited(verdict, settings.SWITCHBOARD_INGEST_FAILURES_PER_MINUTE)


def _verify(webhook, request, now):
    """Verify, spending the right budget (§12): a failure spends its client address's budget
    for this webhook (and is a 429 once that is gone), a success the webhook's own — so no
    number of failures can push a verified sender into 429."""
    try:
        envelope = verification.verify_delivery(
            webhook, CaseInsensitiveMapping(request.headers), request.body, now=now)
    except verification.VerificationFailed as failure:
        raise _not_verified(webhook, request, failure) from None
    _check_rate(f"ingest:{webhook.pk}")
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
    verification like any other: the webhook gets back the token ``_verify`` took for it."""
    try:
        verification.check_payload(webhook, payload, now=now)
    except verification.VerificationFailed as failure:
        ratelimit.give_back_token("ingest", f"ingest:{webhook.pk}",
                                  per_minute=settings.SWITCHBOARD_INGEST_RATE_PER_MINUTE)
        raise _not_verified(webhook, request, failure) from None


def _is_url_verification(webhook, payload: dict) -> bool:
    return webhook.source == Source.SLACK and payload.get("type") == "url_verification"


def _answer_url_verification(webhook, request, body: bytes, payload: dict, now):
    """Slack's handshake when an Events API request URL is saved: a signed body whose
    ``challenge`` is answered as is (200). No todo; the delivery log records it."""
    challenge = payload.get("challenge")
    if (not isinstance(challenge, str) or not challenge or len(challenge) > MAX_CHALLENGE_CHARS
            or not challenge.isprintable()):
        raise Problem(400, "malformed_body",
                      f"url_verification needs a challenge of 1-{MAX_CHALLENGE_CHARS} printable "
                      "characters")
    transitions.record_refused(
        webhook, outcome=Outcome.ACCEPTED, status=200, now=now,
        observe=lambda: dataclasses.replace(_observe(request, body), kind="url_verification"),
        reason="url_verification: challenge answered, no todo")
    log.info("slack url_verification answered", extra={"webhook": webhook.slug})
    return plain.json_answer(200, {"challenge": challenge})


def _retry_note(webhook, request) -> str:
    """Slack says when a request is its retry of an unanswered one: kept in the delivery log."""
    if webhook.source != Source.SLACK or not request.header("x-slack-retry-num"):
        return ""
    reason = _one_line(request.header("x-slack-retry-reason") or "", 40)
    return (f"slack retry {_one_line(request.header('x-slack-retry-num'), 8)}"
            + (f" ({reason})" if reason else ""))


def _check_body_size(webhook, request) -> None:
    if request.too_large:
        raise _too_large()
    _check_declared_length(request.header("content-length"))
    if webhook.source == Source.UNSIGNED and len(request.body) > settings.SWITCHBOARD_UNSIGNED_MAX_BODY_BYTES:
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


def answer_hook(request: plain.Request) -> plain.Answer:
    """Verify one delivery and turn it into todos (202), or say why not. Runs in one thread
    hop (switchboard.http.plain): lookup, verification, rate limit and the one write. Every request naming
    a webhook is logged (``DeliveryRecord``): accepted ones in the delivery's own statement,
    refused ones capped per minute (``transitions.record_refused``)."""
    webhook_slug = request.slug
    webhook = None
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
        body = request.body
        payload, payload_storable = _parse_delivery_body(
            webhook, _media_type(request.header("content-type")), body)
        _check_signed_payload(webhook, request, payload, now)
        if _is_url_verification(webhook, payload):
            return _answer_url_verification(webhook, request, body, payload, now)
        kind = titles.derive_kind(webhook.source, envelope.event, payload)
        _check_kind(kind)
        delivery_id = _delivery_id(webhook, envelope, payload)
        observed = _observe(request, body)
        if kind or delivery_id:
            observed = dataclasses.replace(observed, kind=kind or observed.kind,
                                           delivery_id=delivery_id or observed.delivery_id)
        body_sha256 = observed.body_sha256 or transitions.body_digest(body)
        try:
            arrival = transitions.ingest_delivery(
                webhook=webhook, routes=routes, trust=envelope.trust, delivery_id=delivery_id,
                kind=kind, title=titles.derive_title(webhook.source, kind, payload,
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
            _charge_repeat_to_the_sender(webhook, request)
            if refused.outcome == Outcome.REPLAY:
                log.warning("webhook replay refused", extra={"webhook": webhook.slug,
                                                             "delivery_id": delivery_id[:64]})
                raise Problem(409, "replay",
                              "this signed body was already accepted under another delivery id; "
                              "a sender's redelivery keeps its delivery id",
                              reason="body already accepted under another delivery id") from None
            answer = _duplicate_answer(refused.duplicate_event_id)
            transitions.record_refused(webhook, outcome=Outcome.DUPLICATE, status=202,
                                       observe=lambda: observed, now=now,
                                       todo_ids=[t["id"] for t in answer["todos"]],
                                       reason="this signed request was already accepted")
            return plain.json_answer(202, answer)
    except Problem as problem:
        push_metrics.INGEST_REJECTED.labels(reason=problem.code).inc()
        if webhook is not None:
            transitions.record_refused(
                webhook, outcome=problem.outcome, status=problem.status,
                observe=lambda: _observe(request, request.body), reason=problem.reason, now=now)
        return problem.answer()
    except DatabaseError as exc:
        push_metrics.INGEST_REJECTED.labels(reason="storage_unavailable").inc()
        return _storage_unavailable(exc, webhook=webhook_slug).answer()
    if arrival.todos and not any(created for _, created in arrival.todos):
        # A redelivery of a live delivery (same id, §4): answered as a duplicate, charged as
        # a repeat. The answer stays a 202 even past the sender's repeat budget: its work is
        # already recorded, and a genuine sender retrying must not be told otherwise.
        try:
            _charge_repeat_to_the_sender(webhook, request)
        except Problem:
            pass
    push_metrics.INGEST_ACCEPTED.labels(source=webhook.source).inc()
    log.info("webhook delivery accepted", extra={
        "webhook": webhook.slug, "kind": kind, "todos": len(arrival.todos),
        "todos_created": sum(1 for _, created in arrival.todos if created),
    })
    if webhook.source == Source.UNSIGNED:
        # Anyone who knows the URL may post here: they learn that it was taken, not which
        # endpoints and queues it reached or the ids of the rows it made.
        return plain.json_answer(202, UNSIGNED_ACCEPTED)
    return plain.json_answer(202, _arrival_answer(arrival))


# -- POST /api/v1/endpoints/<slug>/todos --------------------------------------------------------


def _csrf_failure(request):
    """Session-authenticated writes need a CSRF token (the view is csrf_exempt so that token-
    authenticated clients need none); run Django's own check for the session case."""
    check = CsrfViewMiddleware(lambda req: None)
    check.process_request(request)
    return check.process_view(request, None, (), {})


def _authenticate_operator(request):
    """The human behind the request: a personal API token (``Authorization: Bearer sbo_…``),
    else the Django session (password or OIDC sign-in), which must also pass CSRF."""
    header = request.META.get("HTTP_AUTHORIZATION", "")
    if header:
        scheme, _, token = header.partition(" ")
        user = queries.find_operator_for_token(token.strip()) if scheme.lower() == "bearer" else None
        if user is None:
            raise Problem(401, "unauthenticated", "bad or revoked API token",
                          headers={"WWW-Authenticate": 'Bearer realm="switchboard"'})
        return user
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        raise Problem(401, "unauthenticated",
                      "sign in, or send Authorization: Bearer <personal API token>",
                      headers={"WWW-Authenticate": 'Bearer realm="switchboard"'})
    if _csrf_failure(request) is not None:
        raise Problem(403, "csrf_failed", "session requests need a CSRF token (X-CSRFToken)")
    return user


def _optional_str(data: dict, name: str, limit: int) -> str:
    value = data.get(name)
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > limit:
        raise Problem(400, "invalid_argument", f"{name} must be a string of at most {limit} characters")
    return value


HAND_OVER_FIELDS = ("queue", "title", "payload", "kind", "idempotency_key", "secrets",
                    "priority", "not_before", "delay_seconds", "requires_approval")


def _hand_over_arguments(endpoint, data: dict, *, now, plainly_storable: bool = False) -> dict:
    unknown = sorted(set(data) - set(HAND_OVER_FIELDS))
    if unknown:
        raise Problem(400, "invalid_argument", f"unknown fields: {unknown}")
    if not plainly_storable:
        # Text the database cannot take (NUL, a lone surrogate) is refused naming its field,
        # before anything is looked up or written.
        for name in HAND_OVER_FIELDS:
            reason = json_input.unstorable_reason(data.get(name))
            if reason is not None:
                raise Problem(400, "invalid_argument", f"{name} {reason}")
    queue = data.get("queue")
    if not isinstance(queue, str):
        raise Problem(400, "invalid_argument", "queue (a queue name) is required")
    try:
        queue_name_validator(queue)
    except Exception:
        raise Problem(400, "invalid_argument", "queue names are 1-64 of A-Z a-z 0-9 _ . -") from None
    if not endpoint.covers(queue):
        raise Problem(400, "invalid_argument",
                      f"queue {queue!r} is outside endpoint {endpoint.slug}'s scope")
    title = _optional_str(data, "title", MAX_TITLE_CHARS)
    if not title.strip():
        raise Problem(400, "invalid_argument", "title (one line) is required")
    payload = data.get("payload")
    if payload is not None and not isinstance(payload, dict):
        raise Problem(400, "invalid_argument", "payload must be a JSON object")
    secret_values = data.get("secrets")
    if secret_values is not None:
        if (not isinstance(secret_values, dict) or len(secret_values) > MAX_SECRETS
                or not all(isinstance(v, str) and len(v) <= MAX_SECRET_VALUE_CHARS
                           for v in secret_values.values())
                or not all(0 < len(k) <= MAX_SECRET_NAME_CHARS for k in secret_values)):
            raise Problem(400, "invalid_argument",
                          f"secrets must be an object of at most {MAX_SECRETS} name -> string values")
        if secret_values and payload and "secrets" in payload:
            raise Problem(400, "invalid_argument",
                          'payload.secrets is reserved for secret refs when secrets are given')
    key = _optional_str(data, "idempotency_key", MAX_IDEMPOTENCY_KEY_CHARS)
    requires_approval = data.get("requires_approval", False)
    if not isinstance(requires_approval, bool):
        raise Problem(400, "invalid_argument", "requires_approval must be true or false")
    return {
        "requires_approval": requires_approval,
        "queue": queue, "title": title, "payload": payload,
        "kind": _one_line(_optional_str(data, "kind", MAX_KIND_CHARS), MAX_KIND_CHARS),
        "idempotency_key": key or None, "secret_values": secret_values or None,
        **_work_control_arguments(data, now),
    }


def _work_control_arguments(data: dict, now) -> dict:
    """The hand-over's ``priority`` and ``not_before``/``delay_seconds`` (docs/work-control.md),
    checked by the same functions every surface uses; a bad one is a 400 naming its field."""
    try:
        priority = data.get("priority")
        return {
            "priority": (todo_transitions.PRIORITY_DEFAULT if priority is None
                         else todo_transitions.check_priority(priority)),
            "not_before": todo_transitions.resolve_not_before(
                not_before=data.get("not_before"), delay_seconds=data.get("delay_seconds"),
                now=now),
        }
    except todo_transitions.Refusal as refusal:
        raise Problem(400, refusal.code, refusal.message) from None


@csrf_exempt
def hand_over(request, endpoint_slug):
    """An operator hands their endpoint a todo. 201 with the todo; 200 with the existing live
    todo when the idempotency key repeats (nothing new is written or rung)."""
    try:
        if request.method != "POST":
            raise Problem(405, "method_not_allowed", "POST a todo here")
        _check_declared_length(request.META.get("CONTENT_LENGTH"))
        operator = _authenticate_operator(request)
        reason = json_input.unstorable_reason(endpoint_slug)
        if reason is not None:  # PostgreSQL would refuse the lookup itself (a false 503)
            raise Problem(400, "invalid_argument", f"the endpoint slug in the path {reason}")
        # Somebody else's endpoint looks exactly like a missing one.
        endpoint = Endpoint.objects.filter(slug=endpoint_slug, active=True, owner=operator).first()
        if endpoint is None:
            raise Problem(404, "not_found",
                          f"no endpoint {endpoint_slug[:MAX_ECHOED_SLUG_CHARS]!r} of yours")
        _check_rate(f"operator:{operator.pk}")
        body = _read_body(request)
        if not _is_json_type(_media_type(request.META.get("CONTENT_TYPE"))):
            raise Problem(415, "unsupported_media_type", "Content-Type must be application/json")
        data, plain = _parse_json_document(_decode_utf8(body), walk=False)
        now = timezone.now()
        arguments = _hand_over_arguments(endpoint, data, plainly_storable=plain, now=now)
        todo, created = transitions.hand_over_todo(
            endpoint=endpoint, operator=operator, body_sha256=transitions.body_digest(body),
            now=now, **arguments,
        )
    except Problem as problem:
        push_metrics.INGEST_REJECTED.labels(reason=problem.code).inc()
        return problem.response()
    except DatabaseError as exc:
        push_metrics.INGEST_REJECTED.labels(reason="storage_unavailable").inc()
        return _storage_unavailable(exc, endpoint=endpoint_slug).response()
    push_metrics.INGEST_ACCEPTED.labels(source="operator").inc()
    log.info("operator hand-over", extra={
        "endpoint": endpoint.slug, "operator": operator.get_username(), "todo_id": todo.pk,
        "duplicate": not created,
    })
    return JsonResponse({"todo": todo_queries.todo_as_dict(todo), "duplicate": not created},
                        status=201 if created else 200)


@csrf_exempt
def endpoint_stats(request, endpoint_slug):
    """``GET /api/v1/endpoints/<slug>/stats`` (docs/work-control.md#stats): per queue, what
    waits, runs and finished in the last day, and the endpoint's live sessions, for scripts
    that poll. Authenticated and owned like the hand-over: another operator's endpoint is a
    404, as a missing one. A fixed number of statements, each an index range of this
    endpoint's rows (todos.queries.endpoint_queue_stats)."""
    try:
        if request.method != "GET":
            raise Problem(405, "method_not_allowed", "GET the stats")
        operator = _authenticate_operator(request)
        if json_input.unstorable_reason(endpoint_slug) is not None:
            raise Problem(404, "not_found", "no such endpoint of yours")
        endpoint = Endpoint.objects.filter(slug=endpoint_slug, owner=operator).first()
        if endpoint is None:
            raise Problem(404, "not_found",
                          f"no endpoint {endpoint_slug[:MAX_ECHOED_SLUG_CHARS]!r} of yours")
        _check_rate(f"operator:{operator.pk}")
        now = timezone.now()
        queues = todo_queries.endpoint_queue_stats(endpoint, now=now)
        sessions = push_queries.live_sessions(endpoint.pk, now)
    except Problem as problem:
        return problem.response()
    except DatabaseError as exc:
        return _storage_unavailable(exc, endpoint=endpoint_slug).response()
    return JsonResponse({
        "endpoint": endpoint.slug,
        "queues": queues,
        # The client as it named itself; never the session id (a handle of its session).
        "sessions": [{"client": " ".join(part for part in (row["client_name"],
                                                           row["client_version"]) if part),
                      "streaming": row["streaming"],
                      "last_seen_at": todo_queries.iso_time(row["last_seen_at"])} for row in sessions],
    })


# -- POST /api/v1/todos/<id>/<action>: an operator acts on one of their todos -------------------


def _priority_action(caller, todo_id, data: dict):
    if "priority" not in data:
        raise Problem(400, "invalid_argument", "priority (an integer from -100 to 100) is required")
    return todo_transitions.set_priority_todo(caller, todo_id, data["priority"])


# action -> (the JSON fields it takes, what it does). Each is one guarded transition of
# todos.transitions; its refusal is answered with the transition's code.
TODO_ACTIONS = {
    "priority": (("priority",), _priority_action),
    "run_now": ((), lambda caller, todo_id, data: todo_transitions.run_now_todo(caller, todo_id)),
    "cancel": (("reason",), lambda caller, todo_id, data: todo_transitions.cancel_todo(
        caller, todo_id, reason=data.get("reason"))),
    "approve": ((), lambda caller, todo_id, data: todo_transitions.approve_todo(caller, todo_id)),
    "reject": (("reason",), lambda caller, todo_id, data: todo_transitions.reject_todo(
        caller, todo_id, reason=data.get("reason"))),
}
# The spelling with a hyphen, as URLs usually have it, is the same action.
TODO_ACTION_ALIASES = {"run-now": "run_now"}
# Refusal code -> HTTP status. Anything else a transition refuses is a conflict with the
# todo's state (409).
REFUSAL_STATUS = {"invalid_argument": 400, "not_found": 404}


def _owned_todo(operator, todo_id: str) -> Todo:
    """The operator's todo (its endpoint theirs), else 404: another's looks like a missing one."""
    if not (todo_id.isascii() and todo_id.isdigit() and 0 < int(todo_id) < 2**63):
        raise Problem(404, "not_found", f"no todo {todo_id[:MAX_ECHOED_SLUG_CHARS]!r} of yours")
    todo = (Todo.objects.filter(pk=int(todo_id), endpoint__owner=operator)
            .select_related("endpoint").first())
    if todo is None:
        raise Problem(404, "not_found", f"no todo {todo_id} of yours")
    return todo


def _action_body(request) -> dict:
    body = _read_body(request)
    if not body.strip():
        return {}
    if not _is_json_type(_media_type(request.META.get("CONTENT_TYPE"))):
        raise Problem(415, "unsupported_media_type", "Content-Type must be application/json")
    # Not walked: the transition names a field the database cannot store ("reason …").
    data, _ = _parse_json_document(_decode_utf8(body), walk=False)
    return data


@csrf_exempt
def todo_action(request, todo_id, action):
    """An operator acts on a todo of an endpoint they own (docs/work-control.md): priority,
    run_now, cancel, approve, reject. 200 with the todo; 404 for a todo that is missing or not theirs; 400 for bad input (nothing written);
    409 with the transition's refusal code when the todo's state does not allow it (approve,
    reject and cancel answer a state they do not take 400 ``invalid_argument``, from the
    transition)."""
    try:
        if request.method != "POST":
            raise Problem(405, "method_not_allowed", "POST here")
        action = TODO_ACTION_ALIASES.get(action, action)
        if action not in TODO_ACTIONS:
            raise Problem(404, "not_found", f"no todo action {action[:40]!r}")
        _check_declared_length(request.META.get("CONTENT_LENGTH"))
        operator = _authenticate_operator(request)
        todo = _owned_todo(operator, todo_id)
        _check_rate(f"operator:{operator.pk}")
        fields, act = TODO_ACTIONS[action]
        data = _action_body(request)
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise Problem(400, "invalid_argument", f"unknown fields: {unknown}")
        caller = todo_transitions.Caller.operator(todo.endpoint, operator.get_username())
        try:
            changed = act(caller, todo.pk, data)
        except todo_transitions.Refusal as refusal:
            raise Problem(REFUSAL_STATUS.get(refusal.code, 409), refusal.code,
                          refusal.message) from None
    except Problem as problem:
        return problem.response()
    except DatabaseError as exc:
        return _storage_unavailable(exc, todo=todo_id).response()
    log.info("operator todo action", extra={
        "todo_id": changed.pk, "action": action, "operator": operator.get_username()})
    return JsonResponse({"todo": todo_queries.todo_as_dict(changed)})


# -- the webhook pages of the board (CONTRACT §14) -----------------------------------------------
#
# Per webhook the operator owns (superusers: all): URL, source, routes and the last 200
# deliveries with their outcome, live over the board's SSE mechanism (/todos/webhooks/<slug>/events,
# channels_push.board_stream.GroupStreamConsumer: a board stream with its caps and re-checks),
# filterable by outcome, with a redeliver button on accepted deliveries.

WEBHOOK_PAGE_DELIVERIES = 200


WEBHOOK_SCRIPT = Path(__file__).resolve().parent / "static" / "ingest" / "webhook.js"
_board_login_required = todo_views.board_login_required


@_board_login_required
@require_GET
def webhook_script(request):
    return todo_views.script_response(WEBHOOK_SCRIPT)


def get_visible_webhook(user, slug) -> Webhook:
    """The webhook if ``user`` may see it, else 404 (missing and forbidden look the same)."""
    webhooks = Webhook.objects.filter(slug=slug)
    if not user.is_superuser:
        webhooks = webhooks.filter(owner=user)
    webhook = webhooks.first()
    if webhook is None:
        raise Http404("no such webhook")
    return webhook


def delivery_stream_group(user, url_kwargs) -> str | None:
    """Which live group a signed-in ``user`` may watch for ``/todos/webhooks/<slug>/events``
    (None: refused). Called by the stream consumer in one database hop."""
    try:
        webhook = get_visible_webhook(user, url_kwargs.get("slug", ""))
    except Http404:
        return None
    return transitions.deliveries_group(webhook.pk)


def _webhook_context(request, webhook):
    outcome = request.GET.get("outcome") or ""
    if outcome not in Outcome.values:
        outcome = ""
    return {
        "webhook": webhook,
        "outcome": outcome,
        "outcomes": Outcome.values,
        "deliveries": queries.latest_deliveries(webhook, outcome=outcome or None,
                                                limit=WEBHOOK_PAGE_DELIVERIES),
        "query": f"outcome={outcome}" if outcome else "",
    }


@_board_login_required
@never_cache
def webhook_list(request):
    webhooks = Webhook.objects.order_by("slug")
    if not request.user.is_superuser:
        webhooks = webhooks.filter(owner=request.user)
    return render(request, "ingest/webhooks.html", {"webhooks": webhooks})


@_board_login_required
@never_cache
def webhook_page(request, slug):
    webhook = get_visible_webhook(request.user, slug)
    context = _webhook_context(request, webhook)
    context.update({
        "hook_url": f"{settings.SWITCHBOARD_PUBLIC_URL}/hooks/{webhook.slug}",
        "routes": webhook.routes.select_related("endpoint").order_by("id"),
        "drops": webhook.drops.filter(dropped__gt=0).order_by("-minute")[:20],
        "unsigned_warning": transitions.UNSIGNED_WARNING if webhook.source == Source.UNSIGNED else "",
        "public_url_warning": sender_setup.public_url_warning(settings.SWITCHBOARD_PUBLIC_URL),
        "setup_steps": sender_setup.setup_steps(
            webhook.source, f"{settings.SWITCHBOARD_PUBLIC_URL}/hooks/{webhook.slug}"),
        "sender_minted": webhook.source in sender_setup.SENDER_MINTED,
    })
    return render(request, "ingest/webhook.html", context)


@_board_login_required
@never_cache
def webhook_rows(request, slug):
    """The deliveries table body alone: what the page re-fetches on every live event."""
    webhook = get_visible_webhook(request.user, slug)
    return render(request, "ingest/_deliveries.html", _webhook_context(request, webhook))


@_board_login_required
@require_POST
def redeliver_delivery(request, slug, record_id):
    webhook = get_visible_webhook(request.user, slug)
    record = DeliveryRecord.objects.filter(pk=record_id, webhook=webhook).first()
    if record is None:
        raise Http404("no such delivery")
    _, routes = queries.find_webhook_with_routes(webhook.slug)
    if not webhook.active:
        messages.error(request, f"webhook {webhook.slug} is inactive; nothing was re-sent")
        return redirect("webhook-page", slug=webhook.slug)
    try:
        arrival = transitions.redeliver(record, operator=request.user, routes=routes)
    except ValueError as exc:
        messages.error(request, str(exc))
    else:
        created = [str(todo.pk) for todo, was_created in arrival.todos if was_created]
        messages.success(request, f"redelivered #{record.pk} as #{arrival.record.pk}: "
                                  f"{len(created)} new todo(s)")
    return redirect("webhook-page", slug=webhook.slug)


@_board_login_required
@never_cache
def delivery_detail(request, slug, record_id):
    """One delivery as it arrived: its non-secret headers (signature and token headers were
    never stored), what verification said, and the todos it created."""
    webhook = get_visible_webhook(request.user, slug)
    record = (DeliveryRecord.objects.filter(pk=record_id, webhook=webhook)
              .select_related("delivery_event", "attributed_to").first())
    if record is None:
        raise Http404("no such delivery")
    if record.delivery_event_id:
        todos = list(Todo.objects.filter(delivery_event_id=record.delivery_event_id)
                     .select_related("endpoint").order_by("id"))
    else:
        todos = list(Todo.objects.filter(pk__in=[int(t) for t in record.todo_ids or []
                                                 if str(t).isdigit()])
                     .select_related("endpoint").order_by("id"))
    return render(request, "ingest/delivery.html", {
        "webhook": webhook, "record": record, "todos": todos,
        "headers": sorted((record.headers or {}).items()),
        "trust": record.delivery_event.trust if record.delivery_event else "",
    })


# -- the board's "new todo" form ----------------------------------------------------------------
#
# The same hand-over as POST /api/v1/endpoints/<slug>/todos, from a signed-in operator's form
# (CSRF-protected like every board form): the fields are read into the API's JSON shape and
# checked by the API's own ``_hand_over_arguments``, so a rule added there holds here too.
# Only the fields the API knows are shown (HAND_OVER_FIELDS): (name, label, kind, hint).
NEW_TODO_FIELDS = (
    ("queue", "queue", "text", ""),
    ("title", "title", "text", ""),
    ("kind", "kind", "text", "optional, e.g. deploy"),
    ("priority", "priority", "int", "−100 … 100, higher first"),
    ("not_before", "not before", "text", "ISO-8601, e.g. 2026-12-03T09:00:00Z"),
    ("delay_seconds", "delay (s)", "int", ""),
    ("requires_approval", "requires approval", "bool", ""),
    ("payload", "payload", "json", "a JSON object"),
    ("secrets", "secrets", "json", 'JSON object, name → value: {"token": "…"}'),
    ("idempotency_key", "idempotency key", "text", "optional"),
)


def new_todo_fields():
    return [field for field in NEW_TODO_FIELDS if field[0] in HAND_OVER_FIELDS]


def _new_todo_data(post) -> dict:
    """The form as the API's JSON document; a field that does not parse is a Problem naming
    it, before anything is written."""
    data = {}
    for name, label, kind, _ in new_todo_fields():
        raw = post.get(name, "")
        if kind == "bool":
            if raw:
                data[name] = True
            continue
        if not raw.strip():
            continue
        if kind == "json":
            try:
                data[name] = json_input.loads_strict(raw)
            except ValueError:
                raise Problem(400, "invalid_argument", f"{label} is not valid JSON") from None
        elif kind == "int":
            try:
                data[name] = int(raw.strip())
            except ValueError:
                raise Problem(400, "invalid_argument", f"{label} must be a whole number") from None
        else:
            data[name] = raw.strip() if name != "title" else raw
    return data


@never_cache
@_board_login_required
def board_new_todo(request):
    """GET: the form. POST: hand the chosen endpoint a todo as this operator (trust
    ``operator``), then back to the board; a refusal re-renders the form with what was typed
    and the API's message (400)."""
    from endpoints import queries as endpoint_queries

    endpoints = list(endpoint_queries.visible_endpoints(request.user).filter(active=True)
                     .order_by("slug"))
    typed = request.POST if request.method == "POST" else {}
    context = {
        "endpoints": endpoints, "error": None,
        "chosen": (typed or request.GET).get("endpoint", ""),
        # What was typed comes back on a refusal, so nothing needs typing twice.
        "fields": [{"name": name, "label": label, "kind": kind, "hint": hint,
                    "value": typed.get(name, "") if name != "secrets" else ""}
                   for name, label, kind, hint in new_todo_fields()],
    }
    if request.method == "GET":
        return render(request, "todos/new_todo.html", context)
    if request.method != "POST":
        return JsonResponse({"error": "GET or POST"}, status=405)
    endpoint = next((e for e in endpoints if e.slug == request.POST.get("endpoint")), None)
    try:
        if endpoint is None:
            raise Problem(400, "invalid_argument", "endpoint: choose one of yours")
        arguments = _hand_over_arguments(endpoint, _new_todo_data(request.POST),
                                         now=timezone.now())
        todo, created = transitions.hand_over_todo(endpoint=endpoint, operator=request.user,
                                                   **arguments)
    except Problem as problem:
        context["error"] = f"{problem.message} ({problem.code})"
        return render(request, "todos/new_todo.html", context, status=problem.status)
    except todo_transitions.Refusal as refusal:
        context["error"] = f"{refusal.message} ({refusal.code})"
        return render(request, "todos/new_todo.html", context, status=400)
    push_metrics.INGEST_ACCEPTED.labels(source="operator").inc()
    if created:
        messages.success(request, f"handed over #{todo.pk} to {endpoint.slug}/{todo.queue}")
    else:
        messages.info(request, f"#{todo.pk} already holds that idempotency key: nothing new")
    return redirect(reverse("todos-board") + f"?endpoint={endpoint.slug}")
