"""PostgreSQL unreachable (CONTRACT §12, issue 15 item 5): a real daphne process whose
DATABASE_URL names a port where nothing listens (never the shared PostgreSQL). ``/mcp``, the
board and its stream answer 503 + Retry-After with a JSON body, as ``/hooks`` does, and
``/readyz`` gives up on the database after its 1 s probe timeout instead of the pool's 5 s."""

import httpx
import pytest
from django.conf import settings

from tests.servers import free_port

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def database_down(start_daphne):
    if not settings.DATABASES["default"]["ENGINE"].endswith("postgresql"):
        pytest.skip("the PostgreSQL production shape; the embedded SQLite file cannot go away")
    return start_daphne(DATABASE_URL=f"postgres://postgres@127.0.0.1:{free_port()}/gone")


def assert_unavailable(answer):
    assert answer.status_code == 503, answer.text
    assert int(answer.headers["retry-after"]) > 0
    assert answer.headers["content-type"].startswith("application/json")
    return answer.json()


def test_mcp_answers_503_with_retry_after_when_postgresql_is_down(database_down):
    body = assert_unavailable(httpx.post(
        f"{database_down.url}/mcp/any-endpoint", timeout=30,
        headers={"Authorization": "Bearer sbk_whatever", "Content-Type": "application/json",
                 "Accept": "application/json, text/event-stream"},
        json={"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"protocolVersion": "2025-11-25", "capabilities": {}}}))
    assert body["error"]["message"].startswith("Service Unavailable")
    assert "Traceback" not in database_down.log_text()


def test_the_board_and_its_stream_answer_503_when_postgresql_is_down(database_down):
    cookies = {settings.SESSION_COOKIE_NAME: "a-session-key-that-needs-the-database"}
    page = assert_unavailable(httpx.get(f"{database_down.url}/todos/", cookies=cookies,
                                        timeout=30))
    assert page["error"]["code"] == "unavailable"
    assert_unavailable(httpx.get(f"{database_down.url}/todos/events", cookies=cookies,
                                 timeout=30, headers={"Accept": "text/event-stream"}))
    # A webhook page's stream is a board stream: the same answer.
    assert_unavailable(httpx.get(f"{database_down.url}/todos/webhooks/gh/events",
                                 cookies=cookies, timeout=30,
                                 headers={"Accept": "text/event-stream"}))
    assert "Traceback" not in database_down.log_text()


def test_readyz_gives_up_on_the_database_after_its_probe_timeout(database_down):
    answer = httpx.get(f"{database_down.url}/readyz", timeout=30)
    assert answer.status_code == 503
    assert answer.json()["checks"]["database"] == "error: timeout"
