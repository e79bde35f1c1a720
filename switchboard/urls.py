from django.conf import settings
from django.contrib import admin
from django.urls import include, path, re_path

from ingest import views as ingest_views

from . import health

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("admin/", admin.site.urls),
    # ingest (§5): any slug text is captured so that an unknown one gets ingest's JSON 404.
    re_path(r"^hooks/(?P<webhook_slug>[^/]+)/?$", ingest_views.receive_hook, name="receive_hook"),
    re_path(r"^api/v1/endpoints/(?P<endpoint_slug>[^/]+)/todos/?$", ingest_views.hand_over,
            name="hand_over"),
]

if settings.OIDC_ENABLED:
    urlpatterns.append(path("oidc/", include("mozilla_django_oidc.urls")))
