"""Admin for endpoints: vending (the credential is shown once), rotation, scope, verbs, lease.

Credentials are listed by hint only; their digests never reach a page. Writes that mint
credentials go through ``endpoints.transitions`` like the commands do.
"""

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from switchboard import admin_pages

from . import transitions
from .models import AGENT_VERBS, ALL_QUEUES, Credential, Endpoint


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
                  "accept_unverified",
                  # §8 presence: the manual state is set by the clock actions (they send the
                  # digest); schedule and override are edited here.
                  "shift_timezone", "shift_schedule", "presence_override", "presence_override_until"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.instance.pk:
            self.initial["scope"] = ",".join(self.instance.scope)

    def clean_shift_schedule(self):
        return self.cleaned_data.get("shift_schedule") or []

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
    inlines = [CredentialInline]
    list_display = ["slug", "owner", "scope_display", "default_lease_seconds", "max_attempts",
                    "active", "presence_display", "created_at"]
    list_filter = ["active"]
    list_select_related = ["owner"]
    search_fields = ["slug"]
    show_full_result_count = False
    actions = ["rotate_credentials", "clock_in", "clock_out"]
    readonly_fields = ["presence_state", "presence_hold_until", "presence_boundary_at"]

    @admin.display(description="scope")
    def scope_display(self, obj):
        return ", ".join(obj.scope)

    @admin.display(description="presence (now)")
    def presence_display(self, obj):
        return obj.presence_at(timezone.now()) if obj.pk else "-"

    def _clock(self, request, queryset, state):
        from channels_push import doorbells  # endpoints -> channels_push only at call time

        for endpoint in queryset:
            presence = doorbells.clock(endpoint, state, reason="operator")
            self.message_user(request, f"{endpoint.slug} is {presence}")

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
            from channels_push import doorbells

            # An edited override or schedule may turn presence in right now: announce it like
            # a clock-in by the operator (the boundary sweep only sees boundaries in time).
            now = timezone.now()
            before = Endpoint.objects.get(pk=obj.pk).presence_at(now)
            super().save_model(request, obj, form, change)
            if before == "out" and obj.presence_at(now) == "in":
                transaction.on_commit(lambda: doorbells.send_digest(obj, "operator", now=now))
            return None
        # Vending mints the first credential with the endpoint, in one transaction.
        vended, credential = transitions.vend_endpoint(
            slug=obj.slug, owner=obj.owner, scope=obj.scope, verbs=obj.verbs,
            default_lease_seconds=obj.default_lease_seconds, max_attempts=obj.max_attempts,
        )
        if not obj.active:
            Endpoint.objects.filter(pk=vended.pk).update(active=False)
        obj.pk, obj.created_at = vended.pk, vended.created_at
        obj._state.adding = False
        request._vended_credentials = [(vended.slug, credential)]

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
