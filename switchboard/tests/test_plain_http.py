"""Every route of the real ASGI application checks Host against ALLOWED_HOSTS (CONTRACT §12,
issue 15 item 9): the routes served without Django's middleware too."""

import asyncio
import json

import pytest
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator

from switchboard.http import plain
from channels_push.tests.conftest import ACCEPT_BOTH
from switchboard.asgi import application

pytestmark = pytest.mark.django_db(transaction=True)

ROUTES = [
    ("POST", "/mcp/some-agent", {"accept": ACCEPT_BOTH, "content-type": "application/json"}),
    ("GET", "/mcp/some-agent", {"accept": "text/event-stream"}),
    ("GET", "/todos/events", {"accept": "text/event-stream"}),
    ("POST", "/hooks/some-hook", {"content-type": "application/json"}),
    ("GET", "/static/admin/css/missing.css", {}),
    ("GET", "/healthz", {}),
]


def answer(method, path, headers):
    async def go():
        communicator = HttpCommunicator(
            application, method, path, body=b"{}",
            headers=[(k.encode(), v.encode()) for k, v in headers.items()])
        return await communicator.get_response(timeout=10)

    return async_to_sync(go)()


@pytest.mark.parametrize("method, path, headers", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
@pytest.mark.parametrize("host", ["evil.example", "127.0.0.1.nip.io:8000", "attacker:80"])
def test_a_host_outside_allowed_hosts_is_refused_on_every_route(method, path, headers, host):
    response = answer(method, path, {**headers, "host": host})
    assert response["status"] == 400
    if path != "/healthz":  # Django's own answer is its plain 400 page
        assert json.loads(response["body"])["error"]["code"] == "bad_request"


@pytest.mark.parametrize("method, path, headers", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_an_allowed_host_passes_the_check(method, path, headers):
    response = answer(method, path, {**headers, "host": "127.0.0.1:8000"})
    # Whatever the route then says (401 without a bearer, 403 anonymous, 404 unknown hook),
    # it is not the Host refusal.
    assert response["status"] != 400 or b"Host not allowed" not in response["body"]


def test_the_lean_thread_hop_runs_the_handler_off_the_loop_with_its_arguments():
    """``in_thread_pool`` (the servers' hop for MCP and hook handlers) passes positional and
    keyword arguments (the long poll's retry calls ``answer_post(request, woken=True)``), runs
    the handler in a pool thread, and raises what the handler raised."""
    import threading

    def handler(first, *, woken=False):
        if first == "boom":
            raise ValueError("boom")
        return first, woken, threading.current_thread()

    async def scenario():
        hop = plain.in_thread_pool(handler)
        first, woken, thread = await hop("request", woken=True)
        assert (first, woken) == ("request", True)
        assert thread is not threading.current_thread()
        with pytest.raises(ValueError):
            await hop("boom")

    asyncio.run(scenario())


def test_every_surface_answers_a_database_outage_with_the_one_answer(rf):
    """The hooks, the operator API, the board's streams and every Django view (through the
    middleware) answer what plain.database_unavailable_answer builds: 503, Retry-After, JSON."""
    from django.db import OperationalError

    from switchboard import health

    built = plain.database_unavailable_answer()
    assert built.status == 503 and int(built.headers["Retry-After"]) > 0
    assert json.loads(built.body) == {"error": {"code": "unavailable",
                                                "message": plain.DATABASE_UNAVAILABLE_MESSAGE}}
    middleware = health.DatabaseUnavailableMiddleware(lambda request: None)
    response = middleware.process_exception(rf.get("/todos/"), OperationalError("gone"))
    assert (response.status_code, response.content) == (503, built.body)
    assert response["Retry-After"] == built.headers["Retry-After"]
    assert response["Content-Type"] == "application/json"
