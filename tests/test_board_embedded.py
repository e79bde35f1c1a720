"""The board's live stream on the embedded default: `manage.py serve` on SQLite with the
in-memory channel layer, no Redis. A button pressed in the web process reaches an open stream
of the same process."""

import os
import re
import subprocess
import threading
import time

import httpx

from tests.processes import DEADLINE_SECONDS, PYTHON, ROOT
from tests.servers import free_port

WAIT_SECONDS = DEADLINE_SECONDS


def embedded_env(var_dir):
    env = {key: value for key, value in os.environ.items()
           if key not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "DJANGO_SETTINGS_MODULE")}
    env.update(SWITCHBOARD_VAR_DIR=str(var_dir), PYTHONUNBUFFERED="1")
    return env


SEED = """
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from endpoints import transitions as endpoint_transitions
from todos import transitions
owner = get_user_model().objects.create_user("root", password="pw-for-tests")
owner.user_permissions.add(*Permission.objects.filter(content_type__app_label="todos"))
endpoint, _ = endpoint_transitions.vend_endpoint(slug="demo", owner=owner)
todo, _ = transitions.create_todo(endpoint=endpoint, queue="inbox", title="embedded", actor="t",
                                  trust="signed")
print("TODO", todo.pk)
"""


def csrf_token(html):
    return re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html).group(1)


def test_embedded_board_stream_carries_a_button_press(tmp_path):
    env = embedded_env(tmp_path / "var")
    subprocess.run([PYTHON, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True, timeout=120)
    seeded = subprocess.run([PYTHON, "manage.py", "shell", "-c", SEED], cwd=ROOT, env=env,
                            check=True, timeout=120, capture_output=True, text=True)
    todo_id = re.search(r"TODO (\d+)", seeded.stdout).group(1)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "wb")
    server = subprocess.Popen([PYTHON, "manage.py", "serve", "--port", str(port)], cwd=ROOT, env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        client = httpx.Client(base_url=base, timeout=WAIT_SECONDS)
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            try:
                if client.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and server.poll() is None, (tmp_path / "serve.log").read_text()
            time.sleep(0.1)  # the server is booting: poll, bounded by the deadline

        login = client.get("/accounts/login/")
        client.post("/accounts/login/", data={
            "username": "root", "password": "pw-for-tests", "next": "/todos/",
            "csrfmiddlewaretoken": csrf_token(login.text)})
        board = client.get("/todos/")
        assert f'id="todo-{todo_id}"' in board.text

        lines, synced, done = [], threading.Event(), threading.Event()

        def listen():
            with client.stream("GET", "/todos/events") as stream:
                for line in stream.iter_lines():
                    lines.append(line)
                    if line.startswith("event: sync"):
                        synced.set()
                    if line.startswith("data: ") and '"action":"claim"' in line:
                        done.set()
                        return

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        assert synced.wait(WAIT_SECONDS)
        response = httpx.post(f"{base}/todos/{todo_id}/claim", cookies=client.cookies,
                              timeout=WAIT_SECONDS,
                              data={"csrfmiddlewaretoken": csrf_token(board.text), "next": "/todos/"})
        assert response.status_code == 302
        assert done.wait(WAIT_SECONDS), lines
        assert any(line.startswith("id: ") for line in lines)
    finally:
        server.terminate()
        server.wait(timeout=WAIT_SECONDS)
        log.close()
