"""The operator JSON API: ``POST /api/v1/endpoints/<slug>/todos`` (hand a todo over),
``GET /api/v1/endpoints/<slug>/stats`` and ``POST /api/v1/todos/<id>/<action>``.

Ordinary Django views: they need sessions, CSRF and OIDC sign-in, and are not a hot path. Like
the hook they answer JSON for everything, errors included, and write nothing before every check
has passed.
"""

import logging

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import DatabaseError
from django.http import JsonResponse
from django.middleware.csrf import CsrfViewMiddleware
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from channels_push.sessions import queries as push_queries
from endpoints.models import (MAX_COST_USD_PER_TODO, Endpoint, check_usd,
                              queue_name_validator)
from switchboard import json_input, tracing
from switchboard import metrics as push_metrics
from switchboard.http import plain
from todos import queries as todo_queries
from todos import transitions as todo_transitions
from todos import usage as todo_usage
from todos.models import THREAD_MAX_CHARS, Todo

from . import queries, threads, transitions, write_back
from .models import OperatorSecret, WriteBack
from .problems import (MAX_ECHOED_SLUG_CHARS, Problem, check_declared_length, check_rate,
                       decode_utf8, is_json_type, media_type_of, one_line, parse_json_document,
                       storage_unavailable, too_large)

log = logging.getLogger("switchboard.ingest")

# Text fields are refused past their column's width, which the model declares.
MAX_TITLE_CHARS = Todo._meta.get_field("title").max_length
MAX_KIND_CHARS = Todo._meta.get_field("kind").max_length
MAX_IDEMPOTENCY_KEY_CHARS = 200
MAX_SECRETS = 50
MAX_SECRET_NAME_CHARS = OperatorSecret._meta.get_field("name").max_length
MAX_SECRET_VALUE_CHARS = 64 * 1024


def _read_body(request) -> bytes:
    """Read the raw body once, never more than the cap plus one byte (a body without a
    Content-Length, e.g. chunked, is cut off here)."""
    body = request.read(settings.SWITCHBOARD_MAX_BODY_BYTES + 1)
    if len(body) > settings.SWITCHBOARD_MAX_BODY_BYTES:
        raise too_large()
    return body


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


# The model permission each API write needs, as on the console (docs/security.md#who-may-act).
ADD_TODO = "todos.add_todo"
CHANGE_TODO = "todos.change_todo"


def _require_permission(operator, permission: str) -> None:
    """403 ``forbidden`` naming ``permission`` unless ``operator`` holds it (view-only staff,
    or an account never given the operator's permissions, can read but not write)."""
    if not operator.has_perm(permission):
        raise Problem(403, "forbidden", f"this needs the permission {permission}")


def _optional_str(data: dict, name: str, limit: int) -> str:
    value = data.get(name)
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > limit:
        raise Problem(400, "invalid_argument", f"{name} must be a string of at most {limit} characters")
    return value


HAND_OVER_FIELDS = ("queue", "title", "payload", "kind", "idempotency_key", "secrets",
                    "priority", "not_before", "delay_seconds", "requires_approval",
                    "max_cost_usd", "thread")


