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


# -- the write-back sender's outcomes and ack latency (docs/operating.md#metrics) ----------------


def test_write_back_outcomes_and_ack_latency_are_counted_from_the_database(client, github,
                                                                           hooked_by_token):
    from datetime import timedelta

    from console import metrics as console_metrics
    from ingest import write_back
    from ingest.models import WriteBack
    from ingest.tests.test_write_back import deliver, issue_opened

    before = scrape(client)

    def moved(after, name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    payloads = [issue_opened() for _ in range(3)]
    for n, payload in enumerate(payloads):
        payload["issue"]["number"] += n
    first = deliver("issues", payloads[0])
    github.fail(503, times=1)
    start = first.created_at
    write_back.send_due_write_backs(now=start)  # retried
    write_back.send_due_write_backs(now=start + timedelta(seconds=7))  # sent, 7 s after the 202
    deliver("issues", payloads[1])
    github.fail(422, message="Validation Failed", times=1)
    github.problems.clear()
    write_back.send_due_write_backs(now=start + timedelta(seconds=8))  # failed
    deliver("issues", payloads[2])
    github.fail(502, times=None, message="Bad Gateway")
    write_back.send_due_write_backs(now=start + timedelta(seconds=9))  # retried
    write_back.send_due_write_backs(now=start + write_back.RETRY_FOR + timedelta(seconds=9))
    assert sorted(WriteBack.objects.values_list("state", flat=True)) == [
        "abandoned", "failed", "sent"]
    after = scrape(client)
    counted = {outcome: moved(after, "switchboard_write_backs_total", source="github",
                              outcome=outcome)
               for outcome in ("sent", "retried", "failed", "abandoned")}
    assert counted == {"sent": 1, "retried": 2, "failed": 1, "abandoned": 1}
    ack = "switchboard_write_back_ack_seconds"
    assert moved(after, f"{ack}_count", source="github") == 1
    assert moved(after, f"{ack}_bucket", source="github", le="10") == 1
    assert moved(after, f"{ack}_bucket", source="github", le="5") == 0
    assert 7 <= moved(after, f"{ack}_sum", source="github") < 8
    # Kept in the database, not in the process: a collector made afresh (a restart, another
    # web process) reads the same counts.
    fresh = {sample.labels.get("outcome"): sample.value
             for family in console_metrics.WriteBackCollector().collect()
             for sample in family.samples if sample.name == "switchboard_write_backs_total"}
    assert fresh["sent"] == value(after, "switchboard_write_backs_total", source="github",
                                  outcome="sent")


def test_an_answer_recorded_after_its_claim_lapsed_counts_nothing(github, hooked_by_token):
    from django.utils import timezone

    from ingest import write_back
    from ingest.models import WriteBackTally
    from ingest.tests.test_write_back import deliver, issue_opened

    deliver("issues", issue_opened())
    write_back.absorb_outbox_entries(now=timezone.now())
    now = timezone.now()
    row = write_back.claim_due_write_back(now=now)
    row.attempts -= 1  # what a worker whose lease lapsed (and was claimed again) holds
    assert write_back.finish_write_back(row, now=now, external_id="1") == "sending"
    assert not WriteBackTally.objects.exists()
