"""Admin for webhooks (routes inline, secret rotation), connections (tested on save and on
demand), deliveries, the delivery log and operator API tokens.

Secrets are never rendered again: a minted webhook secret or API token is shown once, on a
page of its own (switchboard.admin_pages), never in a message.

A staff operator who is not a superuser sees and changes only their own rows: their webhooks,
the deliveries attributed to them, their API tokens; routes may point only at their endpoints,
and tokens are minted for themselves only. Superusers see everything.

The route list is the one place both ends of a route meet: it shows the routes of the
operator's webhooks and the routes into the operator's endpoints, and marks those whose webhook
and endpoint no longer share an owner (stranded: they deliver nothing) so that either owner can
remove them.
"""

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import F, Q
from django.forms.models import BaseInlineFormSet
from django.urls import reverse
from django.utils.html import format_html

from endpoints.models import Endpoint
from switchboard import admin_pages, json_input

from . import connections, senders, transitions
from .models import Connection, DeliveryEvent, DeliveryRecord, OperatorToken, Route, Webhook


def show_webhook_secrets_once(request, minted, *, title):
    """The page for fresh webhook secrets (``[(webhook, secret)]``)."""
    return admin_pages.show_secrets_once(
        request, title=title, headers=["webhook", "URL", "secret"],
        rows=[(webhook.slug, f"{settings.SWITCHBOARD_PUBLIC_URL}/hooks/{webhook.slug}", secret)
              for webhook, secret in minted],
        back_url=reverse("admin:ingest_webhook_changelist"),
        note="switchboard keeps it encrypted and never displays it again.")


class RouteFormSet(BaseInlineFormSet):
    """Runs the same route checks as ``add_webhook_route`` (queue in the endpoint's scope, same
    owner) against the webhook as edited on this page — its owner may be changing too, so the
    check cannot live in a single route form."""

    def clean(self):
        super().clean()
        for form in self.forms:
            data = getattr(form, "cleaned_data", None) or {}
            if data.get("DELETE") or data.get("endpoint") is None or not data.get("queue"):
                continue
            try:
                transitions.check_route_target(webhook=self.instance, endpoint=data["endpoint"],
                                               queue=data["queue"])
            except ValidationError as exc:
                form.add_error(None, exc)
            try:
                logins, roles = senders.normalized_actor_rules(
                    self.instance.source, data.get("actors"), data.get("author_associations"))
            except (ValueError, TypeError) as bad:
                form.add_error(None, str(bad))
            else:
                form.instance.actors, form.instance.author_associations = logins, roles
            try:
                form.instance.stop_kinds = transitions.check_thread_options(
                    data.get("follow_ups") or "", data.get("thread_key") or "",
                    data.get("stop_kinds"))
            except ValidationError as exc:
                form.add_error(None, exc)


class RouteInline(admin.TabularInline):
    model = Route
    formset = RouteFormSet
    formfield_overrides = json_input.ADMIN_FORMFIELD_OVERRIDES
    extra = 1
    fields = ("endpoint", "queue", "kinds", "priority", "delay_seconds", "actors",
              "author_associations", "requires_approval", "follow_ups", "thread_key",
              "stop_kinds", "stop", "agent_permissions")
    autocomplete_fields = ()

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        if db_field.name == "endpoint" and not request.user.is_superuser:
            kwargs["queryset"] = Endpoint.objects.filter(owner=request.user)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)


def only_own_users(db_field, request, kwargs):
    """A staff operator can name only themselves in a user field."""
    if not request.user.is_superuser:
        kwargs["queryset"] = db_field.related_model.objects.filter(pk=request.user.pk)


class OwnRowsAdmin(admin.ModelAdmin):
    """Rows with an ``owner`` operator: a staff operator sees, and names as owner, only
    themselves; a superuser everyone."""

    def get_queryset(self, request):
        rows = super().get_queryset(request)
        return rows if request.user.is_superuser else rows.filter(owner=request.user)

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        if db_field.name == "owner":
            only_own_users(db_field, request, kwargs)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)


