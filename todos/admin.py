"""Admin for todos: read-mostly. Nothing here saves a todo; its actions call the transitions.

Built for large tables: no full result count, page counts capped, the endpoint joined in the
list query, and only filters whose choices need no query over the todos.
"""

import json

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.views.main import ChangeList
from django.core.paginator import Paginator
from django.utils.functional import cached_property
from django.utils.html import format_html

from channels_push.sessions import holders
from endpoints import queries as endpoint_queries

from . import transitions
from .models import Todo, TodoEvent


class CappedCountPaginator(Paginator):
    """Counting millions of done rows to draw page links costs more than the page itself; count
    at most COUNT_CAP + 1 rows (one bounded subquery) and page within that."""

    COUNT_CAP = 10_000

    @cached_property
    def count(self):
        return self.object_list[: self.COUNT_CAP + 1].count()


class EndpointFilter(admin.SimpleListFilter):
    """The endpoints this admin user may see: the stock related filter would list every
    endpoint's slug, and its "only related" variant runs a DISTINCT over all todos."""

    title = "endpoint"
    parameter_name = "endpoint"

    def lookups(self, request, model_admin):
        endpoints = endpoint_queries.visible_endpoints(request.user).order_by("slug")
        return [(str(endpoint.pk), endpoint.slug) for endpoint in endpoints]

    def queryset(self, request, queryset):
        value = self.value()
        if value and value.isdigit():
            return queryset.filter(endpoint_id=int(value))
        return queryset


class TodoEventInline(admin.TabularInline):
    model = TodoEvent
    fields = ["at", "action", "from_state", "to_state", "actor_label", "detail"]
    readonly_fields = fields
    ordering = ["at", "id"]
    extra = 0
    can_delete = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._labels = {}  # todo id -> {actor: label}; an inline instance lives one request

    @admin.display(description="actor")
    def actor_label(self, event):
        # An agent's actor is its session id, a handle of the session: shown as client and
        # hint, like on the board. One query for the whole history, not one per event.
        if event.todo_id not in self._labels:
            actors = TodoEvent.objects.filter(todo_id=event.todo_id).values_list("actor", flat=True)
            self._labels[event.todo_id] = holders.holder_labels(actors)
        return self._labels[event.todo_id].get(event.actor, event.actor)

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


def lease_override_action(action: str, description: str, call):
    """An admin action running ``call(caller, todo, lease)`` through ``TodoAdmin._override``."""

    @admin.action(description=description, permissions=["transition"])
    def run(self, request, queryset):
        self._override(request, queryset, action, call)

    return run


class HolderLabelChangeList(ChangeList):
    """The change list with every row's lease holder labelled in one query for the page."""

    def get_results(self, request):
        super().get_results(request)
        labels = holders.holder_labels(todo.lease_owner for todo in self.result_list)
        for todo in self.result_list:
            todo.holder_label = labels.get(todo.lease_owner, todo.lease_owner)


class TodoActionForm(helpers.ActionForm):
    """The action bar, plus the value "Set priority" sets."""

    priority = forms.IntegerField(required=False, label="priority",
                                  help_text="for “Set priority”: -100 to 100")


class ScheduledFilter(admin.SimpleListFilter):
    title = "scheduled"
    parameter_name = "scheduled"

    def lookups(self, request, model_admin):
        return [("yes", "scheduled (not before a time)"), ("no", "not scheduled")]

    def queryset(self, request, queryset):
        if self.value() in ("yes", "no"):
            return queryset.filter(not_before__isnull=self.value() == "no")
        return queryset


