"""Quiet and tidy: no axes banner per manage.py call, a favicon, the admin's title, a styled
sign-in page with a first-run hint, and a warning when printed URLs rest on an unset
SWITCHBOARD_PUBLIC_URL that nothing answers at."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import Client, override_settings

from switchboard import commands
from tests.cli import run_manage
from console.tests.test_views import asgi_get
from tests.factories import UserFactory

ROOT = Path(__file__).resolve().parent.parent


def test_manage_py_prints_no_axes_banner():
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "switchboard.settings_test"}
    done = subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "AXES" not in done.stdout + done.stderr


def test_the_favicon_is_served_and_linked(db):
    icon = Client().get("/favicon.ico")
    assert icon.status_code == 302 and icon["Location"] == "/static/console/favicon.svg"
    served = asgi_get("/static/console/favicon.svg")
    assert served["status"] == 200 and served["body"].startswith(b"<svg")
    assert (b"content-type", b"image/svg+xml") in [(k.lower(), v) for k, v in served["headers"]]
    login = Client().get("/accounts/login/").content.decode()
    assert '<link rel="icon" href="/static/console/favicon.svg"' in login


def test_the_admin_is_titled_switchboard_admin(db):
    staff = Client()
    staff.force_login(UserFactory(username="root", is_staff=True, is_superuser=True))
    page = staff.get("/admin/").content.decode()
    assert "<title>switchboard | switchboard admin</title>" in page
    assert "switchboard admin</a>" in page


def test_the_sign_in_page_is_styled_and_says_how_to_get_a_first_operator(db):
    page = Client().get("/accounts/login/").content.decode()
    assert '<body class="console">' in page and 'href="/static/console/console.css"' in page
    assert 'class="login-box"' in page
    hint = page.split('id="first-run"', 1)[1]
    assert "manage.py createsuperuser" in hint and "manage.py seed_demo" in hint
    style = asgi_get("/static/console/console.css")
    assert style["status"] == 200 and b"prefers-color-scheme: dark" in style["body"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.django_db
def test_commands_that_print_urls_warn_when_the_public_url_is_unset_and_nothing_answers(
        capsys, monkeypatch):
    monkeypatch.delenv("SWITCHBOARD_PUBLIC_URL", raising=False)
    UserFactory(username="alice")
    url = f"http://127.0.0.1:{free_port()}"
    with override_settings(SWITCHBOARD_PUBLIC_URL=url):
        run = run_manage(capsys, "vend_endpoint", "drifty", "--owner", "alice", "--json")
    assert run.code == 0
    assert run.json()["mcp_url"] == f"{url}/mcp/drifty"  # stdout stays one JSON object
    assert "SWITCHBOARD_PUBLIC_URL is unset" in run.err and url in run.err


@pytest.mark.django_db
def test_no_warning_when_something_answers_at_the_default_or_the_url_is_set(capsys, monkeypatch):
    monkeypatch.delenv("SWITCHBOARD_PUBLIC_URL", raising=False)
    UserFactory(username="alice")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        with override_settings(SWITCHBOARD_PUBLIC_URL=url):
            run = run_manage(capsys, "vend_endpoint", "served", "--owner", "alice", "--json")
    assert run.code == 0 and "SWITCHBOARD_PUBLIC_URL" not in run.err
    nothing_there = f"http://127.0.0.1:{free_port()}"
    assert commands.public_url_drift_warning({"SWITCHBOARD_PUBLIC_URL": nothing_there}) == ""


@pytest.mark.django_db
def test_commands_that_print_no_url_never_probe(capsys, monkeypatch):
    monkeypatch.delenv("SWITCHBOARD_PUBLIC_URL", raising=False)
    probed = []
    monkeypatch.setattr(commands, "_answers", lambda url: probed.append(url) or False)
    UserFactory(username="alice")
    run_manage(capsys, "vend_endpoint", "quiet", "--owner", "alice", "--json")
    assert probed  # vend prints its MCP URL
    probed.clear()
    run = run_manage(capsys, "pause", "quiet", "--json")
    assert run.code == 0, run.err
    assert probed == []
