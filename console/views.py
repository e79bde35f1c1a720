"""The operator's Todos board (docs/console.md): list, todo page, action buttons, /metrics.

Every read goes through ``endpoints.queries.visible_endpoints`` so an operator sees only the
endpoints they own (superusers all); a todo outside them is a 404, never a 403, so a forged id
tells nothing. Every write is a transition called with ``Caller.operator`` — the operator's
username becomes the lease owner and the event actor, exactly as a session id does for an agent.
The live part (``/todos/events``) is a Channels consumer in ``channels_push/board/stream.py``.
"""

import functools
import hashlib
import hmac
import json
from dataclasses import dataclass
from decimal import Decimal
from typing import Callable
from urllib.parse import parse_qsl, urlencode

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.db.models import Q
from django.http import (Http404, HttpResponse, HttpResponseBadRequest, HttpResponseForbidden,
                         JsonResponse)
from django.shortcuts import redirect, render
from django.urls import reverse, reverse_lazy
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST

from channels_push.sessions import holders
from channels_push.sessions import queries as push_queries
from endpoints import connect_snippets
from endpoints import queries as endpoint_queries
from endpoints import transitions as endpoint_transitions
from endpoints.models import MAX_CLAIM_CAP
from ingest import queries as ingest_queries
from ingest import status_text
from switchboard import json_input
from switchboard.commands import validation_text

from todos import queries, transitions, usage
from todos.models import CANCELLABLE_STATES, State, Todo, Trust

LOGIN_URL = reverse_lazy("board-login")
board_login_required = login_required(login_url=LOGIN_URL)

# The model permission each kind of console write needs, as its admin twin does
# (docs/security.md#who-may-act): view-only staff can look and nothing else.
CHANGE_TODO = "todos.change_todo"
ADD_TODO = "todos.add_todo"
CHANGE_ENDPOINT = "endpoints.change_endpoint"


def operator_may(permission: str):
    """Decorate a console view (inside ``board_login_required``) that writes: a signed-in user
    without ``permission`` is answered 403 naming it, before anything is looked up, so the
    answer is the same for every todo, endpoint or webhook and nothing is written."""

    def decorate(view):
        @functools.wraps(view)
        def checked(request, *args, **kwargs):
            if not request.user.has_perm(permission):
                return HttpResponseForbidden(f"this needs the permission {permission}\n",
                                             content_type="text/plain; charset=utf-8")
            return view(request, *args, **kwargs)

        return checked

    return decorate


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
    filters = queries.board_filters_from(request.GET)  # BadFilter: see board_filter_refused
    endpoints = endpoint_queries.visible_endpoints(request.user)
    query = request.GET.urlencode()
    todos = queries.board_todos(endpoints, **filters)
    holders.label_todo_holders(todos)
    older = request.GET.copy()
    older["before"] = str(todos[-1].pk) if todos else ""
    newest = request.GET.copy()
    newest.pop("before", None)
    return {
        "filters": filters,
        "todos": todos,
        # Past the newest BOARD_LIMIT: the next page is the todos older than the last shown.
        "older_query": older.urlencode() if len(todos) >= queries.BOARD_LIMIT else None,
        "newest_query": newest.urlencode(),
        # Buttons return to the filtered board, also from rows fetched by /todos/rows.
        "next_url": reverse("todos-board") + (f"?{query}" if query else ""),
        "query": query,
    }


# The board's state tabs: (filter value, label, glance column whose sum is the tab's count).
# Terminal states count their last day (the glance keeps no all-time totals of history).
def state_tabs(params, current) -> list[dict]:
    """``[{state, label, column, href, current}]``, "all" first; each link keeps the other
    filters (not the "older" page: a new tab starts at the newest)."""
    tabs = []
    for column in [None, *queries.glance_columns()]:
        state = column.removesuffix("_24h") if column else ""
        label = (state.replace("_", " ") + (" · 24 h" if column.endswith("_24h") else "")
                 if column else "all")
        query = params.copy()
        query.pop("before", None)
        query.pop("state", None)
        if state:
            query["state"] = state
        tabs.append({"state": state, "label": label, "column": column or "",
                     "href": "?" + query.urlencode(), "current": (current or "") == state})
    return tabs


