"""/healthz (the process answers) and /readyz (its dependencies answer), as JSON
(docs/operating.md#health)."""

import concurrent.futures
import logging

import redis
from django.conf import settings
from django.db import InterfaceError, OperationalError, connection
from django.http import JsonResponse
from django.views.decorators.http import require_GET

from switchboard.db import pool_check
from switchboard.http import plain

log = logging.getLogger("switchboard.health")

# A readiness probe must answer fast even when Redis is black-holed.
REDIS_PROBE_TIMEOUT_SECONDS = 1.0


@require_GET
def healthz(request):
    return JsonResponse({"status": "ok"})


def note_database_unavailable(exc, **context) -> None:
    """Log a request the database failed (one line, the error's type only: a driver's message
    can quote row values) and replace dead pooled connections. Callers answer
    ``plain.database_unavailable_answer()``."""
    log.error("database unavailable", extra={**context, "error": type(exc).__name__})
    pool_check.discard_broken_pooled_connections()


# The database probe runs on a worker thread of its own and is given this long: a pooled
# connection can wait 5 s for PostgreSQL (settings), and a readiness probe must answer fast.
# Two workers: a probe stuck behind a dead database does not queue the next.
DATABASE_PROBE_TIMEOUT_SECONDS = 1.0
_probe_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2,
                                                    thread_name_prefix="readyz-probe")


class ProbeTimeout(Exception):
    pass


def _select_one():
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    finally:
        connection.close()  # this thread's own connection: back to the pool at once


def _check_database():
    future = _probe_pool.submit(_select_one)
    try:
        future.result(timeout=DATABASE_PROBE_TIMEOUT_SECONDS)
    except concurrent.futures.TimeoutError:
        raise ProbeTimeout() from None


# Errors that mean "the database cannot be reached or used right now" (a retry may work), as
# opposed to a bug (an IntegrityError, a ProgrammingError) which stays a 500.
UNAVAILABLE_ERRORS = (OperationalError, InterfaceError)


class DatabaseUnavailableMiddleware:
    """Django views (the board, the admin, the operator API) answer 503 + Retry-After with a
    JSON body when the database is unreachable, as /hooks and /mcp do, instead of a 500 page
    and a traceback per request."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exception):
        if not isinstance(exception, UNAVAILABLE_ERRORS):
            return None
        note_database_unavailable(exception, route="django", path=request.path[:100])
        return plain.django_response(plain.database_unavailable_answer())


def _check_redis():
    client = redis.Redis.from_url(
        settings.REDIS_URL,
        socket_connect_timeout=REDIS_PROBE_TIMEOUT_SECONDS,
        socket_timeout=REDIS_PROBE_TIMEOUT_SECONDS,
    )
    try:
        client.ping()
    finally:
        client.close()


# Redis is probed at the same time as the database, on a pool of its own, so /readyz answers
# within about one probe timeout even when both hang (one after the other took two timeouts).
_redis_probe_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2,
                                                          thread_name_prefix="readyz-redis")


def _redis_probe_started():
    future = _redis_probe_pool.submit(_check_redis)

    def wait():
        try:
            future.result(timeout=REDIS_PROBE_TIMEOUT_SECONDS)
        except concurrent.futures.TimeoutError:
            raise ProbeTimeout() from None

    return wait


@require_GET
def readyz(request):
    checks = {}
    if settings.REDIS_URL:
        checks["redis"] = _redis_probe_started()  # running while the database is probed
    checks = {"database": _check_database, **checks}
    results = {}
    for name, check in checks.items():
        try:
            check()
            results[name] = "ok"
        except Exception as exc:
            log.warning("readiness check failed", extra={"check": name, "error": type(exc).__name__})
            results[name] = "error: timeout" if isinstance(exc, ProbeTimeout) \
                else f"error: {type(exc).__name__}"
            if name == "database":
                pool_check.discard_broken_pooled_connections()
    ready = all(value == "ok" for value in results.values())
    return JsonResponse({"status": "ok" if ready else "unavailable", "checks": results},
                        status=200 if ready else 503)
