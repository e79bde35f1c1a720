"""Per-key token buckets shared by every web process: ingest per webhook, MCP per credential.

A bucket holds up to ``per_minute`` tokens and refills continuously at ``per_minute`` per
minute; each request takes one. A denied request learns how long until the next token
(``Retry-After``).

Where the buckets live:

* ``REDIS_URL`` set (production, several web processes): in Redis, updated by one Lua script
  so concurrent processes never double-spend a token, timed by Redis's own clock so process
  clocks do not matter.
* unset (embedded default, one process): in this process's memory.

Redis down or slow: the bucket falls back to this process (a limit must never fail or stall
the request it guards: ingest answers 202 with Redis down) and the failure is logged once; a
short circuit breaker keeps later requests off Redis until it is worth trying again, so a dead
Redis costs one failed call per interval rather than a timeout per request.
"""

import hashlib
import logging
import math
import threading
import time
from dataclasses import dataclass

import redis
from django.conf import settings

log = logging.getLogger("switchboard.ratelimit")

# One round trip must not hold a request up for long when Redis is unreachable.
REDIS_TIMEOUT_SECONDS = 0.25
# After a Redis failure, use in-process buckets for this long before trying Redis again.
REDIS_RETRY_AFTER_FAILURE_SECONDS = 5.0
# Cap on in-process buckets: keys are credential digests, so this is a memory bound, not a
# policy; the least recently used are forgotten (a forgotten bucket starts full again).
MAX_LOCAL_BUCKETS = 10_000


@dataclass(frozen=True)
class Decision:
    allowed: bool
    retry_after_seconds: int = 0


def refill_bucket(tokens: float, last_ms: float, now_ms: float, *, per_minute: int):
    """Pure token-bucket step: returns (allowed, tokens_after, wait_ms)."""
    capacity = float(per_minute)
    rate_per_ms = per_minute / 60_000.0
    tokens = min(capacity, tokens + max(0.0, now_ms - last_ms) * rate_per_ms)
    if tokens >= 1.0:
        return True, tokens - 1.0, 0.0
    return False, tokens, (1.0 - tokens) / rate_per_ms


def _decision(allowed: bool, wait_ms: float) -> Decision:
    return Decision(allowed, 0 if allowed else max(1, math.ceil(wait_ms / 1000.0)))


# -- Redis -------------------------------------------------------------------------------------

# KEYS[1] bucket hash; ARGV[1] per_minute; ARGV[2] how many tokens to take at most (the batch,
# see _reservation_size). Returns {allowed, wait_ms, taken}: the same arithmetic as
# refill_bucket, in one atomic script, taking up to the batch when the bucket holds that many.
_TAKE_TOKEN_LUA = """
local capacity = tonumber(ARGV[1])
local batch = tonumber(ARGV[2]) or 1
local rate = capacity / 60000.0
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or capacity
local ts = tonumber(state[2]) or now
tokens = math.min(capacity, tokens + math.max(0, now - ts) * rate)
local allowed = 0
local wait = 0
local taken = 0
if tokens >= 1 then
  taken = math.min(batch, math.floor(tokens))
  tokens = tokens - taken
  allowed = 1
else
  wait = math.ceil((1 - tokens) / rate)
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(60000 * (capacity - tokens) / capacity) + 1000)
return {allowed, wait, taken}
"""

# A busy key's tokens leave Redis a batch at a time (limits of 600/min or more), one round trip
# per batch; a batch unspent after RESERVATION_SECONDS is dropped, never returned, so all
# processes together may under-admit a little, never over.
RESERVATION_SECONDS = 1.0
MAX_RESERVATION = 10