def glance_payload(endpoints, *, now=None) -> dict:
    """The board header's data for ``endpoints`` (JSON-ready): the columns in order, and per
    endpoint its queues' counts and throughput (``queries.board_glance``)."""
    now = now or timezone.now()
    glance = queries.board_glance([endpoint.pk for endpoint in endpoints], now=now)
    return {
        "now": queries.iso_time(now),
        "columns": queries.glance_columns(),
        "endpoints": [{"endpoint": endpoint.slug, **glance[endpoint.pk]}
                      for endpoint in endpoints],
    }


def board_filter_refused(view):
    """A filter the database cannot compare (``queries.BadFilter``) answers 400 naming it."""

    @functools.wraps(view)
    def answer(request, *args, **kwargs):
        try:
            return view(request, *args, **kwargs)
        except queries.BadFilter as bad:
            return HttpResponseBadRequest(str(bad), content_type="text/plain; charset=utf-8")

    return answer


@board_login_required
@require_GET
@never_cache
@board_filter_refused
def board(request):
    context = _board_context(request)
    now = timezone.now()
    # With the header's spend today vs budget, read in the endpoints' own query.
    endpoints = list(usage.with_spend_today(
        endpoint_queries.visible_endpoints(request.user).order_by("slug"), now))
    for endpoint in endpoints:
        endpoint.presence_now = endpoint.presence_at(now)  # the clock in/out buttons
        # Why it is out, when an operator override decides it, and until when.
        endpoint.override_until = endpoint_transitions.override_in_force(endpoint, now)
        endpoint.spend = usage.spend_today(endpoint)
    glance = glance_payload(endpoints, now=now)
    context.update(endpoints=endpoints, states=queries.board_state_choices(),
                   tabs=state_tabs(request.GET, context['filters']['state']), glance=glance,
                   bulk_actions=bulk_actions_for_board(),
                   # The banner's count from the glance's own counts: no query of its own.
                   awaiting_approval=sum(counts.get(State.AWAITING_APPROVAL, 0)
                                         for entry in glance["endpoints"]
                                         for counts in entry["queues"].values()))
    return render(request, "console/board.html", context)


@board_login_required
@require_GET
@never_cache
def board_approvals(request):
    """The board's banner of todos awaiting approval alone, re-fetched by board.js whenever
    a row enters or leaves that state, so the count the operator sees stays true."""
    endpoints = endpoint_queries.visible_endpoints(request.user)
    return render(request, "console/_approvals.html",
                  {"awaiting_approval": queries.count_awaiting_approval(endpoints)})


@board_login_required
@require_GET
@never_cache
def board_glance(request):
    """The header's counts and throughput as JSON: the board's re-sync after its stream
    (re)connects, and the endpoint page's (``?endpoint=slug``)."""
    endpoints = endpoint_queries.visible_endpoints(request.user).order_by("slug")
    slug = (request.GET.get("endpoint") or "").strip()
    if slug:
        endpoints = endpoints.filter(slug=slug) if "\x00" not in slug else endpoints.none()
    return JsonResponse(glance_payload(list(endpoints)))


@board_login_required
@require_GET
@never_cache
@board_filter_refused
def board_rows(request):
    """The rows alone: the board's re-sync after its event stream (re)connects."""
    return render(request, "console/_rows.html", _board_context(request))


