"""The production shape (CONTRACT §12): nginx from deploy/nginx.conf in front of daphne.

daphne on its own keeps a half-sent request open for as long as the client likes and reads a
whole oversized body before it can answer 413. Through the proxy, a slow header or a stalled
body is cut by the proxy's timeouts and an oversized body is refused by the proxy, while daphne
never hears of any of them (its access log has no line for the probe). The stream routes are
unbuffered: a board event arrives through the proxy while the stream is still open (the board
and MCP scenarios of the other files run through it too)."""

import re
import secrets
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.system.topology import poll

pytestmark = pytest.mark.system

# deploy/nginx.conf: client_header_timeout / client_body_timeout.
PROXY_TIMEOUT_SECONDS = 10.0
# How long a probe keeps trickling before it calls the connection "held open".
TRICKLE_SECONDS = 2.5 * PROXY_TIMEOUT_SECONDS


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


def trickle(url: str, first: bytes, drip: bytes, *, window_seconds: float) -> dict:
    """Send ``first``, then one ``drip`` per second; stop when the server closes the
    connection (or answers) or when the window ends. Returns what happened."""
    sock = socket.create_connection(address(url), timeout=5)
    sock.settimeout(1.0)
    started = time.monotonic()
    answer = b""
    closed = False
    try:
        sock.sendall(first)
        while time.monotonic() - started < window_seconds:
            try:
                chunk = sock.recv(4096)
                if not chunk:
                    closed = True
                    break
                answer += chunk
                continue
            except socket.timeout:
                pass
            try:
                sock.sendall(drip)
            except OSError:  # reset by the peer
                closed = True
                break
    finally:
        sock.close()
    return {"closed": closed, "after_seconds": time.monotonic() - started, "answer": answer}


def daphne_saw(topology, needle: str) -> bool:
    return any(needle in topology.webs[i].log_text() for i in range(len(topology.webs)))


def test_a_slow_header_is_cut_by_the_proxy_while_daphne_sees_nothing(topology):
    probe = f"/healthz?slow-header-{secrets.token_hex(6)}"
    first = f"GET {probe} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()
    results = {}

    def run(name, url):
        results[name] = trickle(url, first, b"X-Drip: 1\r\n", window_seconds=TRICKLE_SECONDS)

    # The same probe straight at daphne, side by side: the problem the proxy is there for.
    threads = [threading.Thread(target=run, args=("proxy", topology.web_urls[0])),
               threading.Thread(target=run, args=("daphne", topology.daphne_urls[0]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results["proxy"]["closed"], results["proxy"]
    assert b"200 OK" not in results["proxy"]["answer"]
    assert not results["daphne"]["closed"], "daphne now times out slow headers by itself?"
    # nginx logged the cut request (408); daphne logged nothing for it.
    assert poll(lambda: probe in (topology.log_dir / "nginx-access.log").read_text(), 10)
    access = (topology.log_dir / "nginx-access.log").read_text()
    assert re.search(re.escape(probe) + r'[^"]*" 408 ', access), access[-2000:]
    httpx.get(topology.web_urls[0] + "/healthz", timeout=5)  # daphne's log is flushed by now
    assert not daphne_saw(topology, probe)


def test_a_stalled_body_is_cut_by_the_proxy_while_daphne_sees_nothing(topology):
    probe = f"/hooks/stalled-body-{secrets.token_hex(6)}"
    first = (f"POST {probe} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             f"Content-Length: 4096\r\n\r\n{{\"half\": ").encode()
    result = {}

    def stall(url):
        sock = socket.create_connection(address(url), timeout=5)
        sock.settimeout(TRICKLE_SECONDS)
        started = time.monotonic()
        try:
            sock.sendall(first)  # then nothing more
            try:
                result["answer"] = sock.recv(4096)
            except socket.timeout:
                result["answer"] = None
        finally:
            sock.close()
        result["after_seconds"] = time.monotonic() - started

    stall(topology.web_urls[1])
    assert result["answer"] is not None, "the proxy held a stalled body open"
    assert not daphne_saw(topology, probe)
    assert poll(lambda: probe in (topology.log_dir / "nginx-access.log").read_text(), 10)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_an_oversized_body_is_refused_by_the_proxy_before_daphne(topology, framing):
    probe = f"/hooks/oversized-{framing}-{secrets.token_hex(6)}"
    body = b"x" * (2 * 1024 * 1024)  # twice SWITCHBOARD_MAX_BODY_BYTES / client_max_body_size

    def chunks():
        for start in range(0, len(body), 64 * 1024):
            yield body[start:start + 64 * 1024]

    content = body if framing == "content-length" else chunks()
    try:
        answer = httpx.post(topology.web_urls[0] + probe, content=content, timeout=30,
                            headers={"Content-Type": "application/json"})
        status, server = answer.status_code, answer.headers.get("server", "")
    except httpx.HTTPError as exc:  # nginx may answer and close before the upload ends
        pytest.fail(f"no answer through the proxy: {exc!r}")
    assert status == 413 and server.startswith("nginx"), (status, server)
    assert not daphne_saw(topology, probe)


def test_a_body_within_the_cap_still_reaches_daphne(topology):
    probe = f"/hooks/within-cap-{secrets.token_hex(6)}"
    answer = httpx.post(topology.web_urls[0] + probe, content=b"{}", timeout=10,
                        headers={"Content-Type": "application/json"})
    assert answer.status_code == 404 and answer.headers["content-type"].startswith(
        "application/json")  # ingest's own answer for an unknown webhook
    assert poll(lambda: daphne_saw(topology, probe), 10)


def test_requests_in_progress_per_client_address_are_limited_by_the_proxy(topology):
    """limit_conn counts requests past their header: hold that many with a stalled body
    (daphne sees none of them), and the next request from the address is refused."""
    from tests.system.topology import NGINX_SITE

    (limit,) = re.findall(r"^\s*limit_conn switchboard_per_address (\d+);", NGINX_SITE.read_text(),
                          flags=re.MULTILINE)
    held = []
    try:
        for n in range(int(limit)):
            sock = socket.create_connection(address(topology.web_urls[0]), timeout=5)
            sock.sendall(f"POST /hooks/held-{n} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         "Content-Length: 100\r\n\r\n".encode())
            held.append(sock)
        refused = poll(lambda: httpx.get(topology.web_urls[1] + "/healthz",
                                         timeout=5).status_code == 429, 5)
        assert refused, "the per-address limit did not refuse a request over it"
    finally:
        for sock in held:
            sock.close()
    assert poll(lambda: httpx.get(topology.web_urls[1] + "/healthz", timeout=5).status_code == 200,
                10)


def test_sign_in_attempts_per_client_address_are_limited_by_the_proxy(topology):
    """A burst of sign-in requests from one address: past the zone's burst, 429 from nginx
    (switchboard itself locks only a (username, address) pair). From an address of its own
    (127.0.0.7), so other tests' sign-ins keep their budget."""
    transport = httpx.HTTPTransport(local_address="127.0.0.7")
    with httpx.Client(transport=transport, timeout=10) as client:
        statuses = [client.get(topology.web_urls[0] + "/accounts/login/").status_code
                    for _ in range(40)]
    assert 429 in statuses and statuses[0] == 200, statuses
    # Another address is not affected.
    assert httpx.get(topology.web_urls[0] + "/accounts/login/", timeout=10).status_code == 200