class WebhookForm(forms.ModelForm):
    new_secret = forms.CharField(
        required=False, widget=forms.PasswordInput(render_value=False),
        help_text="Leave empty to mint one (shown once after saving). Linear, Slack, Sentry and "
                  "Stripe mint their own: paste the secret the sender shows. On an existing "
                  "webhook, use the 'Rotate secret' action instead (or rotate_webhook_secret "
                  "--secret for a sender's new one). An unsigned webhook takes none: anyone "
                  "who knows its URL can create work.",
    )

    class Meta:
        model = Webhook
        fields = ("slug", "owner", "source", "active", "connection")

    def clean(self):
        data = super().clean()
        secret = data.get("new_secret")
        if secret and data.get("source"):
            try:
                transitions.check_webhook_secret(data["source"], secret)
            except ValueError as exc:
                self.add_error("new_secret", str(exc))
        source = data.get("source") or self.instance.source
        if data.get("connection") is not None and source and data.get("owner") is not None:
            probe = Webhook(slug=data.get("slug") or self.instance.slug, source=source,
                            owner=data["owner"])
            try:
                connections.check_webhook_connection(probe, data["connection"])
            except ValidationError as exc:
                self.add_error("connection", exc.message_dict["connection"])
        return data


@admin.register(Webhook)
class WebhookAdmin(OwnRowsAdmin):
    form = WebhookForm
    list_display = ("slug", "source", "owner", "active", "route_count", "rotation",
                    "delivery_log_link")
    list_filter = ("source", "active")
    search_fields = ("slug",)
    inlines = [RouteInline]
    actions = ["rotate_secret", "drop_previous_secret"]

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        if db_field.name == "connection" and not request.user.is_superuser:
            kwargs["queryset"] = Connection.objects.filter(owner=request.user)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def get_fields(self, request, obj=None):
        fields = ["slug", "owner", "source", "active", "connection"]
        return fields if obj else fields + ["new_secret"]

    def get_readonly_fields(self, request, obj=None):
        return ("source",) if obj else ()

    @admin.display(description="routes")
    def route_count(self, obj):
        routes = list(obj.routes.select_related("endpoint"))
        stranded = sum(1 for route in routes if route.endpoint.owner_id != obj.owner_id)
        return f"{len(routes)} ({stranded} stranded)" if stranded else len(routes)

    @admin.display(description="previous secret accepted until")
    def rotation(self, obj):
        return obj.previous_secret_expires_at if obj.previous_secret else "—"

    def save_model(self, request, obj, form, change):
        if change:
            super().save_model(request, obj, form, change)
            return
        secret = form.cleaned_data.get("new_secret") or transitions.mint_webhook_secret(obj.source)
        obj.secret = secret
        super().save_model(request, obj, form, change)
        if secret:
            request._new_webhook_secret = (obj, secret)  # for response_add's page
        if not senders.get_sender(obj.source).signed:
            self.message_user(request, f"Webhook {obj.slug} is unsigned: anyone who knows its URL "
                                       "can create work (todos of trust unverified).",
                              messages.WARNING)

    def response_add(self, request, obj, post_url_continue=None):
        created = getattr(request, "_new_webhook_secret", None)
        if created:
            return show_webhook_secrets_once(request, [created], title=f"Webhook {obj.slug} created")
        return super().response_add(request, obj, post_url_continue)

    @admin.action(description="Rotate secret (the old one stays accepted for 24 h)",
                  permissions=["change"])
    def rotate_secret(self, request, queryset):
        minted = []
        for webhook in queryset:
            if not senders.get_sender(webhook.source).signed:
                self.message_user(request, f"{webhook.slug} is unsigned; nothing to rotate",
                                  messages.WARNING)
                continue
            minted.append((webhook, transitions.rotate_webhook_secret(webhook)))
        if minted:
            return show_webhook_secrets_once(request, minted, title="New webhook secrets")
        return None

    @admin.action(description="Drop previous secret (end the rotation grace now)",
                  permissions=["change"])
    def drop_previous_secret(self, request, queryset):
        count = transitions.drop_previous_webhook_secrets(queryset)
        self.message_user(request, f"dropped the previous secret of {count} webhook(s); only "
                                   f"the current secret verifies now")

    @admin.display(description="deliveries")
    def delivery_log_link(self, obj):
        return format_html('<a href="{}">delivery log</a>',
                           reverse("webhook-page", args=[obj.slug]))


