"""Helpers for driving /mcp/<slug> in-process with channels.testing communicators."""

import json
from dataclasses import dataclass

import pytest
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator

from endpoints import transitions as endpoint_transitions
from channels.routing import URLRouter
from django.urls import re_path

from channels_push.doorbells import doorbells
from channels_push.mcp import shell as mcp_shell

# The production route, with the handler on the test's thread so it sees the test transaction
# (McpEndpoint's thread_sensitive; production runs handlers in the pool).
application = URLRouter([
    re_path(mcp_shell.ROUTE_PATTERN, mcp_shell.McpEndpoint(thread_sensitive=True)),
])
from tests.factories import UserFactory
from tests.processes import DEADLINE_SECONDS
from todos import transitions

INIT_PARAMS = {"protocolVersion": "2025-11-25", "capabilities": {},
               "clientInfo": {"name": "pytest", "version": "1"}}
ACCEPT_BOTH = "application/json, text/event-stream"


@dataclass
class Reply:
    status: int
    headers: dict
    body: bytes

    @property
    def json(self):
        return json.loads(self.body)


class McpDriver:
    """Sends one HTTP request per call through the real ASGI application."""

    def __init__(self, slug, credential):
        self.slug = slug
        self.credential = credential
        self.session_id = None

    def headers(self, **overrides):
        headers = {"host": "localhost", "authorization": f"Bearer {self.credential}",
                   "accept": ACCEPT_BOTH, "content-type": "application/json"}
        if self.session_id:
            headers["mcp-session-id"] = self.session_id
        for name, value in overrides.items():
            name = name.replace("_", "-")
            if value is None:
                headers.pop(name, None)
            else:
                headers[name] = value
        return headers

    def request(self, method, body=b"", *, path=None, **header_overrides) -> Reply:
        headers = [(k.encode(), v.encode()) for k, v in self.headers(**header_overrides).items()]

        async def go():
            communicator = HttpCommunicator(application, method, path or f"/mcp/{self.slug}",
                                            body=body, headers=headers)
            return await communicator.get_response(timeout=DEADLINE_SECONDS)

        response = async_to_sync(go)()
        return Reply(response["status"],
                     {k.decode().lower(): v.decode() for k, v in response["headers"]},
                     response.get("body", b""))

    def post(self, message, **header_overrides) -> Reply:
        body = message if isinstance(message, bytes) else json.dumps(message).encode()
        return self.request("POST", body, **header_overrides)

    def rpc(self, method, params=None, *, request_id=1, **header_overrides) -> Reply:
        message = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        return self.post(message, **header_overrides)

    def initialize(self, **params) -> Reply:
        reply = self.rpc("initialize", {**INIT_PARAMS, **params})
        assert reply.status == 200, reply.body
        self.session_id = reply.headers["mcp-session-id"]
        self.post({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return reply

    def call_status(self, tool, arguments=None) -> int:
        return self.rpc("tools/call", {"name": tool, "arguments": arguments or {}}).status

    def call(self, tool, arguments=None) -> dict:
        reply = self.rpc("tools/call", {"name": tool, "arguments": arguments or {}})
        assert reply.status == 200, reply.body
        return reply.json


@pytest.fixture
def vend(db):
    def vend(slug="agent-mcp", **kwargs):
        owner = UserFactory(username=f"owner-{slug}")
        endpoint, credential = endpoint_transitions.vend_endpoint(slug=slug, owner=owner, **kwargs)
        return endpoint, credential

    return vend


@pytest.fixture
def mcp(vend):
    endpoint, credential = vend()
    driver = McpDriver(endpoint.slug, credential)
    driver.endpoint = endpoint
    return driver


def make_ready_todo(endpoint, queue="inbox", title="a todo", *, trust="signed", attributed=True,
                    **kwargs):
    """A todo as a verified delivery creates it: a delivery event (attributed to the endpoint's
    owner unless ``attributed`` is False) and the todo, committed and announced."""
    from django.utils import timezone

    from ingest.models import DeliveryEvent

    event = DeliveryEvent.objects.create(
        trust=trust, received_at=kwargs.get("now") or timezone.now(),
        attributed_to=endpoint.owner if attributed else None)
    todo, _ = transitions.create_todo(endpoint=endpoint, queue=queue, title=title, actor="test",
                                      delivery_event=event, trust=trust, **kwargs)
    return todo


def make_ready_todos_at_once(endpoint, count, queue="inbox", **kwargs) -> list:
    """``count`` todos as ``make_ready_todo`` makes them, committed at once from ``count``
    threads released together (each rings after its own commit: publishers racing for the
    endpoint's sessions, as several web processes do). Returns them; re-raises the first
    thread's failure."""
    import threading

    from django.db import connection

    barrier, made, failures = threading.Barrier(count), [], []

    def make(number):
        try:
            barrier.wait()
            made.append(make_ready_todo(endpoint, queue, f"at once {number}", **kwargs))
        except Exception as exc:  # a thread's exception is otherwise lost
            failures.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=make, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return made


@pytest.fixture
def digests(monkeypatch):
    """Every digest send_doorbell hands to the channel layer: (session_id, params)."""
    sent = []
    real = doorbells.send_doorbell

    def record(session_id, params, context):
        if doorbells.is_digest(params):
            sent.append((session_id, params))
        return real(session_id, params, context)

    monkeypatch.setattr(doorbells, "send_doorbell", record)
    return sent