@board_login_required
@require_GET
@never_cache
def todo_detail(request, todo_id):
    todo = get_visible_todo(request.user, todo_id)
    events = list(todo.events.order_by("at", "id"))
    # Agents by client and hint, never by their whole session id (a handle of the session).
    labels = holders.holder_labels([todo.lease_owner, *(event.actor for event in events)])
    for event in events:
        details = {key: value for key, value in (event.detail or {}).items() if value is not None}
        event.detail_json = json.dumps(details, sort_keys=True) if details else ""
        event.actor_label = labels.get(event.actor, event.actor)
    followups = list(todo.followups.order_by("seq"))
    for followup in followups:
        followup.payload_json = json.dumps(followup.payload, indent=2, sort_keys=True)
    return render(request, "console/detail.html", {
        "followups": followups,
        "cancel_request": _cancel_request(todo, events),
        # Cancelled because its source ended the thread: said in the source's own words.
        "stopped_by_source": (status_text.stopped_words(todo)
                              if todo.state == State.CANCELLED and status_text.source_stopped(
                                  todo, _cancel_reason(events)) else None),
        "todo": todo,
        "holder": labels.get(todo.lease_owner) if todo.lease_owner else None,
        "events": sorted(events + _credential_events(todo), key=lambda event: event.at),
        "payload_json": json.dumps(todo.payload, indent=2, sort_keys=True),
        "result_json": json.dumps(todo.result, indent=2, sort_keys=True) if todo.result is not None else None,
        "next_url": request.get_full_path(),
        # Summed over its attempts; each attempt's own is in its event's detail below.
        "usage": usage.todo_usage(todo),
        "max_cost_usd": _plain_number(todo.max_cost_usd if todo.max_cost_usd is not None
                                      else todo.endpoint.max_cost_usd),
        # What switchboard wrote, or is to write, back to the todo's source.
        "write_backs": ingest_queries.write_backs_of_todos([todo.pk]).get(todo.pk, []),
    })


# The event that records a cancel requested of a held todo (by an operator or by its source).
CANCEL_REQUEST_ACTION = "cancel_request"


def _cancel_request(todo, events) -> dict | None:
    """When and by whom a cancel of ``todo`` was requested (its latest request event), or
    None when none stands."""
    if todo.cancel_requested_at is None:
        return None
    asked = next((event for event in reversed(events)
                  if event.action == CANCEL_REQUEST_ACTION), None)
    return {"at": todo.cancel_requested_at, "by": asked.actor_label if asked else "",
            "reason": (asked.detail or {}).get("reason") if asked else None}


def _cancel_reason(events):
    cancel = next((event for event in reversed(events) if event.action == "cancel"), None)
    return (cancel.detail or {}).get("reason") if cancel is not None else None


@dataclass
class _CredentialEvent:
    """A history row for an agent credential of the todo: issued or revoked, never its value."""

    at: object
    action: str
    detail_json: str = ""
    from_state: str = ""
    to_state: str = "—"
    actor_label: str = "switchboard"


def _credential_events(todo) -> list:
    """The todo tokens and repository tokens its agents were given, as history rows."""
    rows = []
    for token in queries.todo_tokens_of(todo.pk):
        lease = json.dumps({"lease": token["lease_id"][:8]})
        rows.append(_CredentialEvent(token["issued_at"], "todo token issued", lease))
        if token["revoked_at"]:
            rows.append(_CredentialEvent(token["revoked_at"], "todo token revoked", lease))
    for token in ingest_queries.repo_tokens_of(todo.pk):
        detail = json.dumps({"repository": token["repository"],
                             "permissions": token["permissions"],
                             "expires_at": token["expires_at"].isoformat()}, sort_keys=True)
        rows.append(_CredentialEvent(token["issued_at"], "repository token issued", detail))
        if token["revoked_at"]:
            rows.append(_CredentialEvent(token["revoked_at"], "repository token revoked",
                                         json.dumps({"repository": token["repository"]})))
        elif token["revoke_error"]:
            rows.append(_CredentialEvent(token["issued_at"], "repository token revocation failing",
                                         json.dumps({"error": token["revoke_error"]})))
    return rows


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


def _priority(text):
    """The board form's priority: a whole number, or the value as typed so that
    ``set_priority_todo`` refuses it naming the field."""
    text = (text or "").strip()
    try:
        return int(text)
    except ValueError:
        return text