def _reservation_size(per_minute: int) -> int:
    return max(1, min(MAX_RESERVATION, per_minute // 600))


_reserved_lock = threading.Lock()
_reserved: dict[str, tuple[int, float]] = {}  # bucket key -> (tokens left, expires at)


def _spend_reserved(bucket_key: str) -> bool:
    with _reserved_lock:
        left, expires = _reserved.get(bucket_key, (0, 0.0))
        if left <= 0 or expires <= time.monotonic():
            return False
        _reserved[bucket_key] = (left - 1, expires)
        return True


def _keep_reserved(bucket_key: str, tokens: int) -> None:
    with _reserved_lock:
        _reserved[bucket_key] = (tokens, time.monotonic() + RESERVATION_SECONDS)
        while len(_reserved) > MAX_LOCAL_BUCKETS:
            _reserved.pop(next(iter(_reserved)))

_redis_lock = threading.Lock()
_redis_client = None
_take_token_script = None
_redis_down_until = 0.0


def _redis():
    global _redis_client, _take_token_script
    with _redis_lock:
        if _redis_client is None:
            _redis_client = redis.Redis.from_url(
                settings.REDIS_URL, socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
                socket_timeout=REDIS_TIMEOUT_SECONDS,
            )
            _take_token_script = _redis_client.register_script(_TAKE_TOKEN_LUA)
        return _take_token_script


def _redis_key(scope: str, key: str) -> str:
    prefix = getattr(settings, "CHANNEL_LAYERS", {}).get("default", {}).get("CONFIG", {}).get(
        "prefix", "sb")
    return f"{prefix}:ratelimit:{scope}:{key}"


# -- in-process --------------------------------------------------------------------------------

_local_lock = threading.Lock()
_local_buckets: dict[str, tuple[float, float]] = {}


def _take_local(bucket_key: str, per_minute: int) -> Decision:
    now_ms = time.monotonic() * 1000.0
    with _local_lock:
        tokens, last_ms = _local_buckets.pop(bucket_key, (float(per_minute), now_ms))
        allowed, tokens, wait_ms = refill_bucket(tokens, last_ms, now_ms, per_minute=per_minute)
        _local_buckets[bucket_key] = (tokens, now_ms)  # re-insert: dict order is recency
        while len(_local_buckets) > MAX_LOCAL_BUCKETS:
            _local_buckets.pop(next(iter(_local_buckets)))
    return _decision(allowed, wait_ms)


def reset_local_state() -> None:
    """Forget in-process buckets and the breaker (tests)."""
    global _redis_down_until
    with _local_lock:
        _local_buckets.clear()
        _local_counts.clear()
    with _reserved_lock:
        _reserved.clear()
    with _failing_lock:
        _failing_until.clear()
    _redis_down_until = 0.0


def take_token(scope: str, key: str, *, per_minute: int) -> Decision:
    """Spend one request of ``key``'s budget in ``scope`` (e.g. "mcp" + credential digest,
    "ingest" + webhook id). ``key`` is hashed again so a secret never becomes a Redis key."""
    global _redis_down_until
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    if settings.REDIS_URL and time.monotonic() >= _redis_down_until:
        bucket_key = _redis_key(scope, digest)
        if _spend_reserved(bucket_key):
            return Decision(True)
        try:
            allowed, wait_ms, taken = _redis()(
                keys=[bucket_key], args=[per_minute, _reservation_size(per_minute)])
            if taken > 1:
                _keep_reserved(bucket_key, int(taken) - 1)
            return _decision(bool(allowed), float(wait_ms))
        except redis.RedisError as exc:
            _redis_down_until = time.monotonic() + REDIS_RETRY_AFTER_FAILURE_SECONDS
            log.warning("rate limit counting in-process: redis unavailable",
                        extra={"scope": scope, "error": type(exc).__name__})
    return _take_local(f"{scope}:{digest}", per_minute)


_GIVE_BACK_LUA = """
local capacity = tonumber(ARGV[1])
local tokens = tonumber(redis.call('HGET', KEYS[1], 'tokens'))
if tokens then
  redis.call('HSET', KEYS[1], 'tokens', tostring(math.min(capacity, tokens + 1)))
end
return 1
"""
_give_back_script = None


def give_back_token(scope: str, key: str, *, per_minute: int) -> None:
    """Return the token a request took when it turned out not to be what the budget is for
    (a repeated or replayed delivery: those are charged to the sender's address instead)."""
    global _give_back_script
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    if settings.REDIS_URL and time.monotonic() >= _redis_down_until:
        try:
            _redis()
            if _give_back_script is None or _give_back_script.registered_client is not _redis_client:
                _give_back_script = _redis_client.register_script(_GIVE_BACK_LUA)
            _give_back_script(keys=[_redis_key(scope, digest)], args=[per_minute])
            return
        except redis.RedisError:
            pass  # nothing to give back to; the next take finds Redis down and counts locally
    with _local_lock:
        bucket_key = f"{scope}:{digest}"
        if bucket_key in _local_buckets:
            tokens, last_ms = _local_buckets[bucket_key]
            _local_buckets[bucket_key] = (min(float(per_minute), tokens + 1.0), last_ms)


# -- anonymous failures per client address (docs/security.md#anonymous-senders) -----------------
#
# Charged only after a failure, keyed by the client address so an unsigned flood never spends a
# signed sender's budget; an emptied address is remembered here until it refills, so its next
# requests are refused before any query.

_failing_lock = threading.Lock()
_failing_until: dict[str, float] = {}


def refuse_failing_client(scope: str, address: str) -> Decision:
    """Before the query: is ``address`` out of its ``scope`` failure budget (as this process
    last heard)? No Redis call, no charge."""
    key = f"{scope}:{address}"
    until = _failing_until.get(key)
    if until is None:
        return Decision(True)
    left = until - time.monotonic()
    if left <= 0:
        with _failing_lock:
            _failing_until.pop(key, None)
        return Decision(True)
    return Decision(False, max(1, math.ceil(left)))


def charge_client_failure(scope: str, address: str, *, per_minute: int) -> Decision:
    """After a failure: spend one of ``address``'s ``scope`` failures; a denial is remembered
    (see ``refuse_failing_client``)."""
    decision = take_token(scope, address, per_minute=per_minute)
    if not decision.allowed:
        with _failing_lock:
            _failing_until[f"{scope}:{address}"] = time.monotonic() + decision.retry_after_seconds
            while len(_failing_until) > MAX_LOCAL_BUCKETS:
                _failing_until.pop(next(iter(_failing_until)))
    return decision


# -- counters per time window (the delivery log's cap) ------------------------------------------

_COUNT_LUA = """
local n = redis.call('INCR', KEYS[1])
if n == 1 then redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1])) end
return n
"""
_count_script = None
_local_counts: dict[str, tuple[int, float]] = {}


def _count_key(scope: str, key: str) -> str:
    return _redis_key("count:" + scope, key)


def count_hit(scope: str, key: str, *, ttl_seconds: int) -> int:
    """Add one to ``key``'s counter in ``scope`` (kept ``ttl_seconds`` from its first hit) and
    return the new count: shared by every process through Redis, in-process without it or
    while it is down (then each process counts on its own: a cap may be passed by that factor)."""
    global _redis_down_until, _count_script
    if settings.REDIS_URL and time.monotonic() >= _redis_down_until:
        try:
            _redis()
            if _count_script is None or _count_script.registered_client is not _redis_client:
                _count_script = _redis_client.register_script(_COUNT_LUA)
            return int(_count_script(keys=[_count_key(scope, key)], args=[ttl_seconds]))
        except redis.RedisError as exc:
            _redis_down_until = time.monotonic() + REDIS_RETRY_AFTER_FAILURE_SECONDS
            log.warning("counting in-process: redis unavailable",
                        extra={"scope": scope, "error": type(exc).__name__})
    now = time.monotonic()
    local_key = f"{scope}:{key}"
    with _local_lock:
        count, expires = _local_counts.get(local_key, (0, now + ttl_seconds))
        if expires <= now:
            count, expires = 0, now + ttl_seconds
        _local_counts[local_key] = (count + 1, expires)
        for stale in [k for k, (_, e) in _local_counts.items() if e <= now][:100]:
            del _local_counts[stale]
    return count + 1


def read_counts(scope: str) -> dict[str, int]:
    """Every live counter of ``scope``: ``{key: count}`` (this process's own when counting
    in-process). For sweeps that fold counts into the database."""
    counts = {}
    prefix = f"{scope}:"
    now = time.monotonic()
    with _local_lock:
        for local_key, (count, expires) in _local_counts.items():
            if local_key.startswith(prefix) and expires > now:
                counts[local_key[len(prefix):]] = count
    if settings.REDIS_URL and time.monotonic() >= _redis_down_until:
        try:
            _redis()
            head = _count_key(scope, "")
            for name in _redis_client.scan_iter(match=head + "*", count=1000):
                value = _redis_client.get(name)
                if value is not None:
                    key = name.decode()[len(head):]
                    counts[key] = max(counts.get(key, 0), int(value))
        except redis.RedisError as exc:
            log.warning("reading counters: redis unavailable",
                        extra={"scope": scope, "error": type(exc).__name__})
    return counts
