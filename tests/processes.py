"""Helpers for tests that run real processes against the test database."""

import os
import sys
import time
from pathlib import Path

from django.db import connection

ROOT = Path(__file__).resolve().parent.parent
# How long a test waits for something that should happen soon (a process started and
# answering, a line printed, a row changed): a deadline, not a wait, since every wait polls
# and returns as soon as its condition holds. It only bounds a failure, so it is generous: on a
# shared 2-core machine at load 15, starting a Python process and its first request took most
# of 30 s (docs/testing.md, "Deterministic under load").
DEADLINE_SECONDS = 120.0


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


def poll(predicate, deadline_seconds=DEADLINE_SECONDS, interval_seconds=0.05) -> bool:
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