# One entry per board button: how it calls the transition. ``overriding`` is None when the
# operator holds the lease (or the todo is not claimed), else the agent's lease the operator
# saw: complete/fail/extend/release then act on it as an override.
ACTIONS = {
    "claim": lambda caller, todo, post, overriding: transitions.claim_todo(
        caller, todo.pk, lease_ttl_seconds=_lease_seconds(post.get("lease_seconds"))),
    "complete": lambda caller, todo, post, overriding: transitions.complete_todo(
        caller, todo.pk, result=_parse_result(post.get("result", "")), overriding=overriding),
    "fail": lambda caller, todo, post, overriding: transitions.fail_todo(
        caller, todo.pk, error=post.get("error", "").strip() or "failed by operator",
        overriding=overriding),
    "extend": lambda caller, todo, post, overriding: transitions.heartbeat_todo(
        caller, todo.pk, lease_ttl_seconds=_lease_seconds(post.get("lease_seconds")),
        overriding=overriding),
    "release": lambda caller, todo, post, overriding: transitions.release_todo(
        caller, todo.pk, overriding=overriding),
    "retry": lambda caller, todo, post, overriding: transitions.requeue_todo(caller, todo.pk),
    "promote": lambda caller, todo, post, overriding: transitions.promote_todo(caller, todo.pk),
    "priority": lambda caller, todo, post, overriding: transitions.set_priority_todo(
        caller, todo.pk, _priority(post.get("priority"))),
    "run_now": lambda caller, todo, post, overriding: transitions.run_now_todo(caller, todo.pk),
    "approve": lambda caller, todo, post, overriding: transitions.approve_todo(caller, todo.pk),
    "reject": lambda caller, todo, post, overriding: transitions.reject_todo(
        caller, todo.pk, reason=post.get("reason") or None),
    "cancel": lambda caller, todo, post, overriding: transitions.cancel_todo(
        caller, todo.pk, reason=post.get("reason") or None),
    # Asks the holder to stop instead of overriding its lease (docs/work-control.md#threads).
    "request_cancel": lambda caller, todo, post, overriding: transitions.request_cancel(
        todo.pk, actor=caller.actor, reason=post.get("reason") or None,
        endpoint=caller.endpoint),
}
# What a button's message says where the transitions' own words do not cover it.
CONSOLE_DONE = {"request_cancel": "asked its agent to stop and cancel"}


@board_login_required
@operator_may(CHANGE_TODO)
@require_POST
def todo_act(request, todo_id, action):
    if action not in ACTIONS:
        raise Http404("no such action")
    todo = get_visible_todo(request.user, todo_id)
    caller = transitions.Caller.operator(todo.endpoint, request.user.username)
    overriding = transitions.agent_lease_to_override(todo, request.user.username, action)
    shown_lease = request.POST.get("lease", "")
    try:
        if overriding is not None and shown_lease and not overriding.lease_id.startswith(shown_lease):
            # The page showed another lease than the one holding the todo now: act on the
            # lease the operator saw or on nothing (the write itself is fenced by lease id).
            raise transitions.Refusal("lease_lost", f"todo {todo.pk}: the agent's lease changed "
                                                    "since the page was shown; nothing changed")
        ACTIONS[action](caller, todo, request.POST, overriding)
    except transitions.Refusal as refusal:
        messages.error(request, f"#{todo.pk}: {refusal.message} ({refusal.code})")
    else:
        done = f"{CONSOLE_DONE.get(action) or transitions.ACTION_DONE[action]} #{todo.pk}"
        if overriding is not None:
            done += " (override: the agent's lease " + (
                "was extended; the agent keeps it)" if action == "extend" else "ended)")
        messages.success(request, done)
    next_url = request.POST.get("next", "")
    if not url_has_allowed_host_and_scheme(next_url, {request.get_host()}, request.is_secure()):
        next_url = reverse("todos-detail", args=[todo.pk])
    return redirect(next_url)


# -- bulk actions -----------------------------------------------------------------------------
#
# A selection, a confirmation page, then one guarded transition per todo, so a todo that changed
# meanwhile is refused alone and reported (docs/console.md).


@dataclass(frozen=True)
class BulkAction:
    label: str  # the button: "retry", "cancel" …
    done: str  # the report: "re-queued 12"
    applies_to: Callable[[], Q]  # which todos it can act on (the selection is narrowed to them)
    act: Callable  # act(caller, todo, post): one transition, Refusal when it does not apply
    inputs: tuple = ()  # extra (name, label) fields the confirmation asks for
    danger: bool = False


