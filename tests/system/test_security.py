"""Security over the running topology: cross-endpoint and cross-operator access on every
surface (MCP verbs, operator API), credentials hashed at rest, secrets encrypted at rest.

The log check (no bearer, secret or body in any process's output during the whole run) is
test_zz_logs.py, which runs last."""

import json
import secrets

import httpx
import pytest

from tests.system import drive
from tests.system.conftest import MINTED_SECRETS

pytestmark = pytest.mark.system

AGENT_VERBS_ON_A_TODO = ("claim", "heartbeat", "complete", "fail", "release")


def hand_over(url, slug, token, **fields) -> httpx.Response:
    return httpx.post(f"{url}/api/v1/endpoints/{slug}/todos", timeout=10,
                      headers={"Authorization": f"Bearer {token}"},
                      json={"queue": "inbox", "title": "handed over", **fields})


def tool(session: drive.RawSession, url: str, name: str, arguments: dict) -> dict:
    answer = session.call(url, name, arguments)
    assert answer.status_code == 200, answer.text
    return answer.json()["result"]


def refusal(result: dict) -> str | None:
    return result["structuredContent"]["error"]["code"] if result.get("isError") else None


@pytest.fixture(scope="module")
def two_tenants(world):
    """alice owns endpoint sec-a, bob owns sec-b; each has a todo with an operator secret."""
    cred_a = world.endpoint("sec-a", "alice")
    cred_b = world.endpoint("sec-b", "bob")
    token_a, token_b = world.operator_token("alice"), world.operator_token("bob")
    secret_value = "opsecret-" + secrets.token_hex(12)
    MINTED_SECRETS.append(secret_value)
    return {"cred_a": cred_a, "cred_b": cred_b, "token_a": token_a, "token_b": token_b,
            "secret_value": secret_value}


def test_operator_api_only_for_the_endpoint_owner(topology, two_tenants):
    web0, web1 = topology.web_urls
    t = two_tenants
    assert hand_over(web0, "sec-a", t["token_a"]).status_code == 201
    # bob cannot hand alice's endpoint a todo (and cannot tell it exists), on either process.
    for url in (web0, web1):
        assert hand_over(url, "sec-a", t["token_b"]).status_code == 404
        assert hand_over(url, "sec-a", "sbo_" + secrets.token_urlsafe(32)).status_code == 401
        assert hand_over(url, "sec-a", t["cred_a"]).status_code == 401  # an agent bearer
        assert httpx.post(f"{url}/api/v1/endpoints/sec-a/todos", json={}).status_code == 401


def test_mcp_verbs_never_cross_endpoints(topology, two_tenants):
    web0, web1 = topology.web_urls
    t = two_tenants
    # alice's own todo, so this test does not lean on what an earlier one left behind.
    assert hand_over(web0, "sec-a", t["token_a"], title="alice's").status_code == 201
    answer = hand_over(web0, "sec-b", t["token_b"], title="bob's",
                       secrets={"api_key": t["secret_value"]})
    assert answer.status_code == 201, answer.text
    bobs_todo = answer.json()["todo"]["id"]

    # A bearer is good only at its own endpoint's URL.
    for url in (web0, web1):
        wrong = httpx.post(f"{url}/mcp/sec-b", timeout=10, json={
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                       "clientInfo": {"name": "x", "version": "1"}}},
            headers={"Authorization": f"Bearer {t['cred_a']}",
                     "Accept": "application/json, text/event-stream"})
        assert wrong.status_code == 401
        assert "bearer" in wrong.headers.get("www-authenticate", "").lower()

    alice = drive.RawSession(web0, "sec-a", t["cred_a"])
    bob = drive.RawSession(web1, "sec-b", t["cred_b"])
    # alice's session id, presented with bob's bearer at bob's URL: not a session of his.
    hijack = httpx.post(f"{web1}/mcp/sec-b", timeout=10,
                        headers={**bob.headers, "Mcp-Session-Id": alice.session_id},
                        json={"jsonrpc": "2.0", "id": 3, "method": "tools/list"})
    assert hijack.status_code == 404

    listed = tool(alice, web1, "list_todos", {"limit": 200})["structuredContent"]["todos"]
    assert listed and all(todo["endpoint"] == "sec-a" for todo in listed)
    assert bobs_todo not in {todo["id"] for todo in listed}
    for verb in AGENT_VERBS_ON_A_TODO:
        arguments = {"todo_id": bobs_todo}
        if verb == "fail":
            arguments["error"] = "x"
        assert refusal(tool(alice, web0, verb, arguments)) == "not_found", verb
    # claim_next on alice's side drains only alice's todos, then is empty.
    pending = [todo for todo in listed if todo["state"] == "pending"]
    for _ in pending:
        claimed = tool(alice, web0, "claim_next", {})["structuredContent"]
        assert claimed["todo"]["endpoint"] == "sec-a"
    assert tool(alice, web0, "claim_next", {})["structuredContent"] == {"empty": True}

    # bob reads his secret by ref; alice cannot, not even knowing the ref.
    bobs = tool(bob, web1, "claim", {"todo_id": bobs_todo})["structuredContent"]["todo"]
    ref = bobs["payload"]["secrets"]["api_key"]["$secret"]
    assert t["secret_value"] not in json.dumps(bobs)
    read = tool(bob, web0, "read_secret", {"ref": ref})["structuredContent"]
    assert read["value"] == t["secret_value"]
    assert refusal(tool(alice, web0, "read_secret", {"ref": ref})) == "not_found"
    # bob's lease cannot be completed through alice's session even with the lease id.
    assert refusal(tool(alice, web1, "complete", {"todo_id": bobs_todo,
                                                  "lease_id": bobs["lease_id"]})) == "not_found"
    assert refusal(tool(bob, web1, "complete", {"todo_id": bobs_todo})) is None


