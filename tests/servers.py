"""A real daphne process on the test database, for end-to-end tests (reusable).

    @pytest.mark.django_db(transaction=True)
    def test_something(daphne_server):
        httpx.get(daphne_server.url + "/healthz")

* ``daphne_server`` (module-scoped) starts ``daphne switchboard.asgi:application`` on a free
  port of 127.0.0.1 and returns once ``GET /healthz`` answers 200 (polled with a deadline).
  ``.url`` is its base URL; ``.restart()`` stops it (SIGTERM) and starts it again on the same
  port — the way to show that state lives in the database, not in the process; ``.log_text()``
  returns what it printed so far (e.g. to assert no bearer was logged).
* The subprocess connects to the *test* database pytest-django created (its name is read from
  the live connection settings), the same Redis (``REDIS_URL``) and channel-layer prefix
  (``CHANNEL_PREFIX``) as the test process. It has its own connection, so it only sees
  committed rows: tests that use it must be ``@pytest.mark.django_db(transaction=True)``
  (rows are committed, and the tables are flushed after each test).
* Extra settings for the subprocess: ``DaphneServer(env={"SWITCHBOARD_...": "..."})``, or
  ``start_daphne(**env)`` inside a test for a function-scoped server.
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests import processes

REPO_ROOT = Path(__file__).resolve().parent.parent
# A deadline, not a wait: a server answers in a second or two on a quiet machine, but its
# imports alone took over 30 s while three test suites shared the two cores, and it was still
# not answering after 90 s at load 30.
READY_DEADLINE_SECONDS = 2 * processes.DEADLINE_SECONDS
STOP_DEADLINE_SECONDS = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# free_port() frees the port it found before daphne binds it, so another test process (xdist
# workers, other runs on the machine) may take it in between; a start that lost that race
# tries again on another port.
PORT_ATTEMPTS = 3


class DaphneServer:
    def __init__(self, *, env=None, port=None, tree=None):
        # ``tree``: serve another checkout of this repository (a benchmark's A/B), else this one.
        self.tree = tree or REPO_ROOT
        self._own_port = port is None
        self._use_port(port or free_port())
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "switchboard.settings",
            "DATABASE_URL": processes.children_database_url(),
            "SECRET_KEY": os.environ.get("SECRET_KEY", "test-secret-key-not-for-production"),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        from django.conf import settings

        if settings.REDIS_URL:
            self.env.setdefault("REDIS_URL", settings.REDIS_URL)
        self._log = tempfile.NamedTemporaryFile(prefix="daphne-", suffix=".log", delete=False)
        self.process = None

    def _use_port(self, port):
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self):
        for attempt in range(1, PORT_ATTEMPTS + 1):
            logged_before = len(self.log_text())
            self.process = subprocess.Popen(
                [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port),
                 "switchboard.asgi:application"],
                cwd=self.tree, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
            )
            try:
                self.wait_ready()
                return self
            except RuntimeError:
                lost_the_port = (self.process.poll() is not None and "Address already in use"
                                 in self.log_text()[logged_before:])
                if not (lost_the_port and self._own_port and attempt < PORT_ATTEMPTS):
                    # A server that never became ready is still ours to end: the fixture that
                    # started it fails before it could stop it, and it would outlive the run.
                    if self.process.poll() is None:
                        self.process.kill()
                        self.process.wait(timeout=10)
                    raise
                self._use_port(free_port())
        raise AssertionError("unreachable")

    def wait_ready(self):
        self.wait_ready_at(self.url, self.process, log=self.log_text)

    @staticmethod
    def wait_ready_at(url, process, *, log=lambda: ""):
        """Poll ``url``/healthz until it answers 200, with a deadline; fail early if
        ``process`` exits."""
        deadline = time.monotonic() + READY_DEADLINE_SECONDS
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}:\n{log()}")
            try:
                # A refused connection fails at once; a slow answer is still an answer.
                if httpx.get(url + "/healthz", timeout=10.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)  # poll interval, bounded by the deadline above
        raise RuntimeError(f"server not ready after {READY_DEADLINE_SECONDS}s:\n{log()}")

    def stop(self):
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_DEADLINE_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def restart(self):
        self.stop()
        return self.start()

    def log_text(self) -> str:
        return Path(self._log.name).read_text(errors="replace")


@pytest.fixture(scope="module")
def daphne_server(django_db_setup):
    server = DaphneServer().start()
    yield server
    server.stop()


@pytest.fixture
def start_daphne(django_db_setup):
    """Factory for a function-scoped server with extra environment: ``start_daphne(X="1")``."""
    servers = []

    def start(**env):
        server = DaphneServer(env=env).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


# The flush after a transactional test truncates every table in one statement, locking them in
# turn, while a server that outlives the test may still be finishing the test's last requests:
# a stream the client just closed is detached in a transaction that touches the attachment,
# then the session, the reverse of the flush's order, and PostgreSQL aborts one side as a
# deadlock (seen as a failed flush at teardown). Waiting until no other backend of the test
# database is inside a transaction lets that work end first. The product's lock order stays as
# it is: the dead-host sweep takes attachments before sessions too, and a detach in the
# flush's order could deadlock with it instead.
QUIET_POLLS = 3
QUIET_POLL_SECONDS = 0.02
QUIET_DEADLINE_SECONDS = 5.0


def wait_until_other_transactions_end() -> None:
    from django.db import connection

    if connection.vendor != "postgresql":
        return
    quiet, deadline = 0, time.monotonic() + QUIET_DEADLINE_SECONDS
    while quiet < QUIET_POLLS and time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                           " AND pid <> pg_backend_pid() AND xact_start IS NOT NULL")
            busy = cursor.fetchone()[0]
        quiet = 0 if busy else quiet + 1
        time.sleep(QUIET_POLL_SECONDS)  # poll interval, bounded by the deadline above


@pytest.fixture(autouse=True)
def servers_quiet_before_flush(request):
    uses_server = bool({"daphne_server", "start_daphne"} & set(request.fixturenames))
    if uses_server:
        # Set up first, so this fixture's teardown runs before the database helper's flush.
        request.getfixturevalue("_django_db_helper")
    yield
    if uses_server:
        wait_until_other_transactions_end()
