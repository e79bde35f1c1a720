"""A plain-HTTP MCP client for long-poll claim_next (CONTRACT §6), shared by the end-to-end
tests and bench/push.py: raw httpx, so a test controls exactly when the connection opens,
what it Accepts and when it goes away (the SDK client hides all three)."""

import json
import time

import httpx

ACCEPT_BOTH = "application/json, text/event-stream"
PROTOCOL_VERSION = "2025-11-25"


async def open_session(http: httpx.AsyncClient, url: str, credential: str) -> dict:
    """initialize + notifications/initialized; returns the headers for the session's calls."""
    headers = {"Authorization": f"Bearer {credential}", "Accept": ACCEPT_BOTH,
               "Content-Type": "application/json"}
    reply = await http.post(url, headers=headers, json={
        "jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {"protocolVersion": PROTOCOL_VERSION, "capabilities": {},
                   "clientInfo": {"name": "long-poll-test", "version": "1"}}})
    reply.raise_for_status()
    headers = {**headers, "Mcp-Session-Id": reply.headers["mcp-session-id"],
               "Mcp-Protocol-Version": PROTOCOL_VERSION}
    await http.post(url, headers=headers,
                    json={"jsonrpc": "2.0", "method": "notifications/initialized"})
    return headers


def claim_next_body(wait_seconds: float, request_id: int = 1, **arguments) -> dict:
    return {"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
            "params": {"name": "claim_next",
                       "arguments": {"wait_seconds": wait_seconds, **arguments}}}


async def long_poll(http: httpx.AsyncClient, url: str, headers: dict, wait_seconds: float, *,
                    opened=None, request_id: int = 1, accept: str = ACCEPT_BOTH,
                    timeout: float | None = None):
    """One claim_next with ``wait_seconds``. Returns ``(structuredContent, perf_counter when
    the answer arrived)``. ``opened`` (an asyncio.Event) is set once the server is waiting
    (the SSE answer's first comment)."""
    body = claim_next_body(wait_seconds, request_id)
    async with http.stream("POST", url, json=body, headers={**headers, "Accept": accept},
                           timeout=timeout or wait_seconds + 30) as response:
        response.raise_for_status()
        if response.headers["content-type"].startswith("application/json"):
            message = json.loads(await response.aread())
            return message["result"]["structuredContent"], time.perf_counter()
        async for line in response.aiter_lines():
            if line.startswith(":") and opened is not None:
                opened.set()
            if line.startswith("data: "):
                message = json.loads(line[len("data: "):])
                if message.get("id") == request_id:
                    return message["result"]["structuredContent"], time.perf_counter()
    raise AssertionError("the long poll ended without an answer")
