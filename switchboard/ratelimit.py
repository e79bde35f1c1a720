"""Fixed-window request limits shared by every web process (ingest per webhook; reusable for
MCP per credential).

With ``REDIS_URL`` set, each window is one Redis counter (INCR + EXPIRE in one round trip), so
any number of daphne processes share the limit. Without Redis — or while Redis is unreachable —
the count falls back to this process: a limit must never fail or stall the request it guards
(ingest has to answer 202 with Redis down), so Redis errors open a short circuit breaker and
are logged, not raised. A fixed window admits up to 2x the rate across a window edge; that is
accepted for a flood guard (a sliding log would cost a sorted set per key).
"""

import logging
import math
import threading
import time
from dataclasses import dataclass

import redis
from django.conf import settings

log = logging.getLogger("switchboard.ratelimit")

WINDOW_SECONDS = 60
# A rate check is on every request's path: never wait on Redis for longer than this.
REDIS_TIMEOUT_SECONDS = 0.2
# After a Redis failure, count in-process for this long before trying Redis again, so a dead
# Redis costs one failed call per interval rather than a timeout per request.
REDIS_RETRY_AFTER_FAILURE_SECONDS = 5.0
KEY_PREFIX = "switchboard:ratelimit"


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    retry_after_seconds: int  # until the window ends; meaningful when not allowed


_clients: dict[str, redis.Redis] = {}
_redis_down_until = 0.0
_local_counts: dict[tuple[str, int], int] = {}
_lock = threading.Lock()


def _redis_client(url: str) -> redis.Redis:
    client = _clients.get(url)
    if client is None:
        client = redis.Redis.from_url(
            url, socket_connect_timeout=REDIS_TIMEOUT_SECONDS, socket_timeout=REDIS_TIMEOUT_SECONDS
        )
        _clients[url] = client
    return client


def _count_in_redis(url: str, key: str) -> int | None:
    global _redis_down_until
    if time.monotonic() < _redis_down_until:
        return None
    try:
        pipe = _redis_client(url).pipeline(transaction=False)
        pipe.incr(key)
        pipe.expire(key, WINDOW_SECONDS + 1)
        count, _ = pipe.execute()
        return int(count)
    except redis.RedisError as exc:
        _redis_down_until = time.monotonic() + REDIS_RETRY_AFTER_FAILURE_SECONDS
        log.warning("rate limit counting in-process: redis unavailable",
                    extra={"error": type(exc).__name__})
        return None


def _count_locally(key: str, window: int) -> int:
    with _lock:
        for stale in [k for k in _local_counts if k[1] < window]:
            del _local_counts[stale]
        count = _local_counts.get((key, window), 0) + 1
        _local_counts[(key, window)] = count
        return count


def hit(scope: str, *, limit_per_minute: int, now: float | None = None) -> Verdict:
    """Count one request against ``scope`` (e.g. ``ingest:<webhook id>``) and say whether it is
    within ``limit_per_minute``."""
    now = time.time() if now is None else now
    window = int(now // WINDOW_SECONDS)
    key = f"{KEY_PREFIX}:{scope}:{window}"
    count = None
    if settings.REDIS_URL:
        count = _count_in_redis(settings.REDIS_URL, key)
    if count is None:
        count = _count_locally(key, window)
    retry_after = max(1, math.ceil((window + 1) * WINDOW_SECONDS - now))
    return Verdict(allowed=count <= limit_per_minute, retry_after_seconds=retry_after)


def reset_local_state() -> None:
    """Forget in-process counts and the breaker (tests)."""
    global _redis_down_until
    with _lock:
        _local_counts.clear()
    _redis_down_until = 0.0
