"""Anonymous traffic must not silence a signed sender (CONTRACT §12; issue 12 item 4), on two
real daphne processes sharing Redis: failed verifications spend their client address's budget
for the webhook, never the webhook's own; unknown hook slugs and bad MCP bearers are limited
per client address too."""

import hashlib
import hmac
import json
import time
import uuid
import zlib

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
    # Each title its own issue (its own thread), so each delivery makes its own todo.
    number = 1 + zlib.crc32(title.encode()) % 100_000
    body = json.dumps({"action": "opened", "issue": {"number": number, "title": title},
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


def signed_slack(secret: str, payload: dict):
    body = json.dumps(payload).encode()
    stamp = str(int(time.time()))
    signature = hmac.new(secret.encode(), f"v0:{stamp}:".encode() + body,
                         hashlib.sha256).hexdigest()
    return body, {"Content-Type": "application/json", "X-Slack-Request-Timestamp": stamp,
                  "X-Slack-Signature": f"v0={signature}"}


def captured_and_genuine(case: str, n: int):
    """``(captured, genuine)`` request builders for one webhook: the captured one makes no
    todo; each genuine one (a fresh delivery) makes one."""
    if case == "url_verification":
        handshake = signed_slack(SECRET, {"type": "url_verification", "token": "t",
                                          "challenge": "challenge-" + "x" * 40})
        return handshake, signed_slack(SECRET, {
            "type": "event_callback", "event_id": f"Ev{uuid.uuid4().hex[:10]}",
            "event": {"type": "app_mention", "user": "U1", "channel": "C1",
                      "text": f"real work {n}", "ts": f"{n}.2"}})
    genuine_body, genuine_headers = signed_issue(f"real work {n}")
    genuine_body = json.dumps({**json.loads(genuine_body), "sender": {"login": "alice"}}).encode()
    genuine_headers["X-Hub-Signature-256"] = "sha256=" + hmac.new(
        SECRET.encode(), genuine_body, hashlib.sha256).hexdigest()
    if case == "ping":
        body = json.dumps({"zen": "Design for failure.", "hook_id": 1}).encode()
        headers = {"Content-Type": "application/json", "X-GitHub-Event": "ping",
                   "X-GitHub-Delivery": "captured-ping",
                   "X-Hub-Signature-256": "sha256=" + hmac.new(
                       SECRET.encode(), body, hashlib.sha256).hexdigest()}
        return (body, headers), (genuine_body, genuine_headers)
    body = json.dumps({"action": "opened", "issue": {"number": 7, "title": "from mallory"},
                       "sender": {"login": "mallory"}}).encode()
    headers = {"Content-Type": "application/json", "X-GitHub-Event": "issues",
               "X-GitHub-Delivery": "captured-filtered",
               "X-Hub-Signature-256": "sha256=" + hmac.new(
                   SECRET.encode(), body, hashlib.sha256).hexdigest()}
    return (body, headers), (genuine_body, genuine_headers)


FLOOD_COPIES = 30
GENUINE_EVERY = 10  # one genuine delivery from the other address after every ten copies


@pytest.mark.parametrize("case", ["ping", "filtered", "url_verification"])
def test_a_flood_of_a_captured_delivery_that_made_no_todo_never_429s_the_real_sender(
        two_servers, case):
    """One signed request that made no todo (a GitHub ping matching no route, a delivery an
    actor rule filtered, Slack's url_verification), re-sent from 127.0.0.1 many times the
    webhook's budget, while the real sender delivers from 127.0.0.2: every genuine delivery
    is accepted, every repeat is answered as the first was (or 429 once its own address's
    budget is spent) and none writes a delivery event."""
    from ingest.models import DeliveryEvent, DeliveryRecord
    from todos.models import Todo

    alice = UserFactory(username="alice")
    endpoint, _ = endpoint_transitions.vend_endpoint(slug="agent", owner=alice)
    source = "slack" if case == "url_verification" else "github"
    webhook, _ = ingest_transitions.create_webhook(slug="widgets", owner=alice, source=source,
                                                   secret=SECRET)
    ingest_transitions.add_webhook_route(
        webhook=webhook, endpoint=endpoint, queue="inbox",
        kinds=["issues", "app_mention"], actors_allowed=["alice"] if case == "filtered" else None)
    attacker = httpx.Client(timeout=30, transport=httpx.HTTPTransport(local_address="127.0.0.1"))
    sender = httpx.Client(timeout=30, transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    (captured, captured_headers), _ = captured_and_genuine(case, 0)
    with attacker, sender:
        first = attacker.post(f"{two_servers[0].url}/hooks/widgets", content=captured,
                              headers=captured_headers)
        assert first.status_code in (200, 202), first.text
        repeats, genuine = [], []
        for n in range(1, FLOOD_COPIES + 1):
            server = two_servers[n % 2]
            repeats.append(attacker.post(f"{server.url}/hooks/widgets", content=captured,
                                         headers=captured_headers))
            if n % GENUINE_EVERY == 0:
                _, (body, headers) = captured_and_genuine(case, n)
                genuine.append(sender.post(f"{server.url}/hooks/widgets", content=body,
                                           headers=headers))
    assert [answer.status_code for answer in genuine] == [202] * len(genuine), [
        answer.text for answer in genuine]
    assert all(len(answer.json()["todos"]) == 1 for answer in genuine)
    assert {answer.status_code for answer in repeats} <= {first.status_code, 429}
    assert all(answer.json() == first.json() for answer in repeats
               if answer.status_code != 429)
    assert repeats[-1].status_code == 429  # the re-sender's own budget, and only it
    assert Todo.objects.count() == len(genuine)
    first_events = 0 if case == "url_verification" else 1
    assert DeliveryEvent.objects.count() == first_events + len(genuine)
    assert DeliveryRecord.objects.filter(outcome="duplicate").exists()
