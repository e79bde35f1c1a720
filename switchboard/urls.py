from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import path

from todos import views as todo_views

from . import health

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("admin/", admin.site.urls),
    # -- operator console (issue 7); /todos/events is the SSE consumer routed in asgi.py --
    path("accounts/login/", todo_views.LoginView.as_view(), name="board-login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(next_page="board-login"), name="board-logout"),
    path("todos/", todo_views.board, name="todos-board"),
    path("todos/rows", todo_views.board_rows, name="todos-rows"),
    path("todos/board.js", todo_views.board_script, name="todos-board-js"),
    path("todos/<int:todo_id>/", todo_views.todo_detail, name="todos-detail"),
    path("todos/<int:todo_id>/<slug:action>", todo_views.todo_act, name="todos-act"),
    path("metrics", todo_views.metrics, name="metrics"),
]
