"""The operator's Todos board (CONTRACT §9): list, todo page, action buttons, /metrics.

Every read goes through ``endpoints.queries.visible_endpoints`` so an operator sees only the
endpoints they own (superusers all); a todo outside them is a 404, never a 403, so a forged id
tells nothing. Every write is a transition called with ``Caller.operator`` — the operator's
username becomes the lease owner and the event actor, exactly as a session id does for an agent.
The live part (``/todos/events``) is a Channels consumer in ``channels_push/board_stream.py``.
"""

import hmac
import json
from pathlib import Path

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse, reverse_lazy
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST

from endpoints import queries as endpoint_queries
from switchboard import json_input

from . import queries, transitions
from .models import State, Todo

LOGIN_URL = reverse_lazy("board-login")
board_login_required = login_required(login_url=LOGIN_URL)

BOARD_SCRIPT = Path(__file__).resolve().parent / "static" / "todos" / "board.js"


def oidc_login_url():
    """The OIDC sign-in URL when OIDC is configured (settings may not define it yet)."""
    if not getattr(settings, "OIDC_ENABLED", False):
        return None
    try:
        return reverse("oidc_authentication_init")
    except Exception:  # OIDC settings present but its URLs not mounted: no button.
        return None


class LoginView(auth_views.LoginView):
    template_name = "registration/login.html"
    redirect_authenticated_user = True

    def get_context_data(self, **kwargs):
        return {**super().get_context_data(**kwargs), "oidc_login_url": oidc_login_url()}


def get_visible_todo(user, todo_id) -> Todo:
    """The todo if ``user`` may see it, else 404 (missing and forbidden look the same)."""
    todo = (
        Todo.objects.filter(pk=todo_id, endpoint__in=endpoint_queries.visible_endpoints(user))
        .select_related("endpoint")
        .first()
    )
    if todo is None:
        raise Http404("no such todo")
    return todo


def _board_context(request):
    filters = queries.board_filters_from(request.GET)
    endpoints = endpoint_queries.visible_endpoints(request.user)
    query = request.GET.urlencode()
    return {
        "filters": filters,
        "todos": queries.board_todos(endpoints, **filters),
        # Buttons return to the filtered board, also from rows fetched by /todos/rows.
        "next_url": reverse("todos-board") + (f"?{query}" if query else ""),
        "query": query,
    }


@board_login_required
@require_GET
@never_cache
def board(request):
    context = _board_context(request)
    endpoints = list(endpoint_queries.visible_endpoints(request.user).order_by("slug"))
    now = timezone.now()
    for endpoint in endpoints:
        endpoint.presence_now = endpoint.presence_at(now)  # §8: the clock in/out buttons
    context.update(endpoints=endpoints, states=State.values)
    return render(request, "todos/board.html", context)


@board_login_required
@require_GET
@never_cache
def board_rows(request):
    """The rows alone: the board's re-sync after its event stream (re)connects."""
    return render(request, "todos/_rows.html", _board_context(request))


@board_login_required
@require_GET
def board_script(request):
    return script_response(BOARD_SCRIPT)


def script_response(path: Path) -> HttpResponse:
    """A page script: served by Django because daphne serves no static files; small and
    cacheable."""
    response = HttpResponse(path.read_bytes(), content_type="text/javascript")
    response["Cache-Control"] = "private, max-age=300"
    return response


@board_login_required
@require_GET
@never_cache
def todo_detail(request, todo_id):
    todo = get_visible_todo(request.user, todo_id)
    events = list(todo.events.order_by("at", "id"))
    for event in events:
        details = {key: value for key, value in (event.detail or {}).items() if value is not None}
        event.detail_json = json.dumps(details, sort_keys=True) if details else ""
    return render(request, "todos/detail.html", {
        "todo": todo,
        "events": events,
        "payload_json": json.dumps(todo.payload, indent=2, sort_keys=True),
        "result_json": json.dumps(todo.result, indent=2, sort_keys=True) if todo.result is not None else None,
        "next_url": request.get_full_path(),
    })


def _parse_result(text: str):
    """Operator-typed result: JSON when it parses, else kept as the string it is."""
    text = text.strip()
    if not text:
        return None
    try:
        return json_input.loads_strict(text)
    except ValueError:
        return text  # not JSON (or NaN, Infinity…): kept as the text the operator typed


