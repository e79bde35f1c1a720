"""The embedded default: `manage.py serve` from an empty directory, no PostgreSQL or Redis."""

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request

from tests.processes import DEADLINE_SECONDS, PYTHON, ROOT


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_json(url, deadline_seconds=DEADLINE_SECONDS):
    deadline = time.monotonic() + deadline_seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status, json.loads(response.read())
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} never answered")


def embedded_env(var_dir):
    env = {key: value for key, value in os.environ.items()
           if key not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "DJANGO_SETTINGS_MODULE")}
    env.update(SWITCHBOARD_VAR_DIR=str(var_dir), PYTHONUNBUFFERED="1")
    return env


def test_serve_starts_from_an_empty_directory_and_runs_the_sweeps(tmp_path):
    # A fresh copy of the project with no var/ directory: serve must create everything.
    project = tmp_path / "project"
    shutil.copytree(ROOT, project, ignore=shutil.ignore_patterns(".venv", "var", ".git", "node_modules",
                                                                 "__pycache__", ".pytest_cache"))
    var_dir = project / "var"
    assert not var_dir.exists()
    port = free_port()
    server = subprocess.Popen(
        [PYTHON, "manage.py", "serve", "--port", str(port)], cwd=project,
        env=embedded_env(var_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        status, body = wait_for_json(f"http://127.0.0.1:{port}/healthz")
        assert status == 200 and body == {"status": "ok"}
        status, body = wait_for_json(f"http://127.0.0.1:{port}/readyz")
        assert status == 200 and body["checks"] == {"database": "ok"}
        assert (var_dir / "switchboard.sqlite3").exists()
        # The admin's static files are served by the same process (no collectstatic step).
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/static/admin/css/base.css") as css:
            assert css.status == 200 and b"{" in css.read()
        assert (var_dir / "secret_key").exists()

        # The in-process reaper returns a lapsed lease without Celery: claim with a 1 s lease
        # through a second process on the same SQLite file, then wait for the sweep.
        script = (
            "import django; django.setup()\n"
            "from django.contrib.auth.models import User\n"
            "from endpoints import transitions as e\n"
            "from todos import transitions as t\n"
            "u = User.objects.create(username='op')\n"
            "ep, _ = e.vend_endpoint(slug='agent', owner=u)\n"
            "todo, _ = t.create_todo(endpoint=ep, queue='inbox', title='x', actor='test')\n"
            "t.claim_todo(t.Caller.agent(ep, 's'), todo.pk, lease_ttl_seconds=1)\n"
            "print(todo.pk)\n"
        )
        env = embedded_env(var_dir) | {"DJANGO_SETTINGS_MODULE": "switchboard.settings"}
        todo_id = subprocess.run([PYTHON, "-c", script], cwd=project, env=env, check=True,
                                 capture_output=True, text=True).stdout.strip()
        check = (
            "import django; django.setup()\n"
            f"from todos.models import Todo; print(Todo.objects.get(pk={todo_id}).state)\n"
        )
        # Each look is a Python process of its own: slow to start on a loaded machine.
        deadline = time.monotonic() + DEADLINE_SECONDS
        state = "claimed"
        while state != "pending" and time.monotonic() < deadline:
            time.sleep(0.5)
            state = subprocess.run([PYTHON, "-c", check], cwd=project, env=env, check=True,
                                   capture_output=True, text=True).stdout.strip()
        assert state == "pending", "the embedded reaper never returned the lapsed lease"
    finally:
        server.send_signal(signal.SIGINT)
        try:
            output, _ = server.communicate(timeout=DEADLINE_SECONDS)
        except subprocess.TimeoutExpired:
            server.kill()
            output, _ = server.communicate()
    assert f"http://127.0.0.1:{port}/todos/" in output
    assert f"http://127.0.0.1:{port}/admin/" in output


def test_no_missing_migrations():
    result = subprocess.run(
        [PYTHON, "manage.py", "makemigrations", "--check", "--dry-run"], cwd=ROOT,
        env=dict(os.environ, DJANGO_SETTINGS_MODULE="switchboard.settings_test"),
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_embedded_database_and_secret_key_are_private_files(tmp_path):
    """SQLite's database, its WAL and shared-memory files, and the generated secret key are
    readable by their owner only (0600), even under a permissive umask; a database left 0644
    by an older version is tightened at start."""
    var_dir = tmp_path / "var"
    script = (
        "import os, stat, django; django.setup()\n"
        "from django.db import connection\n"
        "with connection.cursor() as cursor:\n"
        "    cursor.execute('CREATE TABLE IF NOT EXISTS probe (x int)')\n"
        "    cursor.execute('INSERT INTO probe VALUES (1)')\n"
        "    d = os.environ['SWITCHBOARD_VAR_DIR']\n"
        "    for name in ('switchboard.sqlite3', 'switchboard.sqlite3-wal',\n"
        "                 'switchboard.sqlite3-shm', 'secret_key'):\n"
        "        print(name, oct(stat.S_IMODE(os.stat(os.path.join(d, name)).st_mode)))\n"
    )

    def modes():
        done = subprocess.run([PYTHON, "-c", "import os; os.umask(0o022); exec(os.environ['S'])"],
                              cwd=ROOT, env={**embedded_env(var_dir), "S": script,
                                             "DJANGO_SETTINGS_MODULE": "switchboard.settings"},
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return dict(line.split() for line in done.stdout.splitlines())

    assert set(modes().values()) == {"0o600"}
    for name in ("switchboard.sqlite3", "switchboard.sqlite3-wal", "switchboard.sqlite3-shm"):
        if (var_dir / name).exists():
            os.chmod(var_dir / name, 0o644)
    assert set(modes().values()) == {"0o600"}
