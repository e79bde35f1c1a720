"""The shared rate limiter: token buckets in Redis across processes, in-process without it or
while Redis is down."""

import os
import subprocess
import sys
import time
import uuid

from django.test import override_settings

from switchboard import ratelimit as rate_limits
from tests.processes import ROOT


def test_refill_bucket_spends_and_refills():
    allowed, tokens, wait = rate_limits.refill_bucket(1.0, 0, 0, per_minute=60)
    assert allowed and tokens == 0.0 and wait == 0.0
    allowed, tokens, wait = rate_limits.refill_bucket(0.0, 0, 500, per_minute=60)
    assert not allowed and wait == 500.0  # half a token back after 0.5 s at 1/s
    allowed, _, _ = rate_limits.refill_bucket(0.0, 0, 1000, per_minute=60)
    assert allowed


def test_redis_bucket_is_shared_and_says_when_to_retry(settings):
    assert settings.REDIS_URL  # the test environment runs Redis
    key = uuid.uuid4().hex
    decisions = [rate_limits.take_token("test", key, per_minute=2) for _ in range(3)]
    assert [d.allowed for d in decisions] == [True, True, False]
    assert 1 <= decisions[2].retry_after_seconds <= 30
    assert rate_limits.take_token("test", uuid.uuid4().hex, per_minute=2).allowed


def test_in_process_bucket_without_redis(settings):
    settings.REDIS_URL = ""
    rate_limits.reset_local_state()
    key = uuid.uuid4().hex
    assert [rate_limits.take_token("test", key, per_minute=1).allowed for _ in range(2)] == [
        True, False]


def test_a_second_process_shares_the_bucket_through_redis(settings):
    assert settings.REDIS_URL
    key = uuid.uuid4().hex
    assert rate_limits.take_token("test", key, per_minute=2).allowed
    child = subprocess.run(
        [sys.executable, "-c",
         "import django; django.setup(); from switchboard import ratelimit; "
         f"print(ratelimit.take_token('test', '{key}', per_minute=2).allowed)"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "switchboard.settings_test"},
    )
    assert child.stdout.strip() == "True", child.stderr[-2000:]
    assert not rate_limits.take_token("test", key, per_minute=2).allowed


@override_settings(REDIS_URL="redis://127.0.0.1:6390/0")  # nothing listens there
def test_redis_down_falls_back_to_in_process_buckets_with_one_log_line(caplog):
    rate_limits.reset_local_state()
    rate_limits._redis_client = None  # connect to the dead URL
    try:
        key = uuid.uuid4().hex
        decisions = [rate_limits.take_token("test", key, per_minute=2) for _ in range(3)]
        assert [d.allowed for d in decisions] == [True, True, False]
        # One failed Redis call, then the breaker keeps later requests off Redis entirely.
        assert sum("redis unavailable" in r.getMessage() for r in caplog.records) == 1
    finally:
        rate_limits.reset_local_state()
        rate_limits._redis_client = None


def test_a_client_out_of_failures_is_refused_before_any_query_until_its_bucket_refills(settings):
    address = f"198.51.100.{uuid.uuid4().int % 250}"
    assert rate_limits.refuse_failing_client("test-auth", address).allowed  # nothing spent yet
    assert [rate_limits.charge_client_failure("test-auth", address, per_minute=2).allowed
            for _ in range(3)] == [True, True, False]
    refused = rate_limits.refuse_failing_client("test-auth", address)
    assert not refused.allowed and 1 <= refused.retry_after_seconds <= 30
    assert rate_limits.refuse_failing_client("test-auth", "203.0.113.1").allowed  # per address
    assert rate_limits.refuse_failing_client("other-scope", address).allowed  # per scope


def test_window_counters_are_shared_through_redis_and_readable_for_a_sweep(settings):
    assert settings.REDIS_URL
    key = uuid.uuid4().hex
    assert [rate_limits.count_hit("test-count", key, ttl_seconds=60) for _ in range(3)] == [1, 2, 3]
    assert rate_limits.read_counts("test-count")[key] == 3


def test_window_counters_count_in_process_without_redis(settings):
    settings.REDIS_URL = ""
    rate_limits.reset_local_state()
    key = uuid.uuid4().hex
    assert [rate_limits.count_hit("test-count", key, ttl_seconds=60) for _ in range(2)] == [1, 2]
    assert rate_limits.read_counts("test-count") == {key: 2}


def test_a_busy_key_takes_its_tokens_from_redis_a_batch_at_a_time(settings, monkeypatch):
    """6000/min reserves 10 tokens a round trip: 25 requests cost 3 Redis calls, and the shared
    bucket is charged for every token handed out (none minted locally)."""
    assert settings.REDIS_URL
    rate_limits.reset_local_state()
    script = rate_limits._redis()
    calls = []
    monkeypatch.setattr(rate_limits, "_redis", lambda: (
        lambda **kwargs: (calls.append(kwargs), script(**kwargs))[1]))
    key = uuid.uuid4().hex
    started = time.monotonic()
    assert all(rate_limits.take_token("test", key, per_minute=6000).allowed for _ in range(25))
    assert len(calls) == 3
    digest = __import__("hashlib").sha256(key.encode()).hexdigest()[:32]
    tokens = float(script.registered_client.hget(rate_limits._redis_key("test", digest), "tokens"))
    # 3 batches of 10 taken, plus what 6000/min refilled meanwhile (however slow the machine).
    refilled = (time.monotonic() - started) * 6000 / 60
    assert 6000 - 30 <= tokens <= 6000 - 30 + refilled + 0.5


def test_a_batch_never_takes_more_than_the_bucket_holds(settings):
    assert settings.REDIS_URL
    script = rate_limits._redis()
    key = rate_limits._redis_key("test", uuid.uuid4().hex)
    allowed, _, taken = script(keys=[key], args=[3, 10])
    assert allowed == 1 and taken == 3  # a bucket of 3: all 3, not 10
    allowed, wait_ms, taken = script(keys=[key], args=[3, 10])
    assert allowed == 0 and taken == 0 and wait_ms > 0