def _lease_seconds(text: str):
    text = (text or "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise transitions.Refusal("invalid_argument", "lease seconds must be a whole number") from None


# One entry per board button: how it calls the transition. The operator acts as lease owner,
# so complete/fail/extend/release are fenced to the operator's own claim, like an agent's.
ACTIONS = {
    "claim": lambda caller, todo, post: transitions.claim_todo(
        caller, todo.pk, lease_ttl_seconds=_lease_seconds(post.get("lease_seconds"))),
    "complete": lambda caller, todo, post: transitions.complete_todo(
        caller, todo.pk, result=_parse_result(post.get("result", ""))),
    "fail": lambda caller, todo, post: transitions.fail_todo(
        caller, todo.pk, error=post.get("error", "").strip() or "failed by operator"),
    "extend": lambda caller, todo, post: transitions.heartbeat_todo(
        caller, todo.pk, lease_ttl_seconds=_lease_seconds(post.get("lease_seconds"))),
    "release": lambda caller, todo, post: transitions.release_todo(caller, todo.pk),
    "retry": lambda caller, todo, post: transitions.requeue_todo(caller, todo.pk),
}
ACTION_DONE = {
    "claim": "claimed", "complete": "completed", "fail": "failed", "extend": "extended the lease of",
    "release": "released", "retry": "re-queued",
}


@board_login_required
@require_POST
def todo_act(request, todo_id, action):
    if action not in ACTIONS:
        raise Http404("no such action")
    todo = get_visible_todo(request.user, todo_id)
    caller = transitions.Caller.operator(todo.endpoint, request.user.username)
    try:
        ACTIONS[action](caller, todo, request.POST)
    except transitions.Refusal as refusal:
        messages.error(request, f"#{todo.pk}: {refusal.message} ({refusal.code})")
    else:
        messages.success(request, f"{ACTION_DONE[action]} #{todo.pk}")
    next_url = request.POST.get("next", "")
    if not url_has_allowed_host_and_scheme(next_url, {request.get_host()}, request.is_secure()):
        next_url = reverse("todos-detail", args=[todo.pk])
    return redirect(next_url)


@board_login_required
@require_POST
def clock_endpoint(request, slug, state):
    """Board button: clock an endpoint in or out (§8) as its operator; clocking in sends the
    waiting work as one digest (reason ``operator``)."""
    from channels_push import doorbells

    if state not in ("in", "out"):
        raise Http404("no such state")
    endpoint = endpoint_queries.visible_endpoints(request.user).filter(slug=slug).first()
    if endpoint is None:
        raise Http404("no such endpoint")
    presence = doorbells.clock(endpoint, state, reason="operator")
    messages.success(request, f"{endpoint.slug} is {presence}")
    next_url = request.POST.get("next", "")
    if not url_has_allowed_host_and_scheme(next_url, {request.get_host()}, request.is_secure()):
        next_url = reverse("todos-board")
    return redirect(next_url)


# -- /metrics ------------------------------------------------------------------------------------


# Without a token, /metrics answers only local scrapers and signed-in staff: its labels name
# every operator's endpoints and queues, which one operator must not read about another's.
LOOPBACK_ADDRESSES = frozenset({"127.0.0.1", "::1"})


def _metrics_token_ok(request) -> bool:
    token = getattr(settings, "SWITCHBOARD_METRICS_TOKEN", "")
    if not token:
        user = getattr(request, "user", None)
        return request.META.get("REMOTE_ADDR") in LOOPBACK_ADDRESSES or bool(
            user is not None and user.is_authenticated and user.is_staff)
    header = request.headers.get("Authorization", "")
    presented = header[len("Bearer "):] if header.startswith("Bearer ") else ""
    return hmac.compare_digest(presented.encode(), token.encode())


@require_GET
@never_cache
def metrics(request):
    """Prometheus text exposition. With SWITCHBOARD_METRICS_TOKEN set, that token is required
    as a bearer (scrapers send it with ``authorization``); without it, only loopback scrapers
    and signed-in staff get an answer."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from channels_push import metrics as push_metrics

    if not _metrics_token_ok(request):
        response = HttpResponse("metrics need the bearer token\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = "Bearer"
        return response
    return HttpResponse(generate_latest(push_metrics.REGISTRY), content_type=CONTENT_TYPE_LATEST)
