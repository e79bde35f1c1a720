"""Runs last (file order): no bearer, secret or webhook body in any line any process of the
topology printed during the whole system run (CONTRACT §10)."""

import pytest

from tests.system import drive
from tests.system.conftest import MINTED_SECRETS, record

pytestmark = pytest.mark.system


def test_no_bearer_secret_or_body_in_any_log_line(topology, world):
    # At least one delivery, so that the body marker has been through the system even when
    # this file runs alone.
    world.endpoint("logs", "ops-logs")
    secret = world.github_webhook("gh-logs", "ops-logs", [("logs", "inbox")])
    assert drive.send_deliveries(topology.web_urls, "gh-logs", secret, [1]).statuses == {202: 1}
    logs = topology.all_logs()
    assert {"web0.log", "web1.log", "worker.log", "beat.log"} <= set(logs)
    assert sum(len(text) for text in logs.values()) > 1000  # the processes did log
    needles = {"body marker": drive.BODY_MARKER}
    needles.update({f"minted secret {value[:4]}…": value for value in MINTED_SECRETS})
    found = [(name, label) for name, text in logs.items() for label, needle in needles.items()
             if needle in text]
    assert not found, f"leaked into logs: {found}"
    lines = sum(text.count("\n") for text in logs.values())
    record(f"[logs] {lines} log lines from {len(logs)} processes checked for "
           f"{len(needles)} secrets/bearers and the body marker: none found")
