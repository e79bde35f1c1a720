"""The console's pages of ingest: the webhook pages with their delivery log, and
the board's "new todo" form (the API's hand-over from a signed-in operator's form).
"""

from django.conf import settings
from django.contrib import messages
from django.http import Http404, JsonResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST
from django.utils import timezone

from ingest import connections, queries, sender_setup, senders, transitions, write_back
from ingest import api as hand_over_api
from ingest.api import HAND_OVER_FIELDS, hand_over_arguments
from ingest.models import DeliveryRecord, Outcome, Webhook, WriteBack
from ingest.problems import Problem
from switchboard import json_input
from switchboard import metrics as push_metrics
from switchboard import tracing
from todos import transitions as todo_transitions
from todos.models import Todo

from . import views as board_views


# -- the webhook pages of the board (docs/console.md) --------------------------------------------
#
# Live over a board stream of the webhook's group (channels_push.board.stream).

WEBHOOK_PAGE_DELIVERIES = 200
# The failing write-backs a webhook page lists (the count covers them all).
WEBHOOK_PAGE_FAILING_WRITE_BACKS = 5
# The permission testing a connection needs: its admin twin's ("Test selected connections"
# changes the connection's identity, last success and last error).
CHANGE_CONNECTION = "ingest.change_connection"


_board_login_required = board_views.board_login_required


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
    return render(request, "console/webhooks.html", {"webhooks": webhooks})


@_board_login_required
@never_cache
def webhook_page(request, slug):
    webhook = get_visible_webhook(request.user, slug)
    context = _webhook_context(request, webhook)
    context.update({
        "hook_url": f"{settings.SWITCHBOARD_PUBLIC_URL}/hooks/{webhook.slug}",
        "routes": webhook.routes.select_related("endpoint").order_by("id"),
        "drops": webhook.drops.filter(dropped__gt=0).order_by("-minute")[:20],
        "unsigned_warning": ("" if senders.get_sender(webhook.source).signed
                             else transitions.unsigned_warning()),
        "public_url_warning": sender_setup.public_url_warning(settings.SWITCHBOARD_PUBLIC_URL,
                                                              webhook.source),
        "setup_steps": sender_setup.setup_steps(
            webhook.source, f"{settings.SWITCHBOARD_PUBLIC_URL}/hooks/{webhook.slug}",
            webhook.slug),
        "sender_minted": webhook.source in sender_setup.SENDER_MINTED,
        **_write_back_context(webhook),
    })
    return render(request, "console/webhook.html", context)


def _write_back_context(webhook) -> dict:
    """The webhook page's write-back card: its connection and the failing write-backs, or, with
    no connection, which kinds it could take and whether switchboard can make them yet."""
    connection = webhook.connection
    kinds = [spec.kind for spec in senders.get_sender(webhook.source).connections]
    return {
        "connection": connection,
        "connection_kinds": kinds,
        "buildable_kinds": [kind for kind in kinds if kind in connections.buildable_kinds()],
        "trouble": (queries.write_back_trouble(webhook, limit=WEBHOOK_PAGE_FAILING_WRITE_BACKS)
                    if connection is not None else None),
    }


@_board_login_required
@board_views.operator_may(CHANGE_CONNECTION)
@require_POST
def test_webhook_connection(request, slug):
    """The webhook page's "test": call the source's identity endpoint with the webhook's
    connection and record what it said (ingest.connections.test_connection), then back to the
    page with the outcome."""
    webhook = get_visible_webhook(request.user, slug)
    if webhook.connection is None:
        messages.error(request, f"webhook {webhook.slug} has no connection to test")
    else:
        test = connections.test_connection(webhook.connection)
        if test.ok:
            messages.success(request, f"{webhook.connection.name}: writes back as {test.identity}")
        else:
            messages.error(request, f"{webhook.connection.name}: the test failed: {test.error}")
    return redirect("webhook-page", slug=webhook.slug)


@_board_login_required
@board_views.operator_may(board_views.CHANGE_TODO)  # as the todo's other buttons
@require_POST
def retry_todo_write_back(request, todo_id, write_back_id):
    """A todo page's "retry now" of a failed or abandoned write-back: due again at once with a
    fresh retry budget (ingest.write_back.retry_write_back). Another operator's todo, or a
    write-back of another todo, is a 404."""
    todo = board_views.get_visible_todo(request.user, todo_id)
    row = WriteBack.objects.filter(pk=write_back_id, todo_id=todo.pk).first()
    if row is None:
        raise Http404("no such write-back")
    if write_back.retry_write_back(row):
        messages.success(request, f"#{todo.pk}: the {row.action} write-back is due again")
    else:
        messages.error(request, f"#{todo.pk}: the {row.action} write-back is {row.state}, "
                                "neither failed nor abandoned: nothing to retry")
    return redirect("todos-detail", todo_id=todo.pk)


@_board_login_required
@never_cache
def webhook_rows(request, slug):
    """The deliveries table body alone: what the page re-fetches on every live event."""
    webhook = get_visible_webhook(request.user, slug)
    return render(request, "console/_deliveries.html", _webhook_context(request, webhook))


@_board_login_required
@board_views.operator_may(board_views.ADD_TODO)  # a redelivery makes new todos
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
    written_back = queries.write_backs_of_todos([todo.pk for todo in todos])
    for todo in todos:
        todo.written_back = written_back.get(todo.pk, [])
    return render(request, "console/delivery.html", {
        "webhook": webhook, "record": record, "todos": todos,
        "headers": sorted((record.headers or {}).items()),
        "trust": record.delivery_event.trust if record.delivery_event else "",
    })


# -- the board's "new todo" form ----------------------------------------------------------------
#
# The operator API's hand-over from a form, checked by the API's own ``hand_over_arguments``.
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


NEW_TODO_ROUTE = "/todos/new"


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
@board_views.operator_may(board_views.ADD_TODO)
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
        return render(request, "console/new_todo.html", context)
    if request.method != "POST":
        return JsonResponse({"error": "GET or POST"}, status=405)
    # A traced hand-over, as the API's: its span starts the todo's trace.
    with tracing.delivery(f"POST {NEW_TODO_ROUTE}", request.headers.get("traceparent"),
                          **{"http.request.method": "POST", "http.route": NEW_TODO_ROUTE}) as span:
        response = _hand_over_from_form(request, endpoints, context, span)
        span.set(**{"http.response.status_code": response.status_code})
    return response


def _hand_over_from_form(request, endpoints, context, span):
    endpoint = next((e for e in endpoints if e.slug == request.POST.get("endpoint")), None)
    try:
        if endpoint is None:
            raise Problem(400, "invalid_argument", "endpoint: choose one of yours")
        arguments = hand_over_arguments(endpoint, _new_todo_data(request.POST),
                                         now=timezone.now())
        todo, created = transitions.hand_over_todo(endpoint=endpoint, operator=request.user,
                                                   **arguments)
    except Problem as problem:
        context["error"] = f"{problem.message} ({problem.code})"
        return render(request, "console/new_todo.html", context, status=problem.status)
    except todo_transitions.Refusal as refusal:
        context["error"] = f"{refusal.message} ({refusal.code})"
        return render(request, "console/new_todo.html", context, status=400)
    push_metrics.INGEST_ACCEPTED.labels(source="operator").inc()
    hand_over_api.note_hand_over(span, endpoint, todo, created)
    if created:
        messages.success(request, f"handed over #{todo.pk} to {endpoint.slug}/{todo.queue}")
    else:
        messages.info(request, f"#{todo.pk} already holds that idempotency key: nothing new")
    return redirect(reverse("todos-board") + f"?endpoint={endpoint.slug}")
