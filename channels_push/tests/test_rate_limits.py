import uuid

from channels_push import rate_limits


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
    rate_limits.reset_local_buckets()
    key = uuid.uuid4().hex
    assert [rate_limits.take_token("test", key, per_minute=1).allowed for _ in range(2)] == [
        True, False]
