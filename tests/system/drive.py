"""How the system suite drives the topology from outside — signed webhooks over HTTP, MCP agent
processes — and reads the ledger back (the todo and todo-event tables) to judge the outcome."""

import asyncio
import hashlib
import hmac
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.system.topology import ROOT, Topology, poll

# Put in every delivered body, in a field no title or log line should ever carry: the log check
# greps for it.
BODY_MARKER = "sb-body-marker-" + uuid.uuid4().hex[:12]
# A sender retries a delivery that failed (connection refused, 5xx) as GitHub's "redeliver"
# would: same delivery id, same body, so the idempotency key collapses any duplicate.
SEND_RETRY_WINDOW_SECONDS = 120.0


def github_delivery(secret: str, number: int, *, delivery_id: str | None = None,
                    repo: str = "acme/widgets") -> tuple[bytes, dict]:
    # The delivery id rides in the body too: a sender's retry (same id) re-sends the same body,
    # while the same body under a new id would be a refused replay (§12).
    delivery_id = delivery_id or str(uuid.uuid4())
    body = json.dumps({
        "action": "opened",
        "issue": {"number": number, "title": f"issue {number}", "body": BODY_MARKER},
        "repository": {"full_name": repo},
        "delivery": delivery_id,
    }).encode()
    signature = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return body, {
        "Content-Type": "application/json",
        "X-Hub-Signature-256": f"sha256={signature}",
        "X-GitHub-Event": "issues",
        "X-GitHub-Delivery": delivery_id,
    }


@dataclass
class SendReport:
    statuses: dict = field(default_factory=dict)  # final status -> count
    retries: int = 0
    answers: list = field(default_factory=list)
    todo_web: dict = field(default_factory=dict)
    # Deliveries sent more than once (a retry after a failure): the first try may have been
    # committed although its answer was lost.
    retried_ids: set = field(default_factory=set)  # todo id -> base URL of the process that took it


def send_deliveries(urls: list[str], hook_slug: str, secret: str, numbers, *,
                    concurrency: int = 16, delivery_ids=None, retry: bool = True) -> SendReport:
    """POST one signed GitHub delivery per number, round-robin over ``urls`` at
    ``concurrency``; a failed send (connection error, 5xx) is retried with the same delivery id
    and body until it answers or the retry window closes."""
    numbers = list(numbers)
    report = SendReport()
    prepared = [github_delivery(secret, n, delivery_id=(delivery_ids[i] if delivery_ids else None))
                for i, n in enumerate(numbers)]

    async def send_all():
        queue = asyncio.Queue()
        for index, item in enumerate(prepared):
            queue.put_nowait((index, item))
        async with httpx.AsyncClient(timeout=30.0) as client:
            async def worker():
                while True:
                    try:
                        index, (body, headers) = queue.get_nowait()
                    except asyncio.QueueEmpty:
                        return
                    url = urls[index % len(urls)]
                    deadline = time.monotonic() + SEND_RETRY_WINDOW_SECONDS
                    attempt = 0
                    while True:
                        try:
                            answer = await client.post(f"{url}/hooks/{hook_slug}", content=body,
                                                       headers=headers)
                            status = answer.status_code
                        except httpx.HTTPError:
                            status, answer = 0, None
                        if not retry or status in (200, 201, 202) or 400 <= status < 500 \
                                or time.monotonic() > deadline:
                            break
                        report.retries += 1
                        report.retried_ids.add(headers["X-GitHub-Delivery"])
                        attempt += 1
                        # The other web process may be the live one: alternate on retry.
                        url = urls[(index + attempt) % len(urls)]
                        await asyncio.sleep(0.2)
                    report.statuses[status] = report.statuses.get(status, 0) + 1
                    if answer is not None and status == 202:
                        report.answers.append(answer.json())
                        for todo in answer.json()["todos"]:
                            report.todo_web[todo["id"]] = url

            await asyncio.gather(*(worker() for _ in range(concurrency)))

    asyncio.run(send_all())
    return report


class Agent:
    """One ``tests.system.agent`` process; its stdout lines are collected by a reader thread."""

    def __init__(self, top: Topology, url: str, slug: str, credential: str, *, name: str,
                 mode="drain", lease_seconds=30, hold=3, idle_seconds=15.0, stop_file=None):
        argv = [sys.executable, "-m", "tests.system.agent", url, slug, "--mode", mode,
                "--lease-seconds", str(lease_seconds), "--hold", str(hold),
                "--idle-seconds", str(idle_seconds)]
        if stop_file:
            argv += ["--stop-file", str(stop_file)]
        self.name = name
        self.lines: list[str] = []
        self.stderr_path = top.dir / f"agent-{name}.stderr"
        with open(self.stderr_path, "wb") as err:
            self.popen = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=err,
                                          env={**top.env, "SB_AGENT_CREDENTIAL": credential},
                                          text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.popen.stdout:
            self.lines.append(line.strip())

    def ids(self, word: str) -> list[str]:
        return [line.split()[1] for line in list(self.lines) if line.startswith(word + " ")]

    def wait_for(self, word: str, count: int = 1, deadline_seconds: float = 60.0) -> bool:
        return bool(poll(lambda: sum(1 for line in list(self.lines)
                                     if line == word or line.startswith(word + " ")) >= count,
                         deadline_seconds, 0.05))

    def kill(self):
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()

    def wait(self, deadline_seconds: float) -> int:
        try:
            code = self.popen.wait(deadline_seconds)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"agent {self.name} did not finish; last lines: "
                                 f"{self.lines[-10:]}\n{self.stderr_text()[-2000:]}") from None
        self._reader.join(5)
        return code

    def stderr_text(self) -> str:
        return Path(self.stderr_path).read_text(errors="replace")