def api_url_help() -> str:
    """The api_url field's help: each connection kind's default, read from its sender, so a
    new kind is named here without an edit."""
    defaults = "; ".join(
        f"{kind}: {spec.default_api_url or 'none, name the instance (https://HOST/api/v1)'}"
        for kind, spec in senders.CONNECTION_SPECS.items())
    return (f"Empty: the kind's default ({defaults}). GitHub Enterprise Server: "
            "https://HOST/api/v3; self-hosted GitLab: https://HOST/api/v4.")


class ConnectionForm(forms.ModelForm):
    new_secret = forms.CharField(
        required=False, widget=forms.Textarea(attrs={"rows": 4, "autocomplete": "off"}),
        strip=True,
        help_text="github_app: the App's private key (the .pem file's text); github_token: the "
                  "token. Stored encrypted, never shown again. On an existing connection, leave "
                  "empty to keep the current one.")

    api_url = forms.URLField(
        required=False, max_length=300, assume_scheme="https",
        help_text=api_url_help())

    class Meta:
        model = Connection
        fields = ("name", "owner", "kind", "api_url", "app_id")

    def clean(self):
        data = super().clean()
        existing = self.instance.pk is not None
        secret = data.get("new_secret") or (self.instance.secret if existing else "")
        kind = data.get("kind") or self.instance.kind
        if not kind:
            return data
        if existing and data.get("owner") is not None:
            try:
                connections.check_connection_owner(self.instance, data["owner"])
            except ValidationError as exc:
                self.add_error("owner", exc.message_dict["owner"])
        try:
            checked = connections.check_connection_fields(
                kind=kind, secret=secret, app_id=data.get("app_id", ""),
                api_url=data.get("api_url") or None)
        except ValidationError as exc:
            for name, problems in exc.message_dict.items():
                self.add_error("new_secret" if name == "secret" else name, problems)
            return data
        data.update(api_url=checked["api_url"], app_id=checked["app_id"])
        self.instance.secret = checked["secret"]
        return data


@admin.register(Connection)
class ConnectionAdmin(OwnRowsAdmin):
    """Connections (docs/write-back.md#connections): saving one tests it, and the "Test"
    action tests again; the secret is write-only."""

    form = ConnectionForm
    list_display = ("name", "kind", "owner", "api_url", "identity", "last_success_at",
                    "last_error_at", "last_error")
    list_filter = ("kind",)
    search_fields = ("name", "identity")
    readonly_fields = ("identity", "identity_id", "last_success_at", "last_error_at",
                       "last_error", "held_until")
    actions = ["test_selected"]

    def get_fields(self, request, obj=None):
        fields = ["name", "owner", "kind", "api_url", "app_id", "new_secret"]
        return fields + list(self.readonly_fields) if obj else fields

    def get_readonly_fields(self, request, obj=None):
        return ("kind", *self.readonly_fields) if obj else ()

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        self._report(request, obj, connections.test_connection(obj))

    def _report(self, request, connection, test):
        if test.ok:
            self.message_user(request, f"{connection.name}: writes back as {test.identity}")
        else:
            self.message_user(request, f"{connection.name}: saved, but the test failed: "
                                       f"{test.error}", messages.WARNING)

    @admin.action(description="Test selected connections", permissions=["change"])
    def test_selected(self, request, queryset):
        for connection in queryset:
            self._report(request, connection, connections.test_connection(connection))


class StrandedFilter(admin.SimpleListFilter):
    title = "ownership"
    parameter_name = "stranded"

    def lookups(self, request, model_admin):
        return [("yes", "stranded (delivers nothing)"), ("no", "delivering")]

    def queryset(self, request, queryset):
        mismatched = ~Q(webhook__owner_id=F("endpoint__owner_id"))
        if self.value() == "yes":
            return queryset.filter(mismatched)
        if self.value() == "no":
            return queryset.exclude(mismatched)
        return queryset