BULK_ACTIONS = {
    "retry": BulkAction(
        label="retry", done="re-queued",
        applies_to=lambda: Q(state=State.FAILED),
        act=lambda caller, todo, post: transitions.requeue_todo(caller, todo.pk)),
    "approve": BulkAction(
        label="approve (trust unchanged)", done="approved",
        applies_to=lambda: Q(state=State.AWAITING_APPROVAL),
        act=lambda caller, todo, post: ACTIONS["approve"](caller, todo, post, None)),
    # Raising trust is its own decision, never a side effect of approving.
    "promote": BulkAction(
        label="promote to operator trust", done="promoted to operator trust",
        applies_to=lambda: Q(state__in=(State.AWAITING_APPROVAL, State.PENDING),
                             trust=Trust.UNVERIFIED),
        act=lambda caller, todo, post: ACTIONS["promote"](caller, todo, post, None)),
    "reject": BulkAction(
        label="reject", done="rejected", danger=True, inputs=(("reason", "reason (optional)"),),
        applies_to=lambda: Q(state=State.AWAITING_APPROVAL),
        act=lambda caller, todo, post: ACTIONS["reject"](caller, todo, post, None)),
    "cancel": BulkAction(
        label="cancel", done="cancelled", danger=True, inputs=(("reason", "reason (optional)"),),
        applies_to=lambda: Q(state__in=CANCELLABLE_STATES),
        act=lambda caller, todo, post: ACTIONS["cancel"](caller, todo, post, None)),
}
# One confirmation acts on at most this many todos: a few seconds of transitions in one
# request. More: confirm again (the page says how many are left).
BULK_LIMIT = 500


def register_bulk_action(name: str, action: BulkAction) -> None:
    BULK_ACTIONS[name] = action


def bulk_actions_for_board() -> list[tuple[str, str]]:
    return [(name, action.label) for name, action in BULK_ACTIONS.items()]


def _bulk_selection(request, params, action: BulkAction):
    """The todos ``params`` select that ``action`` applies to, visible to the operator, oldest
    first: ``ids`` (the ticked rows) or the board's filters (``endpoint``, ``queue``,
    ``state`` …). Returns (queryset, the selection's own query string)."""
    endpoints = endpoint_queries.visible_endpoints(request.user)
    todos = Todo.objects.filter(endpoint__in=endpoints).select_related("endpoint")
    ids = [value for value in params.getlist("ids") if value.isdigit() and len(value) <= 18]
    if ids:
        todos = todos.filter(pk__in=[int(value) for value in ids])
        kept = [("ids", value) for value in ids]
    else:
        filters = queries.board_filters_from(params)
        if not (filters["endpoint_slug"] or filters["state"]):
            # A selection by filter names at least an endpoint or a state: "every todo"
            # is never one confirmation away.
            return Todo.objects.none(), ""
        kept = [(key, params[key]) for key in ("endpoint", "queue", "state", "q") if params.get(key)]
        todos = queries.filter_board_todos(endpoints, **filters)
    return todos.filter(action.applies_to()).order_by("created_at", "id"), urlencode(kept)


@board_login_required
@operator_may(CHANGE_TODO)
@never_cache
@board_filter_refused
def bulk_act(request, action):
    """GET: what ``action`` would do to the selection, and a button to confirm it (a POST with
    the CSRF token). POST: do it, one transition per todo, and report."""
    bulk = BULK_ACTIONS.get(action)
    if bulk is None:
        raise Http404("no such bulk action")
    params = request.POST if request.method == "POST" else request.GET
    todos, selection = _bulk_selection(request, params, bulk)
    if request.method == "GET":
        chosen = list(todos[:BULK_LIMIT + 1])
        return render(request, "console/bulk_confirm.html", {
            "action": action, "bulk": bulk, "todos": chosen[:BULK_LIMIT],
            "more": len(chosen) > BULK_LIMIT, "selection": selection,
            "params": parse_qsl(selection),
            "next_url": _safe_next(request, params.get("next", "")),
        })
    if request.method != "POST":
        return HttpResponse(status=405)
    done, refused = [], []
    for todo in todos[:BULK_LIMIT]:
        caller = transitions.Caller.operator(todo.endpoint, request.user.username)
        try:
            bulk.act(caller, todo, request.POST)
            done.append(todo.pk)
        except transitions.Refusal as refusal:
            refused.append(f"#{todo.pk}: {refusal.message} ({refusal.code})")
    if done:
        messages.success(request, f"{bulk.done} {len(done)}: " + " ".join(f"#{pk}" for pk in done))
    elif not refused:
        messages.info(request, f"{bulk.label}: nothing selected that it applies to")
    for line in refused[:20]:
        messages.error(request, line)
    return redirect(_safe_next(request, request.POST.get("next", "")))


