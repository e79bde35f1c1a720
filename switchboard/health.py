"""/healthz (the process answers) and /readyz (its dependencies answer), as JSON (§2)."""

import logging

import redis
from django.conf import settings
from django.db import connection
from django.http import JsonResponse
from django.views.decorators.http import require_GET

log = logging.getLogger("switchboard.health")

# A readiness probe must answer fast even when Redis is black-holed.
REDIS_PROBE_TIMEOUT_SECONDS = 1.0


@require_GET
def healthz(request):
    return JsonResponse({"status": "ok"})


def _check_database():
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()


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


@require_GET
def readyz(request):
    checks = {"database": _check_database}
    if settings.REDIS_URL:
        checks["redis"] = _check_redis
    results = {}
    for name, check in checks.items():
        try:
            check()
            results[name] = "ok"
        except Exception as exc:
            log.warning("readiness check failed", extra={"check": name, "error": type(exc).__name__})
            results[name] = f"error: {type(exc).__name__}"
    ready = all(value == "ok" for value in results.values())
    return JsonResponse({"status": "ok" if ready else "unavailable", "checks": results},
                        status=200 if ready else 503)
