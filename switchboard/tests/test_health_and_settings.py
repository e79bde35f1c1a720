import os
import subprocess

import pytest
from django.test import override_settings

from tests.processes import PYTHON, ROOT


@pytest.mark.django_db
def test_healthz_and_readyz_answer_json(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ok", "checks": {"database": "ok", "redis": "ok"}}


@pytest.mark.django_db
@override_settings(REDIS_URL="redis://127.0.0.1:6390/0")  # nothing listens there
def test_readyz_is_503_when_redis_is_unreachable(client):
    ready = client.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["checks"]["redis"].startswith("error")
    assert ready.json()["checks"]["database"] == "ok"


@pytest.mark.parametrize(
    "variable, value",
    [
        ("SWITCHBOARD_DEFAULT_LEASE_SECONDS", "five minutes"),
        ("SWITCHBOARD_DEFAULT_LEASE_SECONDS", "0"),
        ("SWITCHBOARD_MAX_BODY_BYTES", "-1"),
        ("DATABASE_URL", "nosuchdb://x"),
        ("REDIS_URL", "http://127.0.0.1:6379"),
        ("SWITCHBOARD_ALLOWED_ORIGINS", "http://evil\\@127.0.0.1"),
        ("SWITCHBOARD_PUBLIC_URL", "ftp://example.org"),
        ("SWITCHBOARD_SIGNIN_FAILURE_LIMIT", "0"),
    ],
)
def test_a_bad_setting_fails_at_start_naming_the_variable(variable, value):
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="switchboard.settings", **{variable: value})
    result = subprocess.run([PYTHON, "-c", "import django; django.setup()"], cwd=ROOT, env=env,
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert variable in result.stderr


def test_pooled_connections_are_checked_before_use():
    """Regression (system suite, PostgreSQL restart): with the psycopg pool, Django only checks
    a pooled connection when CONN_HEALTH_CHECKS is on; off, every connection left dead by a
    database restart failed one request."""
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="switchboard.settings",
               DATABASE_URL="postgres://postgres@127.0.0.1:5432/any")
    env.pop("DATABASE_POOL_MAX_SIZE", None)
    result = subprocess.run(
        [PYTHON, "-c", "import django; django.setup(); from django.conf import settings; "
         "db = settings.DATABASES['default']; "
         "print(bool(db['OPTIONS'].get('pool')), db['CONN_HEALTH_CHECKS'])"],
        cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.stdout.split() == ["True", "True"], result.stderr


@pytest.mark.parametrize("value, threshold", [(None, "5"), ("false", "None"), ("true", "5")])
def test_prepared_statements_can_be_turned_off_for_a_pooler(value, threshold):
    """Prepared statements are on by default (the todo transitions and the hook lookup use
    them) and DATABASE_PREPARED_STATEMENTS=false turns them off for PgBouncer-style poolers."""
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="switchboard.settings",
               DATABASE_URL="postgres://postgres@127.0.0.1:5432/any")
    env.pop("DATABASE_PREPARED_STATEMENTS", None)
    if value is not None:
        env["DATABASE_PREPARED_STATEMENTS"] = value
    result = subprocess.run(
        [PYTHON, "-c", "import django; django.setup(); from django.conf import settings; "
         "print(settings.DATABASES['default']['OPTIONS']['prepare_threshold'])"],
        cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.stdout.strip() == threshold, result.stderr


def start_settings(tmp_path, **variables) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "DEBUG", "SWITCHBOARD_SECRETS_KEY")}
    env.update(DJANGO_SETTINGS_MODULE="switchboard.settings", SWITCHBOARD_VAR_DIR=str(tmp_path),
               **variables)
    return subprocess.run([PYTHON, "-c", "import django; django.setup()"], cwd=ROOT, env=env,
                          capture_output=True, text=True)


def test_production_refuses_to_start_without_a_secrets_key_of_its_own(tmp_path):
    production = {"DATABASE_URL": "postgres://postgres@127.0.0.1:5432/any"}
    refused = start_settings(tmp_path, **production)
    assert refused.returncode != 0
    assert "ImproperlyConfigured: SWITCHBOARD_SECRETS_KEY is required in production" in refused.stderr
    bad_key = start_settings(tmp_path, SWITCHBOARD_SECRETS_KEY="not-a-fernet-key", **production)
    assert bad_key.returncode != 0 and "SWITCHBOARD_SECRETS_KEY" in bad_key.stderr
    key = "c3dpdGNoYm9hcmQtdGVzdHMtb25seS1zZWNyZXRzISE="
    assert start_settings(tmp_path, SWITCHBOARD_SECRETS_KEY=key, **production).returncode == 0
    # Not production: the embedded default and DEBUG runs derive a key from SECRET_KEY.
    assert start_settings(tmp_path).returncode == 0
    assert start_settings(tmp_path, DEBUG="true", **production).returncode == 0