def _safe_next(request, next_url: str) -> str:
    if not url_has_allowed_host_and_scheme(next_url, {request.get_host()}, request.is_secure()):
        return reverse("todos-board")
    return next_url


@board_login_required
@operator_may(CHANGE_ENDPOINT)
@require_POST
def clock_endpoint(request, slug, state):
    """Board button: clock an endpoint in or out (docs/reference.md#presence) as its operator;
    clocking in sends the waiting work as one digest (reason ``operator``)."""
    if state not in ("in", "out"):
        raise Http404("no such state")
    endpoint = _visible_endpoint_or_404(request.user, slug)
    endpoint_transitions.clock(endpoint, state, reason="operator")
    report = endpoint_transitions.presence_report(endpoint)
    note = f" (operator override until {report['override_until']})" if report["override_until"] else ""
    messages.success(request, f"{endpoint.slug} is {report['presence']}{note}")
    return _back_to_board(request)


def _visible_endpoint_or_404(user, slug):
    endpoint = endpoint_queries.visible_endpoints(user).filter(slug=slug).first()
    if endpoint is None:
        raise Http404("no such endpoint")
    return endpoint


def _back_to_board(request):
    next_url = request.POST.get("next", "")
    if not url_has_allowed_host_and_scheme(next_url, {request.get_host()}, request.is_secure()):
        next_url = reverse("todos-board")
    return redirect(next_url)


@board_login_required
@operator_may(CHANGE_ENDPOINT)
@require_POST
def pause_endpoint(request, slug, action):
    """Board buttons: pause or resume an endpoint's work, or one queue of it
    (docs/reference.md#pausing), as its operator. Resuming sends the waiting work as one digest
    (reason ``resumed``)."""
    if action not in ("pause", "resume"):
        raise Http404("no such action")
    endpoint = _visible_endpoint_or_404(request.user, slug)
    queue = request.POST.get("queue", "").strip() or None
    change = endpoint_transitions.pause_work if action == "pause" else endpoint_transitions.resume_work
    try:
        paused = change(endpoint, queue=queue, actor=request.user.username)
    except (ValueError, ValidationError) as error:
        messages.error(request, f"{endpoint.slug}: {'; '.join(getattr(error, 'messages', [str(error)]))}")
    else:
        messages.success(request, f"{endpoint.slug}: paused {', '.join(paused) or 'nothing'}")
    return _back_to_board(request)


def _caps_from_form(post) -> dict:
    """The endpoint page's caps form: ``max_claimed`` (blank: unlimited) and ``queue_limits``
    as ``deploys=1, inbox=2`` (``q=`` or ``q=none`` removes one). ValidationError naming the
    field for anything that is not a whole number."""
    def number(text, field):
        text = text.strip()
        if text == "" or text.lower() == "none":
            return None
        try:
            return int(text)
        except ValueError:
            raise ValidationError({field: f"a whole number from 0 to {MAX_CLAIM_CAP}, or "
                                          f"blank; got {text[:40]!r}"}) from None

    caps = {"max_claimed": number(post.get("max_claimed", ""), "max_claimed"), "queue_limits": {}}
    for pair in filter(None, (part.strip() for part in post.get("queue_limits", "").split(","))):
        queue, equals, value = pair.partition("=")
        if not equals:
            raise ValidationError({"queue_limits": f"write queue=N, got {pair!r}"})
        caps["queue_limits"][queue.strip()] = number(value, "queue_limits")
    return caps


@never_cache
@board_login_required
@operator_may(CHANGE_ENDPOINT)
@require_POST
def limit_endpoint(request, slug):
    """The endpoint page's caps form (docs/work-control.md#caps). A bad cap is a 400 naming
    the field, with the page as it was (nothing written)."""
    endpoint = _visible_endpoint_or_404(request.user, slug)
    try:
        caps = _caps_from_form(request.POST)
        # Queues the endpoint caps today and the form no longer names lose their cap.
        dropped = {queue: None for queue in endpoint.queue_limits or {}
                   if queue not in caps["queue_limits"]}
        endpoint_transitions.set_claim_caps(
            endpoint, max_claimed=caps["max_claimed"],
            queue_limits={**dropped, **caps["queue_limits"]}, actor=request.user.username)
    except ValidationError as error:
        return _endpoint_page(request, endpoint, limit_error=validation_text(error), status=400)
    messages.success(request, f"{endpoint.slug}: caps saved")
    return redirect(reverse("todos-endpoint", args=[endpoint.slug]))


