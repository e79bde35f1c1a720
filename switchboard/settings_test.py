"""Test settings: the real services this machine runs (PostgreSQL and Redis), unless the
environment names others. The embedded (SQLite) path is tested by subprocesses that unset
DATABASE_URL."""

import os

os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/switchboard")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/0")
os.environ.setdefault("SECRET_KEY", "test-secret-key-not-for-production")

from .settings import *  # noqa: E402,F401,F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast test logins
