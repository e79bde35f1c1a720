from django.contrib import admin

from .models import OidcIdentity


@admin.register(OidcIdentity)
class OidcIdentityAdmin(admin.ModelAdmin):
    list_display = ("subject", "user", "created_at")
    search_fields = ("subject", "user__username")
    raw_id_fields = ("user",)

    # Linking an identity lets its holder sign in as the user: superusers only.
    def has_module_permission(self, request):
        return request.user.is_active and request.user.is_superuser

    def has_view_permission(self, request, obj=None):
        return self.has_module_permission(request)

    has_add_permission = has_change_permission = has_delete_permission = has_view_permission