def _plain_number(value) -> str | None:
    """A budget as an operator writes it (12.5, not 12.500000); None stays None."""
    return None if value is None else format(Decimal(value).normalize(), "f")


@never_cache
@board_login_required
@operator_may(CHANGE_ENDPOINT)
@require_POST
def budget_endpoint(request, slug):
    """The endpoint page's budget form (docs/reference.md#usage-and-budgets), for an operator
    who may change endpoints. Blank: no budget. A bad number is a 400 naming the field, with
    the page as it was (nothing written)."""
    endpoint = _visible_endpoint_or_404(request.user, slug)
    try:
        fields = {}
        for name in ("budget_usd_per_day", "budget_tokens_per_day", "max_cost_usd"):
            text = request.POST.get(name, "").strip()
            fields[name] = None if text in ("", "none") else text
        if fields["budget_tokens_per_day"] is not None:
            try:
                fields["budget_tokens_per_day"] = int(fields["budget_tokens_per_day"])
            except ValueError:
                raise ValidationError({"budget_tokens_per_day": "a whole number of tokens, or "
                                       f"blank; got {fields['budget_tokens_per_day']!r}"}) from None
        usage.set_endpoint_budget(endpoint, actor=request.user.username, **fields)
    except ValidationError as error:
        return _endpoint_page(request, endpoint, budget_error=validation_text(error), status=400)
    messages.success(request, f"{endpoint.slug}: budget saved")
    return redirect(reverse("todos-endpoint", args=[endpoint.slug]))


# -- /metrics ------------------------------------------------------------------------------------


# /metrics names every operator's endpoints and queues: only a scraper's token or a superuser
# reads it, never an address for being loopback (a proxy or tunnel makes everyone 127.0.0.1;
# docs/operating.md#metrics).


def _refuse_metrics(request) -> HttpResponse | None:
    """None when ``request`` may read /metrics, else the refusal to send."""
    user = getattr(request, "user", None)
    if user is not None and user.is_active and user.is_superuser:
        return None
    token = settings.SWITCHBOARD_METRICS_TOKEN
    if token:
        header = request.headers.get("Authorization", "")
        presented = header[len("Bearer "):] if header.startswith("Bearer ") else ""
        # Digests first: compare_digest is constant-time only between equal lengths.
        if hmac.compare_digest(hashlib.sha256(presented.encode()).digest(),
                               hashlib.sha256(token.encode()).digest()):
            return None
        if user is not None and user.is_authenticated:
            return HttpResponse("metrics are for superusers and the scraper's token\n",
                                status=403, content_type="text/plain")
        response = HttpResponse("metrics need the bearer token\n", status=401,
                                content_type="text/plain")
        response["WWW-Authenticate"] = "Bearer"
        return response
    return HttpResponse("not found\n", status=404, content_type="text/plain")


