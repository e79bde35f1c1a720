"""Test settings: the real services this machine runs (PostgreSQL and Redis), unless the
environment names others. The embedded (SQLite) path is tested by subprocesses that unset
DATABASE_URL."""

import os

os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/switchboard")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/0")
os.environ.setdefault("SECRET_KEY", "test-secret-key-not-for-production")
# Production settings (a DATABASE_URL, DEBUG off) refuse to start without a secrets key of their
# own; child processes (daphne, celery, manage.py) inherit this one. base64("switchboard-tests-
# only-secrets!!"): a test key, never for production.
os.environ.setdefault("SWITCHBOARD_SECRETS_KEY", "c3dpdGNoYm9hcmQtdGVzdHMtb25seS1zZWNyZXRzISE=")
# Tests run many threads against one process's pool (8 drain workers, Channels' thread pool,
# live servers); a production-sized pool of 10 would make them queue for connections.
os.environ.setdefault("DATABASE_POOL_MAX_SIZE", "40")
# Four xdist workers, each with its own process and its daphne servers, share the machine's
# PostgreSQL (max_connections 100): a pool closes one unused connection every 5 s instead of
# every 10 minutes, so a burst's connections go back during the run; held, they added up to
# "too many clients" on a loaded run.
os.environ.setdefault("DATABASE_POOL_MAX_IDLE_SECONDS", "5")
# Under pytest-xdist, each worker's own Redis database and channel prefix (its own test
# database comes from pytest-django).
from tests.workers import isolate_xdist_worker  # noqa: E402

isolate_xdist_worker()

from .settings import *  # noqa: E402,F401,F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast test logins
# Tests write back to a stand-in of GitHub on a loopback port, which serves plain http.
SWITCHBOARD_WRITE_BACK_LOOPBACK_HTTP = True