# -- the ledger ---------------------------------------------------------------------------------


def ledger(top: Topology, endpoint_slug: str) -> dict:
    """States, per-todo complete-event counts and session count of one endpoint."""
    with top.connect() as conn:
        endpoint_id = conn.execute("SELECT id FROM endpoints_endpoint WHERE slug = %s",
                                   (endpoint_slug,)).fetchone()[0]
        states = dict(conn.execute(
            "SELECT state, count(*) FROM todos_todo WHERE endpoint_id = %s GROUP BY state",
            (endpoint_id,)).fetchall())
        completes = dict(conn.execute(
            "SELECT t.id, count(e.id) FROM todos_todo t LEFT JOIN todos_todoevent e "
            "ON e.todo_id = t.id AND e.action = 'complete' WHERE t.endpoint_id = %s "
            "GROUP BY t.id", (endpoint_id,)).fetchall())
        dead = conn.execute(
            "SELECT count(*) FROM todos_todo WHERE endpoint_id = %s AND state = 'failed' "
            "AND dead_lettered_at IS NOT NULL", (endpoint_id,)).fetchone()[0]
        sessions = conn.execute("SELECT count(*) FROM channels_push_mcpsession "
                                "WHERE endpoint_id = %s", (endpoint_id,)).fetchone()[0]
    return {"states": states, "completes": completes, "dead": dead, "sessions": sessions,
            "total": sum(states.values())}


def duplicate_keys(top: Topology, endpoint_slug: str) -> dict:
    """Idempotency keys held by more than one todo of the endpoint -> how many."""
    with top.connect() as conn:
        return dict(conn.execute(
            "SELECT t.idempotency_key, count(*) FROM todos_todo t JOIN endpoints_endpoint e "
            "ON e.id = t.endpoint_id WHERE e.slug = %s GROUP BY t.idempotency_key "
            "HAVING count(*) > 1", (endpoint_slug,)).fetchall())


def done_count(top: Topology, endpoint_slug: str) -> int:
    with top.connect() as conn:
        return conn.execute(
            "SELECT count(*) FROM todos_todo t JOIN endpoints_endpoint e ON e.id = t.endpoint_id "
            "WHERE e.slug = %s AND t.state = 'done'", (endpoint_slug,)).fetchone()[0]


def assert_each_done_exactly_once(top: Topology, endpoint_slug: str, expected: int,
                                  agents: list[Agent]):
    """Nothing lost (``expected`` todos, all done), nothing done twice: exactly one complete
    event per todo in the ledger, and the agents' own reports agree (each todo completed by
    exactly one agent)."""
    book = ledger(top, endpoint_slug)
    assert book["total"] == expected, book["states"]
    assert book["states"] == {"done": expected}, book["states"]
    counts = set(book["completes"].values())
    assert counts == {1}, {k: v for k, v in book["completes"].items() if v != 1}
    completed = [todo_id for agent in agents for todo_id in agent.ids("completed")]
    assert len(completed) == len(set(completed)), "a todo was completed twice by agents"
    assert sorted(map(str, completed)) == sorted(map(str, book["completes"])), \
        "agents' completions and the ledger disagree"
    return book


def wait_all_done(top: Topology, endpoint_slug: str, expected: int, deadline_seconds: float):
    return poll(lambda: done_count(top, endpoint_slug) >= expected, deadline_seconds, 0.1)


class RawSession:
    """An MCP session driven with plain HTTP, to show that a session id minted by one web
    process keeps working on another and after a restart (the SDK client cannot be handed an
    existing session id)."""

    PROTOCOL = "2025-11-25"

    def __init__(self, url: str, slug: str, credential: str):
        self.slug, self.credential = slug, credential
        self.headers = {"Authorization": f"Bearer {credential}",
                        "Accept": "application/json, text/event-stream",
                        "Content-Type": "application/json"}
        answer = httpx.post(f"{url}/mcp/{slug}", headers=self.headers, timeout=10, json={
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": self.PROTOCOL, "capabilities": {},
                       "clientInfo": {"name": "system-probe", "version": "1"}}})
        assert answer.status_code == 200, answer.text
        self.session_id = answer.headers["mcp-session-id"]
        self.headers.update({"Mcp-Session-Id": self.session_id,
                             "MCP-Protocol-Version": self.PROTOCOL})
        answer = httpx.post(f"{url}/mcp/{slug}", headers=self.headers, timeout=10,
                            json={"jsonrpc": "2.0", "method": "notifications/initialized"})
        assert answer.status_code == 202, answer.text

    def call(self, url: str, tool: str, arguments: dict | None = None) -> httpx.Response:
        return httpx.post(f"{url}/mcp/{self.slug}", headers=self.headers, timeout=10, json={
            "jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": tool, "arguments": arguments or {}}})

    def works_on(self, url: str) -> bool:
        try:
            answer = self.call(url, "list_todos", {"limit": 1})
        except httpx.HTTPError:
            return False
        return answer.status_code == 200 and "result" in answer.json()
