"""A real daphne process serving switchboard.asgi on a free loopback port, for end-to-end tests
(browser, SSE, MCP clients). Generic: point it at any database by URL.

    with run_daphne(database_url=children_database_url(), log_path=tmp_path / "daphne.log") as server:
        httpx.get(server.url + "/healthz")

Tests that use it must commit their data (``transactional_db``): the server is another process.
``tests.processes.children_database_url()`` names the test database for it.
"""

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
READY_TIMEOUT_SECONDS = 30


@dataclass
class LiveServer:
    url: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def find_free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_healthy(url: str, process: subprocess.Popen, server: LiveServer):
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"daphne exited with {process.returncode}:\n{server.log()}")
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)  # poll interval while the process boots, bounded by the deadline
    raise RuntimeError(f"daphne not healthy within {READY_TIMEOUT_SECONDS} s:\n{server.log()}")


@contextmanager
def run_daphne(*, database_url: str, log_path: Path, settings_module="switchboard.settings_test",
               extra_env=None, port=None):
    """``port``: reuse a port (to restart a server under connected clients); default a free one."""
    port = port or find_free_port()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": settings_module,
        "DATABASE_URL": database_url,
        "PYTHONUNBUFFERED": "1",
        **(extra_env or {}),
    }
    log_file = open(log_path, "ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
         "switchboard.asgi:application"],
        cwd=BASE_DIR, env=env, stdout=log_file, stderr=subprocess.STDOUT,
    )
    server = LiveServer(url=f"http://127.0.0.1:{port}", process=process, log_path=log_path)
    try:
        _wait_until_healthy(server.url, process, server)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log_file.close()
