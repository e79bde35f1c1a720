"""Plain HTTP endpoints served straight from ASGI: the request is read here, answered by one
plain sync function in one thread hop, and written back here.

Why not Django's ASGI handler for such endpoints: per request it starts (and joins) a thread
for the view's sync context, walks the middleware chain through several sync/async hops and
builds an HttpRequest and an HttpResponse, which alone costs more than a webhook delivery's
own work (measured in docs/decisions/hook-outside-django.md). Endpoints that need none of it
(no session, no CSRF, no templates) are served here instead: the webhook hooks
(``ingest.hook.answer_hook``) and, for its requests and answers, the MCP transport.

What Django's stack did for these endpoints and is kept here: the Host header is checked
against ALLOWED_HOSTS (CommonMiddleware's ``get_host()``), answers carry
``X-Content-Type-Options: nosniff`` (SecurityMiddleware), the database connection is returned
after the hop (``database_sync_to_async`` closes old connections as Django's request signals
did), and an unexpected exception is logged and answered 500 without the body.
"""

import asyncio
import contextvars
import functools
import json
import logging
from dataclasses import dataclass, field
from datetime import timedelta

from channels.db import database_sync_to_async
from django.conf import settings
from django.db import DatabaseError, close_old_connections
from django.http import HttpResponse
from django.http.request import split_domain_port, validate_host

from switchboard.db import pool_check

log = logging.getLogger("switchboard.http")

JSON_HEADERS = {"Content-Type": "application/json", "X-Content-Type-Options": "nosniff"}
# Django's own fallback when DEBUG is on and ALLOWED_HOSTS is empty (HttpRequest.get_host).
DEBUG_LOCAL_HOSTS = [".localhost", "127.0.0.1", "[::1]"]


@dataclass
class Request:
    method: str
    slug: str  # the route's one path parameter
    headers: dict  # lower-cased names -> str (latin-1); a repeated header keeps the last
    body: bytes = b""
    # The body passed the size cap (by Content-Length or as read); reading stopped there.
    too_large: bool = False
    # The client's address (ASGI ``client``, which switchboard/http/client_address.py has made the
    # client's own behind a trusted proxy).
    client: str = ""

    def header(self, name: str) -> str | None:
        return self.headers.get(name)


@dataclass
class Answer:
    status: int
    body: bytes = b""
    headers: dict = field(default_factory=dict)

    def header_list(self) -> list[tuple[bytes, bytes]]:
        return [(k.lower().encode("latin-1"), str(v).encode("latin-1"))
                for k, v in self.headers.items()]


def json_answer(status: int, payload, headers=None) -> Answer:
    return Answer(status, json.dumps(payload).encode(), {**JSON_HEADERS, **(headers or {})})


def django_response(answer: Answer) -> HttpResponse:
    """``answer`` from a Django view or middleware, for an answer every surface gives alike."""
    return HttpResponse(answer.body, status=answer.status, headers=answer.headers)


# Every surface's answer when the database could not serve: nothing was done, retry after
# this long (docs/operating.md#when-postgresql-is-down).
DATABASE_UNAVAILABLE_RETRY_AFTER = timedelta(seconds=5)
DATABASE_UNAVAILABLE_MESSAGE = "the database is unreachable; retry"


def database_unavailable_answer(message: str = DATABASE_UNAVAILABLE_MESSAGE, *,
                                payload=None) -> Answer:
    """503 + Retry-After with the JSON body ``{"error": {"code": "unavailable", "message"}}``;
    ``payload`` replaces the body for an endpoint with an error format of its own (MCP's
    JSON-RPC envelope)."""
    if payload is None:
        payload = {"error": {"code": "unavailable", "message": message}}
    retry_after = int(DATABASE_UNAVAILABLE_RETRY_AFTER.total_seconds())
    return json_answer(503, payload, {"Retry-After": str(retry_after)})


def request_from_scope(scope) -> Request:
    headers = {name.decode("latin-1").lower(): value.decode("latin-1")
               for name, value in scope.get("headers", ())}
    kwargs = scope.get("url_route", {}).get("kwargs", {})
    peer = scope.get("client") or ("", 0)
    return Request(method=scope["method"].upper(), slug=next(iter(kwargs.values()), ""),
                   headers=headers, client=str(peer[0] or ""))


def host_allowed(request: Request, scope) -> bool:
    """The Host header (else the server's name) must match ALLOWED_HOSTS, as Django's
    ``HttpRequest.get_host()`` requires for every view behind CommonMiddleware."""
    host = request.header("host")
    if host is None:
        server = scope.get("server") or ("", None)
        host = str(server[0] or "")
    allowed = settings.ALLOWED_HOSTS
    if settings.DEBUG and not allowed:
        allowed = DEBUG_LOCAL_HOSTS
    return _host_matches(host, tuple(allowed))


@functools.lru_cache(maxsize=1024)
def _host_matches(host: str, allowed: tuple) -> bool:
    """Remembered per (Host, ALLOWED_HOSTS): an agent sends the same Host on every call, and
    parsing and matching it again cost more than the rest of the check. Bounded:
    Host is the client's to choose, so a flood of new values only evicts old answers."""
    domain, _ = split_domain_port(host)
    return bool(domain) and validate_host(domain, allowed)


