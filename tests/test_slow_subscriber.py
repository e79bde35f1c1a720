"""A slow subscriber is dropped, not buffered (CONTRACT §7, issue 13 item 12), against a real
daphne process: a client whose socket has a tiny receive buffer and never reads. daphne's
``send`` never pushes back, so without a bound every doorbell would pile up in the server's
memory; the stream watches the transport's unsent bytes and drops past its bound (INFO log
with endpoint slug and todo id, the /metrics drop counter), and the server's RSS stays flat."""

import re
import socket
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from channels_push.doorbells.doorbells import CHANNEL_METHOD
from channels_push.sessions import notify as session_notify
from channels_push.bus import publish
from channels_push.models import McpSession
from endpoints import transitions as endpoint_transitions
from tests.factories import UserFactory
from tests.processes import DEADLINE_SECONDS, poll

pytestmark = pytest.mark.django_db(transaction=True)

METRICS_TOKEN = "slow-subscriber-metrics"
BOUND_BYTES = 64 * 1024
FRAMES = 3000
FRAME_CONTENT_CHARS = 4000  # 3000 frames x ~4 KB: ~12 MB a server without a bound would hold
BATCH = 50


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE).group(1)) * 1024


def doorbell_counts(url: str) -> tuple[float, float]:
    """The server's (sent, dropped) doorbell counters, dropped summed over its reasons."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"},
                     timeout=DEADLINE_SECONDS).text
    totals = {"sent": 0.0, "dropped": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for name in totals:
                if sample.name == f"switchboard_doorbells_{name}_total":
                    totals[name] += sample.value
    return totals["sent"], totals["dropped"]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_a_client_that_never_reads_is_dropped_and_server_memory_stays_flat(start_daphne):
    server = start_daphne(SWITCHBOARD_STREAM_BUFFER_BYTES=str(BOUND_BYTES),
                          SWITCHBOARD_METRICS_TOKEN=METRICS_TOKEN)
    owner = UserFactory(username="slow-owner")
    endpoint, credential = endpoint_transitions.vend_endpoint(slug="slow-reader", owner=owner)
    headers = {"Authorization": f"Bearer {credential}",
               "Accept": "application/json, text/event-stream"}
    answer = httpx.post(f"{server.url}/mcp/{endpoint.slug}", headers=headers,
                        timeout=DEADLINE_SECONDS, json={
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                   "clientInfo": {"name": "slow", "version": "1"}}})
    session_id = answer.headers["mcp-session-id"]

    # The slow client: a receive buffer as small as the kernel allows, and it never reads.
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall((f"GET /mcp/{endpoint.slug} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  f"Authorization: Bearer {credential}\r\nAccept: text/event-stream\r\n"
                  f"Mcp-Session-Id: {session_id}\r\n\r\n").encode())
    try:
        assert poll(lambda: McpSession.objects.get(pk=session_id).open_streams == 1)
        rss_before = rss_bytes(server.process.pid)
        sent_before, dropped_before = doorbell_counts(server.url)
        content = "x" * FRAME_CONTENT_CHARS
        # Doorbells arrive as they do in life, a few at a time, each batch handled (written or
        # dropped) before the next: the stream's 100-frame queue never fills, so only a bound
        # on the transport's unsent bytes can stop them piling up in the server.
        for start in range(0, FRAMES, BATCH):
            for number in range(start, start + BATCH):
                session_notify.notify_session(
                    session_id, CHANNEL_METHOD,
                    {"content": content, "meta": {"todo_id": str(number)}},
                    context={"endpoint": endpoint.slug, "todo_id": str(number)})
            assert publish.wait_for_sends(DEADLINE_SECONDS)
            assert poll(lambda: sum(doorbell_counts(server.url)) - sent_before - dropped_before
                        >= start + BATCH)
        sent, dropped = doorbell_counts(server.url)
        assert dropped - dropped_before >= FRAMES * 9 // 10, (sent - sent_before, dropped)
        grown = rss_bytes(server.process.pid) - rss_before
        print(f"slow subscriber: sent {sent - sent_before:.0f}, dropped {dropped - dropped_before:.0f},"
              f" server RSS grew {grown / 1e6:.1f} MB for {FRAMES * FRAME_CONTENT_CHARS / 1e6:.0f} MB"
              " of frames")
        assert grown < FRAMES * FRAME_CONTENT_CHARS // 4, f"server RSS grew by {grown} bytes"
        log = server.log_text()
        assert "doorbell dropped: stream backlog over its bound" in log
        line = next(l for l in log.splitlines() if "stream backlog over its bound" in l)
        assert "level=info" in line and "endpoint=slow-reader" in line and "todo_id=" in line
        assert credential not in log
    finally:
        sock.close()


def test_a_doorbell_dropped_at_the_backlog_is_one_line_saying_so(start_daphne, caplog):
    """Rung through the doorbell's own send, to a stream whose client never reads: a doorbell
    the stream drops at its backlog bound was also logged "doorbell rung" by the sender once
    the channel layer took it. Every doorbell is one line, its true outcome."""
    import logging

    from channels_push.doorbells import doorbells

    server = start_daphne(SWITCHBOARD_STREAM_BUFFER_BYTES=str(BOUND_BYTES),
                          SWITCHBOARD_METRICS_TOKEN=METRICS_TOKEN)
    owner = UserFactory(username="backlog-owner")
    endpoint, credential = endpoint_transitions.vend_endpoint(slug="backlog-reader", owner=owner)
    answer = httpx.post(f"{server.url}/mcp/{endpoint.slug}", timeout=DEADLINE_SECONDS, json={
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                   "clientInfo": {"name": "slow", "version": "1"}}},
        headers={"Authorization": f"Bearer {credential}",
                 "Accept": "application/json, text/event-stream"})
    session_id = answer.headers["mcp-session-id"]
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall((f"GET /mcp/{endpoint.slug} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  f"Authorization: Bearer {credential}\r\nAccept: text/event-stream\r\n"
                  f"Mcp-Session-Id: {session_id}\r\n\r\n").encode())
    caplog.set_level(logging.INFO, logger="switchboard.doorbell")
    frames = 600  # ~2.4 MB: more than the kernel's socket buffers take before the bound
    try:
        assert poll(lambda: McpSession.objects.get(pk=session_id).open_streams == 1)
        before = doorbell_counts(server.url)
        content = "x" * FRAME_CONTENT_CHARS
        for start in range(0, frames, BATCH):
            for number in range(start, start + BATCH):
                doorbells.send_doorbell(session_id, {"content": content, "meta": {}},
                                        {"endpoint": endpoint.slug, "todo_id": str(number)})
            assert publish.wait_for_sends(30)
            assert poll(lambda: sum(doorbell_counts(server.url)) - sum(before) >= start + BATCH,
                        deadline_seconds=30)
    finally:
        sock.close()
    server_lines = _outcome_lines(server.log_text())
    dropped = {todo for todo, outcome in server_lines if outcome.startswith("doorbell dropped")}
    assert dropped, "the stream dropped nothing: the bound was never reached"
    here = [(r.todo_id, r.getMessage()) for r in caplog.records
            if r.getMessage().startswith(("doorbell rung", "doorbell dropped"))]
    per_todo = {}
    for todo, outcome in server_lines + here:
        per_todo.setdefault(todo, []).append(outcome)
    assert sorted(per_todo) == sorted(str(n) for n in range(frames))
    twice = {todo: outcomes for todo, outcomes in per_todo.items() if len(outcomes) != 1}
    assert not twice, dict(list(twice.items())[:3])
    for todo in dropped:
        assert per_todo[todo] == ["doorbell dropped: stream backlog over its bound"]


def _outcome_lines(log: str) -> list[tuple[str, str]]:
    """``(todo_id, "doorbell rung" | "doorbell dropped: …")`` of each outcome line in a
    server's log."""
    lines = []
    for line in log.splitlines():
        outcome = re.search(r'msg="(doorbell (?:rung|dropped[^"]*))"|msg=(doorbell rung)\b', line)
        todo = re.search(r"\btodo_id=(\d+)", line)
        if outcome and todo:
            lines.append((todo.group(1), outcome.group(1) or outcome.group(2)))
    return lines
