"""Admin for endpoints: vending (the credential is shown once), rotation, scope, verbs, lease.

Credentials are listed by hint only; their digests never reach a page. Writes that mint
credentials go through ``endpoints.transitions`` like the commands do.
"""

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.utils.html import format_html_join
from django.utils.safestring import mark_safe
from django.urls import reverse
from django.utils import timezone

from switchboard import admin_pages, json_input

from . import transitions
from .models import AGENT_VERBS, ALL_QUEUES, Credential, Endpoint

# Fields vend_endpoint takes itself; the admin's add form writes the rest after it.
VENDED_FIELDS = frozenset({"slug", "owner", "scope", "verbs", "default_lease_seconds",
                           "max_attempts", "accept_unverified"})
# The endpoint page lists this many recent pause/resume events.
WORK_EVENTS_SHOWN = 20


class EndpointForm(forms.ModelForm):
    scope = forms.CharField(
        initial=ALL_QUEUES,
        help_text="Comma-separated queue names this endpoint may see, or * for all of its queues.",
    )
    verbs = forms.MultipleChoiceField(
        choices=[(verb, verb) for verb in AGENT_VERBS], initial=list(AGENT_VERBS),
        widget=forms.CheckboxSelectMultiple, help_text="Agent verbs this endpoint may call.",
    )

    class Meta:
        model = Endpoint
        fields = ["slug", "owner", "scope", "verbs", "default_lease_seconds", "max_attempts", "active",
                  "accept_unverified", "max_claimed", "queue_limits",
                  "approval_timeout_seconds",
                  "budget_usd_per_day", "budget_tokens_per_day", "max_cost_usd",
                  # Presence: the manual state is set by the clock actions (they send the
                  # digest); schedule and override are edited here.
                  "shift_timezone", "shift_schedule", "presence_override", "presence_override_until"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.instance.pk:
            self.initial["scope"] = ",".join(self.instance.scope)

    def clean_shift_schedule(self):
        return self.cleaned_data.get("shift_schedule") or []

    def clean_queue_limits(self):
        return self.cleaned_data.get("queue_limits") or {}

    def clean_scope(self):
        names = [name.strip() for name in self.cleaned_data["scope"].split(",") if name.strip()]
        return [ALL_QUEUES] if ALL_QUEUES in names else names


class CredentialInline(admin.TabularInline):
    model = Credential
    fields = ["hint", "created_at", "expires_at"]
    readonly_fields = fields
    extra = 0
    can_delete = True  # deleting a credential revokes it at once
    verbose_name_plural = "credentials (hints only; use the rotate action for a new one)"

    def has_add_permission(self, request, obj=None):
        return False


def show_credentials_once(request, credentials, *, title):
    """A page with freshly minted credentials: the only time they are ever displayed."""
    return admin_pages.show_secrets_once(
        request, title=title, headers=["endpoint", "MCP URL", "credential"],
        rows=[(slug, f"{settings.SWITCHBOARD_PUBLIC_URL}/mcp/{slug}", credential)
              for slug, credential in credentials],
        back_url=reverse("admin:endpoints_endpoint_changelist"))


@admin.register(Endpoint)
class EndpointAdmin(admin.ModelAdmin):
    form = EndpointForm
    formfield_overrides = json_input.ADMIN_FORMFIELD_OVERRIDES
    inlines = [CredentialInline]
    list_display = ["slug", "owner", "scope_display", "default_lease_seconds", "max_attempts",
                    "active", "presence_display", "paused_display", "created_at"]
    list_filter = ["active"]
    list_select_related = ["owner"]
    search_fields = ["slug"]
    show_full_result_count = False
    actions = ["rotate_credentials", "clock_in", "clock_out", "clear_override", "pause_work",
               "resume_work"]
    readonly_fields = ["presence_state", "presence_hold_until", "presence_boundary_at",
                       "paused_queues", "work_events"]

    @admin.display(description="scope")
    def scope_display(self, obj):
        return ", ".join(obj.scope)

    @admin.display(description="presence (now)")
    def presence_display(self, obj):
        if not obj.pk:
            return "-"
        report = transitions.presence_report(obj)
        if report["override_until"]:
            return f"{report['presence']} (override until {report['override_until']})"
        return report["presence"]

    @admin.display(description="work events (pause / resume, newest first)")
    def work_events(self, obj):
        # Read-only here (not an inline: nothing about them is edited): the actions, the board
        # and the commands write them.
        if not obj.pk:
            return "-"
        events = obj.events.order_by("-at", "-id")[:WORK_EVENTS_SHOWN]
        return format_html_join(mark_safe("<br>"), "{} {} {} by {}", (
            (event.at.isoformat(timespec="seconds"), event.action, event.queue, event.actor)
            for event in events)) or "-"

    @admin.display(description="paused")
    def paused_display(self, obj):
        return ", ".join(obj.paused_queues or []) or "-"

    def _clock(self, request, queryset, state):
        for endpoint in queryset:
            transitions.clock(endpoint, state, reason="operator")
            report = transitions.presence_report(endpoint)
            note = (f" (operator override until {report['override_until']})"
                    if report["override_until"] else "")
            self.message_user(request, f"{endpoint.slug} is {report['presence']}{note}")

    @admin.action(description="Clear the operator override (schedule or clock rules again)",
                  permissions=["change"])
    def clear_override(self, request, queryset):
        for endpoint in queryset:
            presence = transitions.clear_override(endpoint)
            self.message_user(request, f"{endpoint.slug} is {presence}")

    def _change_work(self, request, queryset, change):
        for endpoint in queryset:
            paused = change(endpoint, actor=request.user.get_username())
            self.message_user(request, f"{endpoint.slug}: paused {', '.join(paused) or 'nothing'}")

    @admin.action(description="Pause work (agents take nothing; ingest continues)",
                  permissions=["change"])
    def pause_work(self, request, queryset):
        self._change_work(request, queryset, transitions.pause_work)

    @admin.action(description="Resume work (waiting work arrives as one digest)",
                  permissions=["change"])
    def resume_work(self, request, queryset):
        self._change_work(request, queryset, transitions.resume_work)

    @admin.action(description="Clock in (waiting work arrives as one digest)", permissions=["change"])
    def clock_in(self, request, queryset):
        self._clock(request, queryset, "in")

    @admin.action(description="Clock out (no doorbells until clocked in)", permissions=["change"])
    def clock_out(self, request, queryset):
        self._clock(request, queryset, "out")

    def get_queryset(self, request):
        endpoints = super().get_queryset(request)
        return endpoints if request.user.is_superuser else endpoints.filter(owner=request.user)

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        # A staff operator vends endpoints for themselves only.
        if db_field.name == "owner" and not request.user.is_superuser:
            kwargs["queryset"] = db_field.related_model.objects.filter(pk=request.user.pk)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def save_model(self, request, obj, form, change):
        if change:
            # An edited override or schedule may turn presence in right now: announce it like
            # a clock-in by the operator (the boundary sweep only sees boundaries in time).
            now = timezone.now()
            stored = Endpoint.objects.get(pk=obj.pk)
            before = stored.presence_at(now)
            super().save_model(request, obj, form, change)
            transitions.announce_edited_presence(obj, before, now=now)
            # A budget event as the command records, and a raise's digest.
            transitions.record_edited_budget(
                obj, {name: getattr(stored, name) for name in transitions.BUDGET_FIELDS},
                actor=request.user.get_username(), now=now)
            if stored.owner_id != obj.owner_id:
                self._warn_stranded_routes(request, obj)
            return None
        # Vending mints the first credential with the endpoint, in the admin's transaction.
        vended, credential = transitions.vend_endpoint(
            slug=obj.slug, owner=obj.owner, scope=obj.scope, verbs=obj.verbs,
            default_lease_seconds=obj.default_lease_seconds, max_attempts=obj.max_attempts,
            accept_unverified=obj.accept_unverified,
        )
        # Every other field the form edits (active, the shift schedule, the presence override,
        # …) as the operator set it: a new endpoint must not start more open than asked, and
        # the form has already validated the whole instance.
        rest = {name: getattr(obj, name) for name in form._meta.fields
                if name not in VENDED_FIELDS and name in form.cleaned_data}
        if rest:
            Endpoint.objects.filter(pk=vended.pk).update(**rest)
        obj.pk, obj.created_at = vended.pk, vended.created_at
        obj._state.adding = False
        request._vended_credentials = [(vended.slug, credential)]

    def _warn_stranded_routes(self, request, endpoint):
        """Giving an endpoint to another operator stops the routes of webhooks the new owner
        does not own (ingest checks ownership on every delivery); say how many."""
        stranded = endpoint.routes.exclude(webhook__owner_id=endpoint.owner_id).count()
        if stranded:
            self.message_user(
                request, f"{endpoint.slug} now belongs to {endpoint.owner}: {stranded} route(s) "
                         f"from webhooks of other operators no longer deliver to it (stranded; "
                         f"listed under Routes, where either owner can remove them)",
                messages.WARNING)

    def response_add(self, request, obj, post_url_continue=None):
        credentials = getattr(request, "_vended_credentials", None)
        if credentials:
            return show_credentials_once(request, credentials, title=f"Endpoint {obj.slug} vended")
        return super().response_add(request, obj, post_url_continue)

    @admin.action(description="Rotate credential (old ones keep working for 24 h)",
                  permissions=["change"])
    def rotate_credentials(self, request, queryset):
        minted = [(endpoint.slug, transitions.rotate_credential(endpoint)) for endpoint in queryset]
        if not minted:
            self.message_user(request, "no endpoints selected", messages.WARNING)
            return None
        return show_credentials_once(request, minted, title="New credentials")
