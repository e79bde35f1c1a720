"""Ingest moves the /metrics ingest counters (in-process, switchboard.metrics)."""

import json

import pytest

from ingest import transitions
from ingest.tests import hook_client, signing
from console.tests.test_metrics import scrape, value

pytestmark = pytest.mark.django_db


def test_accepted_and_rejected_deliveries_are_counted(client, operator, endpoint):
    webhook, secret = transitions.create_webhook(slug="gh", owner=operator, source="github")
    transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="inbox")
    body = json.dumps({"action": "opened", "issue": {"number": 1, "title": "t"},
                       "repository": {"full_name": "a/b"}}).encode()
    before = scrape(client)

    def moved(after, name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    ok = hook_client.post("gh", body, **signing.github(secret, body))
    assert ok.status_code == 202
    bad = hook_client.post("gh", body, **signing.github("not-the-secret-at-all", body))
    assert bad.status_code == 401
    assert hook_client.post("nope", body).status_code == 404
    after = scrape(client)
    assert moved(after, "switchboard_ingest_accepted_total", source="github") == 1
    assert moved(after, "switchboard_ingest_rejected_total", reason="bad_signature") == 1
    assert moved(after, "switchboard_ingest_rejected_total", reason="unknown_webhook") == 1
