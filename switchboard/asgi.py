"""The one routing file for HTTP, SSE and MCP (docs/architecture.md#the-layers).

Long-lived streams (the MCP endpoint, the board's SSE) are plain ASGI apps that keep their own
channel-layer groups (channels_push.bus.group_reader); the webhook
hooks are a plain ASGI app (switchboard.http.plain: the hot path, without Django's request
machinery); everything else is Django's ASGI handler. Every route checks the Host header
against ALLOWED_HOSTS (plain.AllowedHostsOnly, or the MCP endpoint's and SyncHandlerApp's
own check).
"""

import asyncio
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "switchboard.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import re_path  # noqa: E402

from channels_push.board import stream as board_stream  # noqa: E402
from channels_push.bus import publish  # noqa: E402
from channels_push.mcp import shell as mcp_shell  # noqa: E402
from console import webhooks as console_webhooks  # noqa: E402
from ingest import hook as ingest_hook  # noqa: E402
from switchboard import tracing  # noqa: E402
from switchboard.http import client_address, daphne_tuning, plain  # noqa: E402

daphne_tuning.skip_form_parsing()
# Exports only when OTEL_EXPORTER_OTLP_ENDPOINT is set (docs/operating.md#traces); the
# embedded default (manage.py serve) is this process, its sweeps included.
tracing.start("web")

http_routes = [
    # MCP Streamable HTTP (docs/reference.md#sessions-and-streams), /mcp/<endpoint_slug>; never
    # redirects. Checks Host itself (on the request it decodes once), like SyncHandlerApp below.
    re_path(mcp_shell.ROUTE_PATTERN, mcp_shell.McpEndpoint()),
    # The Todos board's live stream: session-authenticated like the board itself, re-checked
    # on every keep-alive (docs/security.md#who-may-read-who-may-act).
    re_path(r"^todos/events$", plain.AllowedHostsOnly(board_stream.application())),
    # A webhook page's live delivery log (docs/senders.md#the-delivery-log): a board stream of one
    # group per webhook, with the board's caps and re-checks.
    re_path(r"^todos/webhooks/(?P<slug>[-a-zA-Z0-9_]+)/events$", plain.AllowedHostsOnly(
        board_stream.group_stream_application(console_webhooks.delivery_stream_group))),
    # Webhook deliveries (docs/reference.md#the-hooks-answers), /hooks/<webhook_slug>: any slug text
    # is captured so that an unknown one gets ingest's JSON 404.
    re_path(ingest_hook.HOOK_ROUTE_PATTERN,
            plain.SyncHandlerApp(ingest_hook.answer_hook, ingest_hook.refusal_answer)),
    # Everything else is Django. Static files (the console's and the admin's) come from the
    # installed apps through Django's own handler, which does not check Host as views do.
    re_path(r"", plain.AllowedHostsOnly(ASGIStaticFilesHandler(django_asgi_app))),
]

router = ProtocolTypeRouter({"http": URLRouter(http_routes)})


async def application(scope, receive, send):
    # After-commit publishes from request threads are handed to this (the server's) loop.
    publish.bind_server_loop(asyncio.get_running_loop())
    # Behind the reverse proxy, every route sees the client's address, not the proxy's.
    return await router(client_address.scope_with_client_address(scope), receive, send)
