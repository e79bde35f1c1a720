"""Helpers for tests that run real processes against the test database."""

import os
import sys
import time
from pathlib import Path

from django.db import connection

ROOT = Path(__file__).resolve().parent.parent


def children_database_url() -> str:
    """A DATABASE_URL naming the database this test run uses (the test_* database)."""
    settings = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{Path(settings['NAME']).resolve()}"
    user = settings.get("USER") or "postgres"
    host = settings.get("HOST") or "127.0.0.1"
    port = settings.get("PORT") or 5432
    password = f":{settings['PASSWORD']}" if settings.get("PASSWORD") else ""
    return f"postgres://{user}{password}@{host}:{port}/{settings['NAME']}"


def child_env(**extra) -> dict:
    """The environment for a child process: production settings on the test database."""
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="switchboard.settings",
        DATABASE_URL=children_database_url(),
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
    )
    env.update({key: str(value) for key, value in extra.items()})
    return env


PYTHON = sys.executable


def poll(predicate, deadline_seconds=30.0, interval_seconds=0.05) -> bool:
    """Wait for ``predicate()`` to be true, checking every ``interval_seconds``; False when the
    deadline passes first (tests poll with a deadline instead of sleeping a fixed time). The
    default deadline is generous: it costs nothing when the predicate comes true, and a loaded
    machine is slow."""
    end = time.monotonic() + deadline_seconds
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(interval_seconds)
    return True
