"""scripts/test-services.sh: the test command needs no running services, and by default uses
none of the machine's own: private PostgreSQL and Redis, started and removed by the run.

Probed with fake default ports (free ports nothing listens on) so that the machine's shared
PostgreSQL and Redis, which other test runs use, are never stopped or even touched."""

import os
import shutil
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


def shared_ports() -> tuple[int, int]:
    """The ports of the services this test run itself uses (the machine's own, here)."""
    from django.conf import settings

    shared = settings.DATABASES["default"]
    if "postgresql" not in shared["ENGINE"] or not settings.REDIS_URL:
        pytest.skip("needs the PostgreSQL + Redis run (services answering on known ports)")
    redis_port = redis.Redis.from_url(settings.REDIS_URL).connection_pool.connection_kwargs["port"]
    return int(shared.get("PORT") or 5432), int(redis_port)


def test_by_default_answering_ports_are_left_alone_and_private_services_start():
    """Someone's own PostgreSQL and Redis on the default ports are theirs: a test run neither
    uses nor touches them unless asked to."""
    pg_port, redis_port = shared_ports()
    done = run_helper('echo "$DATABASE_URL $REDIS_URL"', SB_TEST_PG_PORT=str(pg_port),
                      SB_TEST_REDIS_PORT=str(redis_port))
    assert done.returncode == 0, done.stderr
    database_url, redis_url = done.stdout.split()
    assert f":{pg_port}/" not in database_url and f":{redis_port}/" not in redis_url
    assert "private PostgreSQL" in done.stderr and "private Redis" in done.stderr


def test_asked_for_the_machines_services_answering_default_ports_are_used_and_nothing_starts():
    pg_port, redis_port = shared_ports()
    done = run_helper('echo "$DATABASE_URL $REDIS_URL [${SB_SERVICES_DIR}]"',
                      SB_TEST_SERVICES="machine", SB_TEST_PG_PORT=str(pg_port),
                      SB_TEST_REDIS_PORT=str(redis_port))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        f"postgres://postgres@127.0.0.1:{pg_port}/switchboard",
        f"redis://127.0.0.1:{redis_port}/0", "[]"]
    assert "private" not in done.stderr


def test_asked_for_the_machines_services_where_none_answer_it_says_so_and_starts_nothing():
    temp = Path(os.environ.get("TMPDIR", "/tmp"))
    before = set(temp.glob("sb-test-services-*"))
    done = run_helper('echo "should not get here"', SB_TEST_SERVICES="machine",
                      **nothing_listens())
    assert done.returncode != 0 and "should not get here" not in done.stdout
    assert "--machine-services" in done.stderr and "nothing answers" in done.stderr
    assert "private PostgreSQL" not in done.stderr and "private Redis" not in done.stderr
    assert set(temp.glob("sb-test-services-*")) <= before  # nothing was started


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


# -- scripts/test-packages.sh: system packages, each named before it is installed -------------

PACKAGES = ROOT / "scripts" / "test-packages.sh"


def run_packages(tmp_path, **env) -> subprocess.CompletedProcess:
    """The package step as root on a machine with apt-get and none of the tools: stub ``id``
    and ``apt-get`` (which only says what it was asked) are all there is on PATH."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "id").write_text("#!/bin/sh\necho 0\n")
    (stubs / "apt-get").write_text('#!/bin/sh\necho "APT-GET $*" >&2\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    script = f"set -euo pipefail\nsource {PACKAGES}\ninstall_missing_system_packages\n"
    return subprocess.run(["/bin/bash", "-c", script], env={"PATH": str(stubs), **env},
                          capture_output=True, text=True, timeout=60)


def test_each_system_package_is_named_before_it_is_installed(tmp_path):
    done = run_packages(tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    installs = [line for line in lines if line.startswith("APT-GET install")]
    assert installs, done.stderr
    for install in installs:
        package = install.split()[-1]
        named = next(n for n, line in enumerate(lines)
                     if line.startswith(f"scripts/test: installing the system package {package} "))
        assert named < lines.index(install), done.stderr
    assert {line.split()[-1] for line in installs} >= {"chromium", "nodejs", "npm"}
    assert sum(line.startswith("APT-GET update") for line in lines) == 1


def test_without_consent_no_system_package_is_installed_and_the_missing_are_named(tmp_path):
    done = run_packages(tmp_path, SB_TEST_SYSTEM_PACKAGES="no")
    assert done.returncode == 0, done.stderr
    assert "APT-GET" not in done.stderr
    assert "not installing" in done.stderr and "* chromium, for the browser tests" in done.stderr


# -- scripts/test --help ----------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_the_test_command_prints_its_usage_and_installs_nothing(tmp_path, flag):
    """``bash scripts/test --help`` says what the command takes and exits 0 before any step:
    run from a copy of scripts/ with no .venv, where every installer on PATH is a stub that
    leaves a mark (it made a virtualenv, that is, tried to, before)."""
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    stubs, marks = tmp_path / "bin", tmp_path / "installed"
    stubs.mkdir()
    for name in ("python3", "pip", "apt-get", "npm", "initdb", "redis-server"):
        (stubs / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {marks}\nexit 1\n')
        (stubs / name).chmod(0o755)
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "test"), flag],
                          env={"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not marks.exists(), marks.read_text()
    assert not (tmp_path / ".venv").exists()
    usage = done.stdout
    for said in ("--machine-services", "--no-system-packages", "--help",
                 "PostgreSQL part's pytest", "DATABASE_URL", "REDIS_URL", "SB_TEST_SERVICES",
                 "SB_TEST_SYSTEM_PACKAGES", "SB_TEST_WORKERS"):
        assert said in usage, usage