def test_scope_and_verb_allowlist_hold_over_http(topology, world):
    web0, _ = topology.web_urls
    narrow = world.endpoint("sec-narrow", "carol", "--queues", "inbox", "--verbs",
                            "list_todos,claim_next")
    token = world.operator_token("carol")
    assert hand_over(web0, "sec-narrow", token, queue="inbox").status_code == 201
    session = drive.RawSession(web0, "sec-narrow", narrow)
    assert refusal(tool(session, web0, "claim", {"todo_id": "1"})) == "verb_not_allowed"
    assert refusal(tool(session, web0, "claim_next", {"queues": ["payroll"]})) in (
        "not_in_scope", "invalid_argument")


def test_no_plaintext_bearer_token_password_or_secret_in_the_database(topology, two_tenants):
    """Dump every text-like column of every table and look for each credential, operator
    token, password and operator secret the run minted (webhook signing secrets are excluded:
    verifying an HMAC needs the secret itself)."""
    with topology.connect() as conn:
        columns = conn.execute(
            "SELECT table_name, column_name FROM information_schema.columns "
            "WHERE table_schema = 'public' AND data_type IN "
            "('text', 'character varying', 'character', 'json', 'jsonb', 'bytea')").fetchall()
        dump = []
        for table, column in columns:
            rows = conn.execute(f'SELECT "{column}"::text FROM "{table}" '
                                f'WHERE "{column}" IS NOT NULL').fetchall()
            dump.extend(row[0] for row in rows)
    text = "\n".join(dump)
    assert len(text) > 2_000  # the dump really holds the run's rows
    checked = [value for value in MINTED_SECRETS if not value.startswith("gh-")]
    assert len(checked) >= 6
    leaked = [value[:6] + "…" for value in checked if value in text]
    assert not leaked, f"plaintext credentials in the database: {leaked}"


def signed_in(url: str, username: str, password: str) -> httpx.Client:
    client = httpx.Client(base_url=url, timeout=10)
    client.get("/accounts/login/")
    answer = client.post("/accounts/login/", data={
        "username": username, "password": password,
        "csrfmiddlewaretoken": client.cookies["csrftoken"]})
    assert answer.status_code == 302, answer.text[:500]
    return client


def test_board_pages_buttons_and_stream_show_only_the_operators_own_endpoints(
        topology, world, two_tenants):
    import re
    import threading

    web0, web1 = topology.web_urls
    t = two_tenants
    mine = hand_over(web0, "sec-a", t["token_a"], title="alice-visible-" + secrets.token_hex(4))
    theirs = hand_over(web0, "sec-b", t["token_b"], title="bob-hidden-" + secrets.token_hex(4))
    mine, theirs = mine.json()["todo"], theirs.json()["todo"]

    alice = signed_in(web0, "alice", world.password("alice"))
    # The Django session lives in the database: the other web process knows it too.
    alice_on_web1 = httpx.Client(base_url=web1, timeout=10, cookies=alice.cookies)
    for client in (alice, alice_on_web1):
        board = client.get("/todos/")
        assert board.status_code == 200
        assert mine["title"] in board.text and theirs["title"] not in board.text
        rows = client.get("/todos/rows")
        assert mine["title"] in rows.text and theirs["title"] not in rows.text
        assert client.get(f"/todos/{mine['id']}/").status_code == 200
        assert client.get(f"/todos/{theirs['id']}/").status_code == 404
        refused = client.post(f"/todos/{theirs['id']}/claim",
                              data={"csrfmiddlewaretoken": alice.cookies["csrftoken"]},
                              headers={"X-CSRFToken": alice.cookies["csrftoken"]})
        assert refused.status_code == 404
        assert client.get("/todos/?endpoint=sec-b").text.count(theirs["title"]) == 0
    with topology.connect() as conn:
        state = conn.execute("SELECT state FROM todos_todo WHERE id = %s",
                             (int(theirs["id"]),)).fetchone()[0]
    assert state == "pending"

    # Anonymous: no board, no stream.
    assert httpx.get(f"{web1}/todos/", timeout=10).status_code in (302, 403)
    assert httpx.get(f"{web1}/todos/events", timeout=10).status_code == 403

    # alice's live stream on web1 while todos of both operators arrive through web0.
    seen = []
    stop = threading.Event()

    def watch():
        try:
            with alice_on_web1.stream("GET", "/todos/events",
                                      timeout=httpx.Timeout(10, read=30)) as stream:
                for chunk in stream.iter_text():
                    seen.append(chunk)
                    if stop.is_set():
                        return
        except httpx.HTTPError:
            return  # the stream ends with the run (topology stopped)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert poll_text(seen, "event: sync")
    hidden = hand_over(web0, "sec-b", t["token_b"], title="bob-live-" + secrets.token_hex(4))
    shown = hand_over(web0, "sec-a", t["token_a"], title="alice-live-" + secrets.token_hex(4))
    hidden, shown = hidden.json()["todo"], shown.json()["todo"]
    assert poll_text(seen, shown["title"]), "".join(seen)[-2000:]
    stop.set()
    alice_on_web1.close()
    text = "".join(seen)
    assert hidden["title"] not in text
    assert not re.search(r'"todo_id":\s*"%s"' % hidden["id"], text)


def poll_text(chunks: list, needle: str, deadline_seconds: float = 20.0) -> bool:
    from tests.system.topology import poll

    return bool(poll(lambda: needle in "".join(chunks), deadline_seconds, 0.05))
