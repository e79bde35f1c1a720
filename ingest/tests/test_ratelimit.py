"""The shared fixed-window limiter: counted in Redis across processes, in-process without it."""

import subprocess
import sys
from pathlib import Path

import pytest
from django.test import override_settings

from switchboard import ratelimit

REPO = Path(__file__).resolve().parents[2]


def test_limit_counts_within_a_window_and_resets_in_the_next():
    now = 1_000_000 * 60 + 10.0
    verdicts = [ratelimit.hit("t:a", limit_per_minute=2, now=now) for _ in range(3)]
    assert [v.allowed for v in verdicts] == [True, True, False]
    assert verdicts[-1].retry_after_seconds == 50
    assert ratelimit.hit("t:a", limit_per_minute=2, now=now + 60).allowed


def test_a_second_process_shares_the_count_through_redis(settings):
    if not settings.REDIS_URL:
        pytest.skip("needs REDIS_URL")
    now = 2_000_000 * 60 + 1.0
    assert ratelimit.hit("t:shared", limit_per_minute=2, now=now).allowed
    child = subprocess.run(
        [sys.executable, "-c",
         "import django; django.setup(); from switchboard import ratelimit; "
         f"print(ratelimit.hit('t:shared', limit_per_minute=2, now={now}).allowed)"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**__import__("os").environ, "DJANGO_SETTINGS_MODULE": "switchboard.settings_test"},
    )
    assert child.stdout.strip() == "True", child.stderr[-2000:]
    assert not ratelimit.hit("t:shared", limit_per_minute=2, now=now).allowed


@override_settings(REDIS_URL="redis://127.0.0.1:6390/0")
def test_redis_down_fails_open_to_an_in_process_count(caplog):
    now = 3_000_000 * 60 + 1.0
    verdicts = [ratelimit.hit("t:down", limit_per_minute=2, now=now) for _ in range(3)]
    assert [v.allowed for v in verdicts] == [True, True, False]
    # One failed Redis call, then the breaker keeps later requests off Redis entirely.
    assert sum("redis unavailable" in r.getMessage() for r in caplog.records) == 1


@override_settings(REDIS_URL="")
def test_without_redis_counts_in_process():
    now = 4_000_000 * 60 + 1.0
    assert [ratelimit.hit("t:local", limit_per_minute=1, now=now).allowed for _ in range(2)] == [
        True, False]