@require_GET
@never_cache
def metrics(request):
    """Prometheus text exposition, for a superuser or the bearer SWITCHBOARD_METRICS_TOKEN
    (without a token: superusers only)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from . import metrics as queue_metrics

    refusal = _refuse_metrics(request)
    if refusal is not None:
        return refusal
    # switchboard.metrics' registry, with the queue series console.metrics registers in it.
    return HttpResponse(generate_latest(queue_metrics.REGISTRY), content_type=CONTENT_TYPE_LATEST)


# -- the endpoint's page -------------------------------------------------------------------------


@never_cache
@board_login_required
@require_GET
def endpoint_list(request):
    """Every endpoint the operator may see, each linking to its page."""
    endpoints = list(usage.with_spend_today(
        endpoint_queries.visible_endpoints(request.user).order_by("slug"), timezone.now()))
    for endpoint in endpoints:
        endpoint.spend = usage.spend_today(endpoint)  # marks one over budget
    return render(request, "console/endpoints.html", {"endpoints": endpoints})


def _live_sessions(endpoint, now) -> list[dict]:
    # Only the label leaves here: a whole session id is a handle of its session.
    return [{"label": holders.session_label(row["client_name"], row["client_version"], row["id"]),
             "streaming": row["streaming"], "attached": row["attached"],
             "last_seen_at": row["last_seen_at"]}
            for row in push_queries.live_sessions(endpoint.pk, now)]


def endpoint_caps(endpoint) -> list[str]:
    """The endpoint's limits on claimed work, as lines to show, when it has any (fields the
    work-control settings add: ``max_claimed``, ``queue_limits``)."""
    caps = []
    max_claimed = getattr(endpoint, "max_claimed", None)
    if max_claimed is not None:
        caps.append(f"at most {max_claimed} claimed at once")
    for queue, limit in sorted((getattr(endpoint, "queue_limits", None) or {}).items()):
        caps.append(f"{queue}: at most {limit} claimed")
    return caps


def _endpoint_page(request, endpoint, *, new_credential=None, limit_error=None, status=200,
                   budget_error=None):
    now = timezone.now()
    mcp_url = f"{settings.SWITCHBOARD_PUBLIC_URL}/mcp/{endpoint.slug}"
    sessions = _live_sessions(endpoint, now)
    credentials = [credential for credential in endpoint.credentials.order_by("-created_at")
                   if credential.expires_at is None or credential.expires_at > now]
    report = endpoint_transitions.presence_report(endpoint, now=now)
    glance = glance_payload([endpoint], now=now)
    columns = glance["columns"]
    queues = glance["endpoints"][0]["queues"]
    return render(request, "console/endpoint.html", {
        "endpoint": endpoint,
        "glance": glance,
        "caps": endpoint_caps(endpoint),
        # Cells named by state ("done", not "done_24h"): the header says it is the last day.
        "count_columns": [(column, column.removesuffix("_24h"),
                           column.replace("_24h", " 24 h").replace("_", " ")) for column in columns],
        "counts": [{"queue": queue, "cells": [(column.removesuffix("_24h"),
                                               queues[queue].get(column, 0))
                                              for column in columns]}
                   for queue in sorted(queues)],
        "presence": report["presence"],
        "override_until": report["override_until"],
        "sessions": sessions,
        "credentials": credentials,
        "new_credential": new_credential,
        "mcp_url": mcp_url,
        "snippets": connect_snippets.all_snippets(mcp_url),
        "export_line": connect_snippets.export_line(),
        "next_url": reverse("todos-endpoint", args=[endpoint.slug]),
        "claimed_total": sum(queues[queue].get("claimed", 0) for queue in queues),
        "queue_limits_text": ", ".join(f"{queue}={cap}"
                                       for queue, cap in (endpoint.queue_limits or {}).items()),
        "limit_error": limit_error,
        "spend": usage.spend_report(endpoint, now),
        "budget_error": budget_error,
        "may_change_budget": request.user.has_perm(CHANGE_ENDPOINT),
        # As an operator writes them: 12.5, not 12.500000.
        "budget_form": {name: _plain_number(getattr(endpoint, name)) or "" for name in
                        ("budget_usd_per_day", "budget_tokens_per_day", "max_cost_usd")},
    }, status=status)


@never_cache
@board_login_required
@require_GET
def endpoint_page(request, slug):
    """The endpoint's home (docs/console.md): its queues' counts, presence, pause, live sessions by
    client, and how to connect an agent, the credential only as its hint. Another operator's
    endpoint is a 404, as on the board."""
    return _endpoint_page(request, _visible_endpoint_or_404(request.user, slug))


@never_cache
@board_login_required
@require_GET
def endpoint_sessions(request, slug):
    """The live-sessions rows alone: the endpoint page refreshes them while it is open."""
    endpoint = _visible_endpoint_or_404(request.user, slug)
    return render(request, "console/_sessions.html",
                  {"sessions": _live_sessions(endpoint, timezone.now())})


@never_cache
@board_login_required
@operator_may(CHANGE_ENDPOINT)
@require_POST
def rotate_endpoint_credential(request, slug):
    """Mint a new credential and show it in this one answer (never stored in plain text, never
    shown again); the old ones keep working through the rotation grace."""
    endpoint = _visible_endpoint_or_404(request.user, slug)
    credential = endpoint_transitions.rotate_credential(endpoint)
    return _endpoint_page(request, endpoint, new_credential=credential)
