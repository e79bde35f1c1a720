from django.conf import settings
from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.templatetags.static import static
from django.urls import include, path, re_path
from django.views.generic import RedirectView

from console import views as console_views
from console import webhooks as console_webhooks
from ingest import api as ingest_api

from . import health

admin.site.site_header = "switchboard admin"
admin.site.site_title = "switchboard admin"
admin.site.index_title = "switchboard"

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    # Browsers ask for /favicon.ico whatever the page links; the file is a console static file.
    path("favicon.ico", RedirectView.as_view(url=static("console/favicon.svg"))),
    path("admin/", admin.site.urls),
    # ingest; POST /hooks/<webhook_slug> is routed in asgi.py (the hot path).
    re_path(r"^api/v1/endpoints/(?P<endpoint_slug>[^/]+)/stats/?$", ingest_api.endpoint_stats,
            name="api-endpoint-stats"),
    re_path(r"^api/v1/endpoints/(?P<endpoint_slug>[^/]+)/todos/?$", ingest_api.hand_over,
            name="hand_over"),
    # An operator's actions on one todo (docs/work-control.md): priority, run_now, cancel,
    # approve, reject. Any id reaches the view, which answers a malformed one a JSON 404.
    re_path(r"^api/v1/todos/(?P<todo_id>[^/]+)/(?P<action>[a-z_-]{1,32})/?$",
            ingest_api.todo_action, name="todo_action"),
    # "retry now" of a failed or abandoned write-back of one todo (docs/write-back.md).
    re_path(r"^api/v1/todos/(?P<todo_id>[^/]+)/write-backs/(?P<write_back_id>[^/]+)/retry/?$",
            ingest_api.retry_todo_write_back, name="todo_write_back_retry"),
    # -- operator console (docs/console.md); /todos/events is the SSE consumer routed in asgi.py --
    path("accounts/login/", console_views.LoginView.as_view(), name="board-login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(next_page="board-login"), name="board-logout"),
    path("todos/", console_views.board, name="todos-board"),
    path("todos/rows", console_views.board_rows, name="todos-rows"),
    path("todos/glance", console_views.board_glance, name="todos-glance"),
    path("todos/new", console_webhooks.board_new_todo, name="todos-new"),
    path("todos/bulk/<slug:action>", console_views.bulk_act, name="todos-bulk"),
    path("todos/approvals", console_views.board_approvals, name="todos-approvals"),
    path("todos/<int:todo_id>/", console_views.todo_detail, name="todos-detail"),
    path("todos/<int:todo_id>/<slug:action>", console_views.todo_act, name="todos-act"),
    path("todos/<int:todo_id>/write-backs/<int:write_back_id>/retry",
         console_webhooks.retry_todo_write_back, name="todos-write-back-retry"),
    path("todos/endpoints/", console_views.endpoint_list, name="todos-endpoints"),
    path("todos/endpoints/<slug:slug>/", console_views.endpoint_page, name="todos-endpoint"),
    path("todos/endpoints/<slug:slug>/sessions", console_views.endpoint_sessions,
         name="todos-endpoint-sessions"),
    path("todos/endpoints/<slug:slug>/rotate", console_views.rotate_endpoint_credential,
         name="todos-endpoint-rotate"),
    path("todos/endpoints/<slug:slug>/clock/<str:state>", console_views.clock_endpoint,
         name="todos-clock"),
    path("todos/endpoints/<slug:slug>/limits", console_views.limit_endpoint, name="todos-limit"),
    path("todos/endpoints/<slug:slug>/budget", console_views.budget_endpoint, name="todos-budget"),
    path("todos/endpoints/<slug:slug>/work/<str:action>", console_views.pause_endpoint,
         name="todos-pause"),
    path("metrics", console_views.metrics, name="metrics"),
    # Webhook pages with their delivery log; .../events is the SSE route in asgi.py.
    path("todos/webhooks/", console_webhooks.webhook_list, name="webhook-list"),
    path("todos/webhooks/<slug:slug>/", console_webhooks.webhook_page, name="webhook-page"),
    path("todos/webhooks/<slug:slug>/rows", console_webhooks.webhook_rows, name="webhook-rows"),
    path("todos/webhooks/<slug:slug>/test-connection", console_webhooks.test_webhook_connection,
         name="webhook-test-connection"),
    path("todos/webhooks/<slug:slug>/deliveries/<int:record_id>/", console_webhooks.delivery_detail,
         name="webhook-delivery"),
    path("todos/webhooks/<slug:slug>/deliveries/<int:record_id>/redeliver",
         console_webhooks.redeliver_delivery, name="webhook-redeliver"),
    # GET / leads to the board.
    path("", RedirectView.as_view(pattern_name="todos-board", permanent=False), name="home"),
]

if settings.OIDC_ENABLED:
    urlpatterns.append(path("oidc/", include("mozilla_django_oidc.urls")))
