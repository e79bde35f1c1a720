"""Production posture with an https public URL (CONTRACT §12, issue 15 item 8): Secure
cookies, HSTS, the proxy's SSL header, a Content-Security-Policy, and ``check --deploy``
clean. Each runs in a subprocess with production-like settings (DEBUG off, the real settings
module, a real secret key), because these settings are derived once at start-up."""

import json
import os
import secrets
import subprocess

import pytest
from cryptography.fernet import Fernet

from tests.processes import PYTHON, ROOT

PUBLIC_HOST = "switchboard.example.org"


def production_env(tmp_path, **overrides) -> dict:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("SWITCHBOARD_", "DJANGO_", "OIDC_"))}
    env.pop("DEBUG", None)
    env.pop("DATABASE_URL", None)  # SQLite in a scratch dir: these checks need no data
    env.update(
        DJANGO_SETTINGS_MODULE="switchboard.settings",
        SWITCHBOARD_VAR_DIR=str(tmp_path),
        SECRET_KEY=secrets.token_urlsafe(50),
        SWITCHBOARD_SECRETS_KEY=Fernet.generate_key().decode(),
        SWITCHBOARD_METRICS_TOKEN=secrets.token_urlsafe(32),
        SWITCHBOARD_PUBLIC_URL=f"https://{PUBLIC_HOST}",
        ALLOWED_HOSTS=PUBLIC_HOST,
    )
    env.update(overrides)
    return env


def run(env, *args, code=None):
    command = [PYTHON, *args] if code is None else [PYTHON, "-c", code]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_check_deploy_is_clean_with_an_https_public_url(tmp_path):
    result = run(production_env(tmp_path), "manage.py", "check", "--deploy", "--fail-level", "WARNING")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout


RESPONSE_PROBE = """
import json, django
django.setup()
from django.test import Client
client = Client(HTTP_X_FORWARDED_PROTO="https", HTTP_HOST="%s")
answers = {}
for path in ("/accounts/login/", "/healthz", "/todos/"):
    response = client.get(path)
    answers[path] = {
        "status": response.status_code,
        "headers": dict(response.headers),
        "cookies": {name: {"secure": bool(morsel["secure"]), "httponly": bool(morsel["httponly"])}
                    for name, morsel in response.cookies.items()},
    }
plain = Client(HTTP_HOST="%s").get("/accounts/login/")
answers["plain http"] = {"status": plain.status_code, "location": plain.headers.get("Location")}
print(json.dumps(answers))
""" % (PUBLIC_HOST, PUBLIC_HOST)


def test_responses_carry_hsts_csp_and_secure_cookies_with_an_https_public_url(tmp_path):
    result = run(production_env(tmp_path), code=RESPONSE_PROBE)
    assert result.returncode == 0, result.stderr
    answers = json.loads(result.stdout.strip().splitlines()[-1])
    login = answers["/accounts/login/"]
    assert login["status"] == 200
    assert login["headers"]["Strict-Transport-Security"].startswith("max-age=")
    assert int(login["headers"]["Strict-Transport-Security"].split("=")[1].split(";")[0]) >= 31536000
    policy = login["headers"]["Content-Security-Policy"]
    assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert "unsafe-inline" not in policy
    assert login["cookies"]["csrftoken"]["secure"]
    # A request the proxy marks as plain http is sent to https (the proxy's SSL header is trusted).
    assert answers["plain http"]["status"] == 301
    assert answers["plain http"]["location"] == f"https://{PUBLIC_HOST}/accounts/login/"
    # Health probes are not redirected.
    assert answers["/healthz"]["status"] == 200


def test_session_cookie_is_secure_with_an_https_public_url(tmp_path):
    code = ("import django; django.setup(); from django.conf import settings; "
            "print(settings.SESSION_COOKIE_SECURE, settings.CSRF_COOKIE_SECURE, "
            "settings.SECURE_PROXY_SSL_HEADER)")
    result = run(production_env(tmp_path), code=code)
    assert result.stdout.split() == ["True", "True", "('HTTP_X_FORWARDED_PROTO',", "'https')"], result.stderr
    plain = run(production_env(tmp_path, SWITCHBOARD_PUBLIC_URL="http://127.0.0.1:8000",
                               ALLOWED_HOSTS="127.0.0.1"), code=code)
    assert plain.stdout.split() == ["False", "False", "None"], plain.stderr


def test_the_board_pages_have_no_inline_script_or_style():
    """The CSP has no 'unsafe-inline': every script and style must come from a file."""
    for template in (ROOT / "templates").rglob("*.html"):
        text = template.read_text()
        assert "<style" not in text, template
        assert " style=" not in text, template
        for chunk in text.split("<script")[1:]:
            assert chunk.split(">")[0].count("src=") == 1, template