def hand_over_arguments(endpoint, data: dict, *, now, plainly_storable: bool = False) -> dict:
    unknown = sorted(set(data) - set(HAND_OVER_FIELDS))
    if unknown:
        raise Problem(400, "invalid_argument", f"unknown fields: {unknown}")
    if not plainly_storable:
        # Text the database cannot take (NUL, a lone surrogate) is refused naming its field,
        # before anything is looked up or written.
        problem = json_input.find_unstorable({name: data.get(name) for name in HAND_OVER_FIELDS})
        if problem is not None:
            raise Problem(400, "invalid_argument", problem)
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
    kind = one_line(_optional_str(data, "kind", MAX_KIND_CHARS), MAX_KIND_CHARS)
    if kind and not (kind[0].isascii() and kind[0].isalnum()):
        # An event name, as a webhook's must be: one starting with "-" would read as an option
        # where an agent's command or prompt starts with the kind (docs/runner.md#placeholders).
        raise Problem(400, "invalid_argument",
                      "kind must start with a letter or digit (an event name such as "
                      "deploy.request)")
    requires_approval = data.get("requires_approval", False)
    if not isinstance(requires_approval, bool):
        raise Problem(400, "invalid_argument", "requires_approval must be true or false")
    max_cost_usd = data.get("max_cost_usd")
    if max_cost_usd is not None:
        # A number of dollars (docs/reference.md#usage-and-budgets); text is refused, as for
        # usage, so "0.5" and 0.5 are not two ways to say it.
        if isinstance(max_cost_usd, (bool, str)):
            raise Problem(400, "invalid_argument", "max_cost_usd must be a number of US dollars")
        try:
            max_cost_usd = check_usd(max_cost_usd, "max_cost_usd", MAX_COST_USD_PER_TODO)
        except ValidationError as error:
            raise Problem(400, "invalid_argument", "max_cost_usd: " + " ".join(
                error.message_dict["max_cost_usd"])) from None
    thread = data.get("thread")
    if thread is not None:
        # A thread key of the operator's choosing (docs/work-control.md#threads): shown and
        # searchable with the todo; a hand-over never coalesces.
        if not isinstance(thread, str) or not thread.strip() or len(thread) > THREAD_MAX_CHARS:
            raise Problem(400, "invalid_argument",
                          f"thread must be a non-empty string of at most {THREAD_MAX_CHARS} "
                          "characters")
        thread = threads.clean(thread)
    return {
        "requires_approval": requires_approval, "max_cost_usd": max_cost_usd, "thread": thread,
        "queue": queue, "title": title, "payload": payload,
        "kind": kind,
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


HAND_OVER_ROUTE = "/api/v1/endpoints/{slug}/todos"


@csrf_exempt
def hand_over(request, endpoint_slug):
    """An operator hands their endpoint a todo. 201 with the todo; 200 with the existing live
    todo when the idempotency key repeats (nothing new is written or rung). The hand-over's
    span starts the todo's trace, or continues the request's ``traceparent``
    (docs/operating.md#traces)."""
    with tracing.delivery(f"POST {HAND_OVER_ROUTE}", request.headers.get("traceparent"),
                          **{"http.request.method": request.method,
                             "http.route": HAND_OVER_ROUTE}) as span:
        response = _hand_over(request, endpoint_slug, span)
        span.set(**{"http.response.status_code": response.status_code})
    return response


def note_hand_over(span, endpoint, todo, created: bool) -> None:
    """The hand-over span's attributes; a repeat links to the trace of the todo it found."""
    span.set(**{"switchboard.todo_id": str(todo.pk), "switchboard.endpoint": endpoint.slug,
                "switchboard.queue": todo.queue, "switchboard.duplicate": not created})
    if not created:
        span.link(todo.traceparent)


def _hand_over(request, endpoint_slug, span):
    try:
        if request.method != "POST":
            raise Problem(405, "method_not_allowed", "POST a todo here")
        check_declared_length(request.META.get("CONTENT_LENGTH"))
        operator = _authenticate_operator(request)
        _require_permission(operator, ADD_TODO)
        reason = json_input.unstorable_reason(endpoint_slug)
        if reason is not None:  # PostgreSQL would refuse the lookup itself (a false 503)
            raise Problem(400, "invalid_argument", f"the endpoint slug in the path {reason}")
        # Somebody else's endpoint looks exactly like a missing one.
        endpoint = Endpoint.objects.filter(slug=endpoint_slug, active=True, owner=operator).first()
        if endpoint is None:
            raise Problem(404, "not_found",
                          f"no endpoint {endpoint_slug[:MAX_ECHOED_SLUG_CHARS]!r} of yours")
        check_rate(f"operator:{operator.pk}")
        body = _read_body(request)
        if not is_json_type(media_type_of(request.META.get("CONTENT_TYPE"))):
            raise Problem(415, "unsupported_media_type", "Content-Type must be application/json")
        data, plainly = parse_json_document(decode_utf8(body), walk=False)
        now = timezone.now()
        arguments = hand_over_arguments(endpoint, data, plainly_storable=plainly, now=now)
        todo, created = transitions.hand_over_todo(
            endpoint=endpoint, operator=operator, body_sha256=transitions.body_digest(body),
            now=now, **arguments,
        )
    except Problem as problem:
        push_metrics.INGEST_REJECTED.labels(reason=problem.code).inc()
        return problem.response()
    except DatabaseError as exc:
        push_metrics.INGEST_REJECTED.labels(reason="storage_unavailable").inc()
        return plain.django_response(storage_unavailable(exc, endpoint=endpoint_slug))
    push_metrics.INGEST_ACCEPTED.labels(source="operator").inc()
    note_hand_over(span, endpoint, todo, created)
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
        check_rate(f"operator:{operator.pk}")
        now = timezone.now()
        queues = todo_queries.endpoint_queue_stats(endpoint, now=now)
        sessions = push_queries.live_sessions(endpoint.pk, now)
        spend = todo_usage.spend_report(endpoint, now)
    except Problem as problem:
        return problem.response()
    except DatabaseError as exc:
        return plain.django_response(storage_unavailable(exc, endpoint=endpoint_slug))
    return JsonResponse({
        "endpoint": endpoint.slug,
        "queues": queues,
        # The client as it named itself; never the session id (a handle of its session).
        "sessions": [{"client": " ".join(part for part in (row["client_name"],
                                                           row["client_version"]) if part),
                      "streaming": row["streaming"],
                      "last_seen_at": todo_queries.iso_time(row["last_seen_at"])} for row in sessions],
        # Today's spend (UTC day) against the budgets (docs/reference.md#usage-and-budgets).
        "spend": spend,
    })


# -- POST /api/v1/todos/<id>/<action>: an operator acts on one of their todos -------------------


def _priority_action(caller, todo_id, data: dict):
    if "priority" not in data:
        raise Problem(400, "invalid_argument", "priority (an integer from -100 to 100) is required")
    return todo_transitions.set_priority_todo(caller, todo_id, data["priority"])


def _cancel_action(caller, todo_id, data: dict):
    """``{"request": true}`` asks a held todo's agent to stop (docs/work-control.md#threads):
    it stays claimed until the agent cancels or completes it, or its lease lapses. Without
    it: the cancel itself, an override of any lease."""
    request = data.get("request", False)
    if not isinstance(request, bool):
        raise Problem(400, "invalid_argument", "request must be true or false")
    if request:
        return todo_transitions.request_cancel(todo_id, actor=caller.actor,
                                               reason=data.get("reason"),
                                               endpoint=caller.endpoint)
    return todo_transitions.cancel_todo(caller, todo_id, reason=data.get("reason"))


# action -> (the JSON fields it takes, what it does). Each is one guarded transition of
# todos.transitions; its refusal is answered with the transition's code.
TODO_ACTIONS = {
    "priority": (("priority",), _priority_action),
    "run_now": ((), lambda caller, todo_id, data: todo_transitions.run_now_todo(caller, todo_id)),
    "cancel": (("reason", "request"), _cancel_action),
    "approve": ((), lambda caller, todo_id, data: todo_transitions.approve_todo(caller, todo_id)),
    "promote": ((), lambda caller, todo_id, data: todo_transitions.promote_todo(caller, todo_id)),
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
    if not is_json_type(media_type_of(request.META.get("CONTENT_TYPE"))):
        raise Problem(415, "unsupported_media_type", "Content-Type must be application/json")
    # Not walked: the transition names a field the database cannot store ("reason …").
    data, _ = parse_json_document(decode_utf8(body), walk=False)
    return data


@csrf_exempt
def todo_action(request, todo_id, action):
    """An operator acts on a todo of an endpoint they own (docs/work-control.md): priority,
    run_now, cancel, approve, promote, reject. 200 with the todo; 404 for a todo that is
    missing or not theirs; 403 without the permission to change todos; 400 for bad input; 409 with the transition's refusal code (``not_claimable``) when
    the todo's state does not allow the action. A refusal writes nothing."""
    try:
        if request.method != "POST":
            raise Problem(405, "method_not_allowed", "POST here")
        action = TODO_ACTION_ALIASES.get(action, action)
        if action not in TODO_ACTIONS:
            raise Problem(404, "not_found", f"no todo action {action[:40]!r}")
        check_declared_length(request.META.get("CONTENT_LENGTH"))
        operator = _authenticate_operator(request)
        _require_permission(operator, CHANGE_TODO)
        todo = _owned_todo(operator, todo_id)
        check_rate(f"operator:{operator.pk}")
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
        return plain.django_response(storage_unavailable(exc, todo=todo_id))
    log.info("operator todo action", extra={
        "todo_id": changed.pk, "action": action, "operator": operator.get_username()})
    return JsonResponse({"todo": todo_queries.todo_as_dict(changed)})


# -- POST /api/v1/todos/<id>/write-backs/<id>/retry ---------------------------------------------


@csrf_exempt
def retry_todo_write_back(request, todo_id, write_back_id):
    """An operator's "retry now" of a failed or abandoned write-back of one of their todos
    (docs/write-back.md#the-outbox): due again at once with a fresh retry budget. 200 with the
    write-back; 404 for a todo that is missing or not theirs, or a write-back not of that
    todo; 403 without the permission to change todos; 409 ``not_retryable`` when it is neither
    failed nor abandoned (nothing changes)."""
    try:
        if request.method != "POST":
            raise Problem(405, "method_not_allowed", "POST here")
        check_declared_length(request.META.get("CONTENT_LENGTH"))
        operator = _authenticate_operator(request)
        _require_permission(operator, CHANGE_TODO)
        todo = _owned_todo(operator, todo_id)
        row = None
        if write_back_id.isascii() and write_back_id.isdigit() and int(write_back_id) < 2**63:
            row = (WriteBack.objects.filter(pk=int(write_back_id), todo_id=todo.pk)
                   .select_related("connection").first())
        if row is None:
            raise Problem(404, "not_found", f"no write-back {write_back_id[:40]!r} of todo "
                                            f"{todo.pk}")
        check_rate(f"operator:{operator.pk}")
        if _action_body(request):
            raise Problem(400, "invalid_argument", "retry takes no fields")
        if not write_back.retry_write_back(row):
            raise Problem(409, "not_retryable", f"write-back {row.pk} is {row.state}; only a "
                                                "failed or abandoned one is retried")
    except Problem as problem:
        return problem.response()
    except DatabaseError as exc:
        return plain.django_response(storage_unavailable(exc, todo=todo_id))
    log.info("operator write-back retry", extra={
        "todo_id": todo.pk, "write_back_id": row.pk, "operator": operator.get_username()})
    row.refresh_from_db()
    return JsonResponse({"write_back": queries.write_back_as_dict(row)})