class AllowedHostsOnly:
    """ASGI middleware answering 400 (JSON) to a request whose Host is not in ALLOWED_HOSTS.

    Django checks the Host only for views behind CommonMiddleware; the routes asgi.py serves
    without Django's request machinery (the MCP endpoint, the board's event stream, static
    files) would otherwise answer any Host, which is what DNS rebinding needs. ``SyncHandlerApp``
    checks on its own (it answers in its endpoint's error format), and so does the MCP endpoint
    (with the request it builds anyway, so the headers are decoded once per call)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not host_allowed(request_from_scope(scope), scope):
            await send_answer(send, host_refusal())
            return
        return await self.app(scope, receive, send)


def host_refusal() -> Answer:
    """The answer to a Host outside ALLOWED_HOSTS on the plain routes."""
    return json_answer(400, {"error": {"code": "bad_request", "message": "Host not allowed"}})


class ClientGone(Exception):
    """The client disconnected before its body was complete: nothing may run on a part."""


async def read_body(request: Request, receive, limit: int) -> bool:
    """Read the whole body into ``request.body``; True (and stop reading) once it passes
    ``limit``. A declared Content-Length over the limit is refused before reading anything.
    Raises ClientGone on a disconnect mid-body (daphne buffers whole requests, other ASGI
    servers stream them: a truncated delivery must not be verified, counted or written)."""
    declared = request.header("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        return True
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return True
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    request.body = b"".join(chunks)
    return False


def in_thread_pool(function):
    """``function`` (a plain sync request handler) as a coroutine function that runs it in the
    event loop's thread pool, with the database hygiene ``database_sync_to_async`` gives:
    Django's old or broken connections are closed before and after, which with the pool
    returns the connection after every request.

    What asgiref's SyncToAsync adds on top of that — a shielded future, re-homing context
    variables and asgiref ``Local`` storage both ways, the thread-local an ``async_to_sync``
    inside the handler would need — served nothing here (the handlers set no context variable
    and never call back into async code) and cost a measurable share of the hop's CPU on every
    MCP request. A handler that needs any of it uses ``database_sync_to_async``. Cancelling the
    awaiting task behaves as with asgiref: the caller stops waiting, the handler finishes in
    its thread."""

    async def run(*args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            None, contextvars.copy_context().run, _with_connection_hygiene, function, args,
            kwargs)

    return run


def sync_hop(function, *, thread_sensitive: bool):
    """How a request handler runs: the lean ``in_thread_pool`` hop in a server, asgiref's
    ``database_sync_to_async`` on the main thread for in-process tests (so the handler sees
    the test's uncommitted transaction)."""
    if thread_sensitive:
        return database_sync_to_async(function, thread_sensitive=True)
    return in_thread_pool(function)


def _with_connection_hygiene(function, args, kwargs):
    close_old_connections()
    try:
        return function(*args, **kwargs)
    finally:
        close_old_connections()


# Statuses that carry no body and must not declare a length (RFC 9110, section 8.6).
NO_BODY_STATUSES = frozenset({204, 304})


async def send_answer(send, answer: Answer):
    headers = answer.header_list()
    if answer.status not in NO_BODY_STATUSES and answer.status >= 200:
        # Declared, as Django's CommonMiddleware did: without it daphne chunks the answer.
        headers.append((b"content-length", str(len(answer.body)).encode()))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})


class SyncHandlerApp:
    """ASGI app answering every request with ``handler(request) -> Answer``, a plain sync
    function run in ONE thread hop (``sync_hop``). The body is read (at most
    ``SWITCHBOARD_MAX_BODY_BYTES`` + one chunk) before the hop; a body over the cap is not read
    further and the handler sees ``request.too_large``, so it answers 413 in its own terms.

    ``refusal(status, code, message)`` builds the answers given without the handler (a bad
    Host, an internal error), in the endpoint's own error format.
    """

    def __init__(self, handler, refusal, *, thread_sensitive: bool = False):
        self.handler = handler
        self.refusal = refusal
        # The thread pool, not Django's one sync thread, which would queue every request behind
        # the others' round trips; in-process tests pass True to see their own transaction.
        self.run_handler = sync_hop(handler, thread_sensitive=thread_sensitive)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        request = request_from_scope(scope)
        try:
            if not host_allowed(request, scope):
                await send_answer(send, self.refusal(400, "bad_request", "Host not allowed"))
                return
            request.too_large = await read_body(request, receive,
                                                settings.SWITCHBOARD_MAX_BODY_BYTES)
            await send_answer(send, await self.run_handler(request))
        except ClientGone:
            return  # nobody to answer, and nothing was run
        except Exception as exc:
            # Never the body or headers in the log: they may carry secrets or signatures.
            log.exception("request failed", extra={"slug": request.slug, "method": request.method})
            if isinstance(exc, DatabaseError):
                await database_sync_to_async(pool_check.discard_broken_pooled_connections)()
            try:
                await send_answer(send, self.refusal(500, "internal_error", "internal error"))
            except Exception:  # the answer had already started; nothing more to say
                pass
