from django.conf import settings
from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path, re_path
from django.views.generic import RedirectView

from ingest import api as ingest_api
from ingest import views as ingest_views
from todos import views as todo_views

from . import console_assets, health

admin.site.site_header = "switchboard admin"
admin.site.site_title = "switchboard admin"
admin.site.index_title = "switchboard"

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("console.css", console_assets.console_style, name="console-css"),
    path("favicon.svg", console_assets.favicon, name="favicon"),
    path("favicon.ico", console_assets.favicon),
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
    # -- operator console (docs/console.md); /todos/events is the SSE consumer routed in asgi.py --
    path("accounts/login/", todo_views.LoginView.as_view(), name="board-login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(next_page="board-login"), name="board-logout"),
    path("todos/", todo_views.board, name="todos-board"),
    path("todos/rows", todo_views.board_rows, name="todos-rows"),
    path("todos/board.js", todo_views.board_script, name="todos-board-js"),
    path("todos/board.css", todo_views.board_style, name="todos-board-css"),
    path("todos/glance", todo_views.board_glance, name="todos-glance"),
    path("todos/glance.js", todo_views.glance_script, name="todos-glance-js"),
    path("todos/new", ingest_views.board_new_todo, name="todos-new"),
    path("todos/bulk/<slug:action>", todo_views.bulk_act, name="todos-bulk"),
    path("todos/approvals", todo_views.board_approvals, name="todos-approvals"),
    path("todos/<int:todo_id>/", todo_views.todo_detail, name="todos-detail"),
    path("todos/<int:todo_id>/<slug:action>", todo_views.todo_act, name="todos-act"),
    path("todos/endpoints/", todo_views.endpoint_list, name="todos-endpoints"),
    path("todos/endpoints/<slug:slug>/", todo_views.endpoint_page, name="todos-endpoint"),
    path("todos/endpoints/<slug:slug>/sessions", todo_views.endpoint_sessions,
         name="todos-endpoint-sessions"),
    path("todos/endpoints/<slug:slug>/rotate", todo_views.rotate_endpoint_credential,
         name="todos-endpoint-rotate"),
    path("todos/endpoints/<slug:slug>/clock/<str:state>", todo_views.clock_endpoint,
         name="todos-clock"),
    path("todos/endpoints/<slug:slug>/limits", todo_views.limit_endpoint, name="todos-limit"),
    path("todos/endpoints/<slug:slug>/work/<str:action>", todo_views.pause_endpoint,
         name="todos-pause"),
    path("metrics", todo_views.metrics, name="metrics"),
    # Webhook pages with their delivery log; .../events is the SSE route in asgi.py.
    path("todos/webhooks/", ingest_views.webhook_list, name="webhook-list"),
    path("todos/webhooks/webhook.js", ingest_views.webhook_script, name="webhook-js"),
    path("todos/webhooks/<slug:slug>/", ingest_views.webhook_page, name="webhook-page"),
    path("todos/webhooks/<slug:slug>/rows", ingest_views.webhook_rows, name="webhook-rows"),
    path("todos/webhooks/<slug:slug>/deliveries/<int:record_id>/", ingest_views.delivery_detail,
         name="webhook-delivery"),
    path("todos/webhooks/<slug:slug>/deliveries/<int:record_id>/redeliver",
         ingest_views.redeliver_delivery, name="webhook-redeliver"),
    # GET / leads to the board.
    path("", RedirectView.as_view(pattern_name="todos-board", permanent=False), name="home"),
]

if settings.OIDC_ENABLED:
    urlpatterns.append(path("oidc/", include("mozilla_django_oidc.urls")))
