"""The signed ``curl`` examples of docs/senders.md, pasted into bash as a reader would, against a
real daphne: each must be accepted (Slack's handshake answered with its challenge), so the
page cannot drift from what the hook verifies."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ingest import transitions
from ingest.models import DeliveryRecord
from tests.factories import EndpointFactory, UserFactory
from tests.processes import DEADLINE_SECONDS
from todos.models import Todo

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not (shutil.which("curl") and shutil.which("openssl")),
                       reason="the examples need curl and openssl"),
]

DOC = Path(__file__).resolve().parent.parent / "docs" / "senders.md"
BLOCK_RE = re.compile(r"```sh\n(.*?)```", re.S)
BASH_TIMEOUT_SECONDS = DEADLINE_SECONDS


def curl_examples() -> list[str]:
    return [block for block in BLOCK_RE.findall(DOC.read_text())
            if "curl" in block and block.startswith("URL=")]


def run_example(block: str, url: str, secret: str) -> dict:
    script = re.sub(r"^URL=.*$", f"URL={url}", block, count=1, flags=re.M)
    script = re.sub(r"^SECRET=.*$", f"SECRET='{secret}'", script, count=1, flags=re.M)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True,
                          text=True, timeout=BASH_TIMEOUT_SECONDS)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_page_has_an_example_per_new_sender():
    slugs = sorted(re.match(r"URL=\S+/hooks/(\S+)", block).group(1) for block in curl_examples())
    assert slugs == ["linear", "sentry", "slack", "slack"]


def test_every_signed_curl_example_is_accepted(daphne_server):
    operator = UserFactory(username="docs-operator")
    endpoint = EndpointFactory(slug="docs-agent", owner=operator)
    secrets = {}
    for source in ("linear", "slack", "sentry"):
        webhook, secrets[source] = transitions.create_webhook(slug=source, owner=operator,
                                                              source=source)
        transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="inbox")
    titles = []
    for block in curl_examples():
        slug = re.match(r"URL=\S+/hooks/(\S+)", block).group(1)
        answer = run_example(block, f"{daphne_server.url}/hooks/{slug}", secrets[slug])
        if "url_verification" in block:
            assert answer["challenge"].startswith("demo-challenge-")
            continue
        [todo] = answer["todos"]
        assert todo["duplicate"] is False, answer
        titles.append(Todo.objects.get(pk=todo["id"]).title)
    assert titles == ["ENG-12 created: Fix login",
                      "#C0DEMO @U0DEMO: @U0APP please fix the login bug",
                      "issue created: ZeroDivisionError: division by zero"]
    assert sorted(DeliveryRecord.objects.values_list("outcome", "status")) == [
        ("accepted", 200), ("accepted", 202), ("accepted", 202), ("accepted", 202)]
