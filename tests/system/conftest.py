"""Fixtures of the system suite: one Procfile topology for the whole run (see topology.py).

The topology is session-scoped (starting it costs ~10 s); scenarios use their own endpoint and
webhook each, so their ledgers never mix. Set-up of operators, endpoints and webhooks goes
through the management commands, as an operator would; everything after that goes through
HTTP and MCP only.
"""

import json
import logging
import os
import secrets

import pytest

from tests.system.topology import Topology

# Recovery times, throughput dips and the like, printed at the end of the run (and quoted in
# the closing note of issue 8).
RECORDS: list[str] = []
# Every secret the run mints, so that the log check at the end can look for each of them.
MINTED_SECRETS: list[str] = []


@pytest.fixture(scope="session")
def topology():
    top = Topology()
    try:
        top.start()
    except BaseException:
        top.stop()  # a half-started topology must not leave a PostgreSQL or Redis behind
        raise
    yield top
    top.stop()
    if os.environ.get("SB_SYSTEM_KEEP"):  # keep the logs and data for a post-mortem
        print(f"\nsystem topology kept in {top.dir}")
    else:
        top.cleanup()


class World:
    """Operators, endpoints and webhooks created through the management commands."""

    def __init__(self, topology: Topology):
        self.top = topology
        self.operators: dict[str, str] = {}

    def operator(self, username: str) -> str:
        """A plain (non-superuser) operator: superusers see every endpoint, so the
        cross-operator checks need owners who do not. The password travels in the
        environment, never in argv."""
        if username not in self.operators:
            password = secrets.token_urlsafe(16)
            MINTED_SECRETS.append(password)
            env_manage(self.top, ["shell", "-c",
                                  "import os; from django.contrib.auth import get_user_model; "
                                  "from django.contrib.auth.models import Permission; "
                                  "user = get_user_model().objects.create_user("
                                  "os.environ['SB_USER'], password=os.environ['SB_PASSWORD']); "
                                  # An operator acts with the model permissions (as seed_demo's).
                                  "user.user_permissions.add(*Permission.objects.filter("
                                  "content_type__app_label__in=('todos', 'endpoints', 'ingest')))"],
                       SB_USER=username, SB_PASSWORD=password)
            self.operators[username] = password
        return username

    def password(self, username: str) -> str:
        self.operator(username)
        return self.operators[username]

    def operator_token(self, username: str) -> str:
        token = json.loads(self.top.manage("mint_operator_token", self.operator(username),
                                           "--json"))["token"]
        MINTED_SECRETS.append(token)
        return token

    def endpoint(self, slug: str, owner: str, *extra) -> str:
        vended = json.loads(self.top.manage("vend_endpoint", slug, "--owner", self.operator(owner),
                                            "--json", *extra))
        MINTED_SECRETS.append(vended["credential"])
        return vended["credential"]

    def github_webhook(self, slug: str, owner: str, routes: list[tuple[str, str]]) -> str:
        secret = "gh-" + secrets.token_hex(16)
        MINTED_SECRETS.append(secret)
        self.top.manage("add_webhook", slug, "--owner", self.operator(owner), "--source",
                        "github", "--secret", secret, "--json")
        for endpoint, queue in routes:
            self.top.manage("add_webhook_route", slug, endpoint, "--queue", queue, "--json")
        return secret


def env_manage(top: Topology, args: list[str], **extra_env) -> str:
    import subprocess
    import sys

    from tests.system.topology import ROOT

    done = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT,
                          env={**top.env, **extra_env}, capture_output=True, text=True,
                          timeout=120)
    if done.returncode:
        raise RuntimeError(f"manage.py {args[0]} failed:\n{done.stderr}")
    return done.stdout


@pytest.fixture(scope="session")
def world(topology):
    return World(topology)


def record(line: str):
    RECORDS.append(line)
    print(line)


def pytest_configure(config):
    # The drivers send thousands of requests; httpx's per-request INFO lines only add noise.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def pytest_sessionfinish(session):
    # On an xdist worker the summary below is not shown: hand the records to the controller
    # (the root conftest.py prints them there).
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None and RECORDS:
        workeroutput["system_records"] = list(RECORDS)


def pytest_terminal_summary(terminalreporter):
    if RECORDS:
        terminalreporter.section("system suite: observed numbers")
        for line in RECORDS:
            terminalreporter.write_line(line)