@admin.register(Todo)
class TodoAdmin(admin.ModelAdmin):
    list_display = ["id", "title", "endpoint", "queue", "state", "priority", "not_before",
                    "trust", "attempts", "lease_holder", "updated_at"]
    list_filter = ["state", "trust", ScheduledFilter, EndpointFilter]
    action_form = TodoActionForm
    list_select_related = ["endpoint"]
    search_fields = ["=idempotency_key", "title"]
    ordering = ["-id"]
    show_full_result_count = False
    paginator = CappedCountPaginator
    list_per_page = 100
    inlines = [TodoEventInline]
    actions = ["retry_now", "release_lease", "extend_lease", "complete_lease", "fail_lease",
               "promote", "set_priority", "run_now", "approve", "reject", "cancel"]
    readonly_fields = ["endpoint", "queue", "state", "priority", "not_before", "title", "kind",
                       "source", "trust",
                       "payload_pretty", "result_pretty", "last_error", "idempotency_key",
                       "attempts", "max_attempts", "lease_id", "lease_holder", "lease_expires_at",
                       "retry_at", "dead_lettered_at", "cancelled_at", "created_at", "updated_at",
                       "ring_attempts", "last_ringed_at", "delivery_event"]
    fields = readonly_fields

    def get_changelist(self, request, **kwargs):
        return HolderLabelChangeList

    @admin.display(description="lease holder")
    def lease_holder(self, obj):
        """The holder as ``client version · hint`` (never a whole session id: it is a handle
        of the session); the change list labels its page at once."""
        if not obj.lease_owner:
            return "—"
        label = getattr(obj, "holder_label", None)
        return label or holders.holder_labels([obj.lease_owner])[obj.lease_owner]

    @admin.display(description="payload (secrets as refs)")
    def payload_pretty(self, obj):
        return format_html("<pre>{}</pre>", json.dumps(obj.payload, indent=2, sort_keys=True))

    @admin.display(description="result")
    def result_pretty(self, obj):
        if obj.result is None:
            return "—"
        return format_html("<pre>{}</pre>", json.dumps(obj.result, indent=2, sort_keys=True))

    def get_queryset(self, request):
        todos = super().get_queryset(request)
        if request.user.is_superuser:
            return todos
        return todos.filter(endpoint__in=endpoint_queries.visible_endpoints(request.user))

    # Read-mostly: no add, no delete, no save (a save would write a stale copy of the row over
    # a concurrent transition). Actions need the change permission, checked by hand.
    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_transition_permission(self, request):
        return request.user.has_perm("todos.change_todo")

    def _run(self, request, queryset, verb, call):
        done, refused = [], []
        for todo in queryset.select_related("endpoint"):
            caller = transitions.Caller.operator(todo.endpoint, request.user.get_username())
            try:
                call(caller, todo)
                done.append(f"#{todo.pk}")
            except transitions.Refusal as refusal:
                refused.append(f"#{todo.pk}: {refusal.message}")
        if done:
            self.message_user(request, f"{verb} {len(done)}: {' '.join(done)}", messages.SUCCESS)
        for line in refused:
            self.message_user(request, line, messages.WARNING)

    @admin.action(description="Retry now (failed -> pending, fresh attempts)",
                  permissions=["transition"])
    def retry_now(self, request, queryset):
        self._run(request, queryset, "re-queued",
                  lambda caller, todo: transitions.requeue_todo(caller, todo.pk))

    @admin.action(description="Promote to operator trust (unverified todos, pending or awaiting "
                              "approval; approving never does)",
                  permissions=["transition"])
    def promote(self, request, queryset):
        self._run(request, queryset, "promoted",
                  lambda caller, todo: transitions.promote_todo(caller, todo.pk))

    @admin.action(description="Set priority (the value beside the action) of waiting todos",
                  permissions=["transition"])
    def set_priority(self, request, queryset):
        text = request.POST.get("priority", "").strip()
        try:
            priority = int(text)
        except ValueError:
            priority = text  # refused by the transition, naming the field, for every todo
        self._run(request, queryset, "set the priority of",
                  lambda caller, todo: transitions.set_priority_todo(caller, todo.pk, priority))

    @admin.action(description="Run now (scheduled -> ready at once)", permissions=["transition"])
    def run_now(self, request, queryset):
        self._run(request, queryset, "made ready now",
                  lambda caller, todo: transitions.run_now_todo(caller, todo.pk))

    @admin.action(description="Approve (awaiting approval -> pending: handed to agents, rung; "
                              "trust unchanged)",
                  permissions=["transition"])
    def approve(self, request, queryset):
        self._run(request, queryset, "approved",
                  lambda caller, todo: transitions.approve_todo(caller, todo.pk))

    @admin.action(description="Reject (awaiting approval -> cancelled)", permissions=["transition"])
    def reject(self, request, queryset):
        self._run(request, queryset, "rejected",
                  lambda caller, todo: transitions.reject_todo(caller, todo.pk,
                                                               reason="rejected in admin"))

    @admin.action(description="Cancel (final; a claimed todo is taken from its agent)",
                  permissions=["transition"])
    def cancel(self, request, queryset):
        self._run(request, queryset, "cancelled",
                  lambda caller, todo: transitions.cancel_todo(caller, todo.pk,
                                                               reason="cancelled in admin"))

    def _override(self, request, queryset, action, call):
        """Act on whoever holds each todo's lease, as an override when it is not this admin
        user's own (the board's rule, ``transitions.agent_lease_to_override``). Fenced by the lease
        just read: a claim that changes between that read and the action is refused rather
        than taken over."""
        username = request.user.get_username()
        self._run(request, queryset, transitions.ACTION_DONE[action], lambda caller, todo: call(
            caller, todo, transitions.agent_lease_to_override(todo, username, action)))

    release_lease = lease_override_action(
        "release", "Release the agent's lease (claimed -> pending)",
        lambda caller, todo, lease: transitions.release_todo(caller, todo.pk, overriding=lease))
    extend_lease = lease_override_action(
        "extend", "Extend the agent's lease by the endpoint's default lease",
        lambda caller, todo, lease: transitions.heartbeat_todo(
            caller, todo.pk, overriding=lease,
            lease_ttl_seconds=todo.endpoint.effective_lease.total_seconds()))
    complete_lease = lease_override_action(
        "complete", "Complete, overriding the agent's lease (claimed -> done)",
        lambda caller, todo, lease: transitions.complete_todo(caller, todo.pk, overriding=lease))
    fail_lease = lease_override_action(
        "fail", "Fail, overriding the agent's lease (claimed -> failed)",
        lambda caller, todo, lease: transitions.fail_todo(
            caller, todo.pk, error="failed by operator (admin)", overriding=lease))
