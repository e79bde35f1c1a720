"""scripts/test-services.sh: the test command needs no running services (issue 16.4).

Probed with fake default ports (free ports nothing listens on) so that the machine's shared
PostgreSQL and Redis, which other test runs use, are never stopped or even touched."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from tests.processes import ROOT
from tests.servers import free_port

HELPER = ROOT / "scripts" / "test-services.sh"


def run_helper(then: str, **env) -> subprocess.CompletedProcess:
    """Source the helper in a strict bash (as scripts/test does), start the services, then
    run ``then``; the script exits afterwards, which must clean up."""
    base = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    script = f"set -euo pipefail\nsource {HELPER}\nstart_test_services\n{then}\n"
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env={**base, **env},
                          capture_output=True, text=True, timeout=180)


def nothing_listens() -> dict:
    return {"SB_TEST_PG_PORT": str(free_port()), "SB_TEST_REDIS_PORT": str(free_port())}


def answers(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_without_services_it_starts_private_ones_and_removes_them_at_exit():
    done = run_helper('echo "$DATABASE_URL"; echo "$REDIS_URL"; echo "$SB_SERVICES_DIR"\n'
                      f'{sys.executable} -c "import psycopg, os, redis; '
                      "psycopg.connect(os.environ['DATABASE_URL'].rsplit('/', 1)[0] + '/postgres')"
                      ".execute('SELECT 1'); redis.Redis.from_url(os.environ['REDIS_URL']).ping(); "
                      "print('both answer')\"", **nothing_listens())
    assert done.returncode == 0, done.stderr
    database_url, redis_url, services_dir, verdict = done.stdout.splitlines()
    assert verdict == "both answer"
    assert database_url.startswith("postgres://postgres@127.0.0.1:") and redis_url.startswith(
        "redis://127.0.0.1:")
    assert "private PostgreSQL" in done.stderr and "private Redis" in done.stderr
    # Gone once the script exited: the cluster, the Redis and their directory.
    pg_port = int(database_url.rsplit(":", 1)[1].split("/")[0])
    redis_port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    assert not answers(pg_port) and not answers(redis_port)
    assert not Path(services_dir).exists()


def test_answering_default_ports_are_used_and_nothing_is_started():
    from django.conf import settings

    shared = settings.DATABASES["default"]
    if "postgresql" not in shared["ENGINE"] or not settings.REDIS_URL:
        pytest.skip("needs the PostgreSQL + Redis run (services answering on known ports)")
    redis_port = redis.Redis.from_url(settings.REDIS_URL).connection_pool.connection_kwargs["port"]
    done = run_helper('echo "$DATABASE_URL $REDIS_URL [${SB_SERVICES_DIR}]"',
                      SB_TEST_PG_PORT=str(shared.get("PORT") or 5432),
                      SB_TEST_REDIS_PORT=str(redis_port))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        f"postgres://postgres@127.0.0.1:{shared.get('PORT') or 5432}/switchboard",
        f"redis://127.0.0.1:{redis_port}/0", "[]"]
    assert "private" not in done.stderr


def test_set_urls_are_used_as_they_are():
    done = run_helper('echo "$DATABASE_URL $REDIS_URL [${SB_SERVICES_DIR}]"', **nothing_listens(),
                      DATABASE_URL="postgres://elsewhere/db", REDIS_URL="redis://elsewhere/1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["postgres://elsewhere/db", "redis://elsewhere/1", "[]"]


def test_missing_binaries_are_named_with_what_to_install(tmp_path):
    temp = Path(os.environ.get("TMPDIR", "/tmp"))
    before = set(temp.glob("sb-test-services-*"))
    done = run_helper('echo "should not get here"', **nothing_listens(),
                      SB_TEST_PG_BINDIR=str(tmp_path / "no-postgres"),
                      SB_TEST_REDIS_SERVER=str(tmp_path / "no-redis-server"))
    assert done.returncode != 0 and "should not get here" not in done.stdout
    assert "apt-get install postgresql" in done.stderr
    assert "apt-get install redis-server" in done.stderr
    assert set(temp.glob("sb-test-services-*")) <= before  # nothing was started