@admin.register(Route)
class RouteAdmin(admin.ModelAdmin):
    """Every route the operator is at either end of, read-only; routes are made on their
    webhook's page. Deleting is open to both ends, so that the new owner of an endpoint can
    remove routes from webhooks that are not theirs."""

    list_display = ("__str__", "priority", "delay_seconds", "webhook_owner", "endpoint_owner",
                    "ownership")
    list_filter = (StrandedFilter,)
    list_select_related = ("webhook__owner", "endpoint__owner")
    fields = ("webhook", "endpoint", "queue", "kinds", "priority", "delay_seconds", "actors",
              "author_associations", "requires_approval", "follow_ups", "thread_key",
              "stop_kinds", "stop", "agent_permissions")
    readonly_fields = fields

    def get_queryset(self, request):
        routes = super().get_queryset(request)
        if request.user.is_superuser:
            return routes
        return routes.filter(Q(webhook__owner=request.user) | Q(endpoint__owner=request.user))

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    @admin.display(description="webhook owner")
    def webhook_owner(self, obj):
        return obj.webhook.owner

    @admin.display(description="endpoint owner")
    def endpoint_owner(self, obj):
        return obj.endpoint.owner

    @admin.display(description="ownership")
    def ownership(self, obj):
        if transitions.is_route_stranded(obj):
            return "stranded: the webhook's owner does not own the endpoint; delivers nothing"
        return "delivering"


@admin.register(DeliveryEvent)
class DeliveryEventAdmin(admin.ModelAdmin):
    list_display = ("id", "received_at", "trust", "source", "kind", "webhook", "attributed_to",
                    "delivery_id")
    list_filter = ("trust", "source")
    search_fields = ("delivery_id", "kind")
    date_hierarchy = "received_at"

    def get_queryset(self, request):
        deliveries = super().get_queryset(request)
        return deliveries if request.user.is_superuser else deliveries.filter(
            attributed_to=request.user)

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class OwnWebhookFilter(admin.SimpleListFilter):
    """The webhooks this admin user owns (all for a superuser): the stock related filter would
    list every operator's webhook slugs."""

    title = "webhook"
    parameter_name = "webhook"

    def lookups(self, request, model_admin):
        webhooks = Webhook.objects.order_by("slug")
        if not request.user.is_superuser:
            webhooks = webhooks.filter(owner=request.user)
        return [(str(webhook.pk), webhook.slug) for webhook in webhooks]

    def queryset(self, request, queryset):
        value = self.value()
        if value and value.isdigit():
            return queryset.filter(webhook_id=int(value))
        return queryset


@admin.register(DeliveryRecord)
class DeliveryRecordAdmin(admin.ModelAdmin):
    """The delivery log (docs/senders.md#the-delivery-log), read-only: every request that named a
    webhook."""

    list_display = ("id", "at", "webhook", "outcome", "status", "kind", "delivery_id", "size",
                    "source_address", "reason", "redelivered_from")
    list_filter = ("outcome", OwnWebhookFilter)
    search_fields = ("delivery_id", "kind", "body_sha256")
    date_hierarchy = "at"
    list_select_related = ("webhook",)

    def get_queryset(self, request):
        records = super().get_queryset(request)
        return records if request.user.is_superuser else records.filter(
            webhook__owner=request.user)

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(OperatorToken)
class OperatorTokenAdmin(admin.ModelAdmin):
    list_display = ("hint", "name", "user", "created_at", "revoked_at")
    list_filter = ("revoked_at",)
    actions = ["revoke"]

    def get_queryset(self, request):
        tokens = super().get_queryset(request)
        return tokens if request.user.is_superuser else tokens.filter(user=request.user)

    def get_fields(self, request, obj=None):
        # A staff operator mints tokens for themselves: no user to choose.
        return ("user", "name") if request.user.is_superuser else ("name",)

    def has_change_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        if not request.user.is_superuser:
            obj.user = request.user
        row, token = transitions.mint_operator_token(user=obj.user, name=obj.name)
        obj.pk = row.pk
        request._minted_token = token  # for response_add's page, never a message

    def response_add(self, request, obj, post_url_continue=None):
        token = getattr(request, "_minted_token", None)
        if token is None:
            return super().response_add(request, obj, post_url_continue)
        return admin_pages.show_secrets_once(
            request, title=f"API token for {obj.user}", headers=["operator", "name", "token"],
            rows=[(obj.user.get_username(), obj.name, token)],
            back_url=reverse("admin:ingest_operatortoken_changelist"))

    def has_revoke_permission(self, request):
        # Revoking changes the token row; the change form itself stays off (a token is
        # never edited), so the model permission is checked here by name.
        return request.user.has_perm("ingest.change_operatortoken")

    @admin.action(description="Revoke selected tokens", permissions=["revoke"])
    def revoke(self, request, queryset):
        count = transitions.revoke_operator_tokens(queryset)
        self.message_user(request, f"revoked {count} token(s)")
