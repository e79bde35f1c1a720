"""Anonymous traffic must not silence a signed sender (CONTRACT §12; issue 12 item 4), on two
real daphne processes sharing Redis: failed verifications spend their client address's budget
for the webhook, never the webhook's own; unknown hook slugs and bad MCP bearers are limited
per client address too."""

import hashlib
import hmac
import json
import uuid

import httpx
import pytest

from endpoints import transitions as endpoint_transitions
from ingest import transitions as ingest_transitions
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)

# Low on purpose: 50 bad requests are many times every budget.
LIMITS = {"SWITCHBOARD_INGEST_RATE_PER_MINUTE": "5",
          "SWITCHBOARD_INGEST_FAILURES_PER_MINUTE": "5",
          "SWITCHBOARD_UNKNOWN_CLIENT_PER_MINUTE": "5"}
SECRET = "gh-secret-for-anonymous-limits-0123"


def signed_issue(title: str, *, secret=SECRET):
    body = json.dumps({"action": "opened", "issue": {"number": 1, "title": title},
                       "repository": {"full_name": "acme/widgets"}}).encode()
    signature = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return body, {"Content-Type": "application/json", "X-GitHub-Event": "issues",
                  "X-GitHub-Delivery": str(uuid.uuid4()),
                  "X-Hub-Signature-256": f"sha256={signature}"}


@pytest.fixture
def two_servers(start_daphne):
    return [start_daphne(**LIMITS), start_daphne(**LIMITS)]


def test_a_bad_signature_flood_never_pushes_a_valid_delivery_into_429(two_servers):
    alice = UserFactory(username="alice")
    endpoint, _ = endpoint_transitions.vend_endpoint(slug="agent", owner=alice)
    webhook, _ = ingest_transitions.create_webhook(slug="widgets", owner=alice, source="github",
                                                   secret=SECRET)
    ingest_transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="inbox")
    statuses = []
    with httpx.Client(timeout=30) as client:
        for n in range(50):
            body, headers = signed_issue(f"forged {n}", secret="not-the-secret-at-all-0000")
            server = two_servers[n % 2]
            statuses.append(client.post(f"{server.url}/hooks/widgets", content=body,
                                        headers=headers).status_code)
        assert set(statuses) == {401, 429} and statuses.count(401) <= 2 * 5
        for server in two_servers:
            body, headers = signed_issue(f"real work via {server.port}")
            answer = client.post(f"{server.url}/hooks/widgets", content=body, headers=headers)
            assert answer.status_code == 202, answer.text


def test_unknown_hook_slugs_are_limited_per_client_address(two_servers):
    with httpx.Client(timeout=30) as client:
        statuses = [client.post(f"{two_servers[n % 2].url}/hooks/no-such-{n}", content=b"{}",
                                headers={"Content-Type": "application/json"}).status_code
                    for n in range(20)]
    assert statuses[:5] == [404] * 5 and statuses[-1] == 429


def test_bad_mcp_bearers_are_limited_per_client_address(two_servers):
    alice = UserFactory(username="alice")
    endpoint, credential = endpoint_transitions.vend_endpoint(slug="agent", owner=alice)
    ping = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}}).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    with httpx.Client(timeout=30) as client:
        statuses = [client.post(f"{two_servers[n % 2].url}/mcp/agent", content=ping,
                                headers={**headers, "Authorization": f"Bearer sbk_wrong{n}"}).status_code
                    for n in range(20)]
        assert statuses[:5] == [401] * 5 and statuses[-1] == 429
        assert "retry-after" in {k.lower() for k in client.post(
            f"{two_servers[0].url}/mcp/nope", content=ping, headers=headers).headers}


def test_a_bad_bearer_flood_does_not_lock_out_an_agent_already_working_from_that_address(
        two_servers):
    """Review finding: the address's failure block refused every request from it, good bearers
    included. An agent whose bearer the process accepted keeps working through the flood."""
    alice = UserFactory(username="alice")
    endpoint_transitions.vend_endpoint(slug="agent", owner=alice)
    _, good = endpoint_transitions.vend_endpoint(slug="worker", owner=alice)
    initialize = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}}).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    server = two_servers[0]
    with httpx.Client(timeout=30) as client:
        def post(slug, bearer):
            return client.post(f"{server.url}/mcp/{slug}", content=initialize,
                               headers={**headers, "Authorization": f"Bearer {bearer}"})

        assert post("worker", good).status_code == 200  # the agent at work
        flood = [post("agent", f"sbk_wrong{n}").status_code for n in range(20)]
        assert flood[-1] == 429  # the flood is limited ...
        assert post("worker", good).status_code == 200  # ... the working agent is not
