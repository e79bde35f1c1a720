"""Protocol behaviour of /mcp/<slug>, in-process through the real ASGI application."""

import json

import pytest
from django.conf import settings
from django.test import override_settings
from hypothesis import HealthCheck, example, given, settings as hypothesis_settings
from hypothesis import strategies as st

from channels_push.mcp import framing as mcp_framing
from channels_push.mcp import security as mcp_security
from channels_push.mcp import shell as mcp_shell
from channels_push.models import McpSession
from channels_push.tests.conftest import McpDriver
from switchboard.http import origins
from todos import transitions
from todos.models import Todo, TodoEvent


def error_code(reply):
    return reply.json["error"]["code"]


# -- initialize ----------------------------------------------------------------------------------


def test_initialize_mints_a_session_row_and_answers_per_contract(mcp):
    reply = mcp.initialize()
    result = reply.json["result"]
    assert reply.status == 200
    assert result["protocolVersion"] == "2025-11-25"
    assert result["capabilities"]["tools"] == {}
    assert result["capabilities"]["logging"] == {}
    assert result["capabilities"]["experimental"] == {"claude/channel": {}}
    assert result["serverInfo"]["name"] == "switchboard"
    instructions = result["instructions"]
    assert len(instructions) <= 2048
    assert "300 seconds" in instructions
    assert "meta.todo_id" in instructions and "digest" in instructions
    assert "claim_next" in instructions and "<channel>" in instructions
    session = McpSession.objects.get(pk=mcp.session_id)
    assert session.endpoint_id == mcp.endpoint.pk
    assert session.protocol_version == "2025-11-25"
    assert session.client_name == "pytest"
    assert all(0x21 <= ord(ch) <= 0x7E for ch in session.pk)


def test_instructions_name_the_endpoints_own_lease(vend):
    endpoint, credential = vend(slug="slow-agent", default_lease_seconds=900)
    reply = McpDriver(endpoint.slug, credential).initialize()
    assert "900 seconds" in reply.json["result"]["instructions"]


@pytest.mark.parametrize("offered, agreed", [
    ("2025-03-26", "2025-03-26"), ("2025-06-18", "2025-06-18"), ("2024-11-05", "2025-11-25"),
    ("2099-01-01", "2025-11-25"),
])
def test_initialize_negotiates_a_supported_version(mcp, offered, agreed):
    reply = mcp.initialize(protocolVersion=offered)
    assert reply.json["result"]["protocolVersion"] == agreed
    assert McpSession.objects.get(pk=mcp.session_id).protocol_version == agreed


def test_initialize_without_protocol_version_is_invalid_params(mcp):
    reply = mcp.rpc("initialize", {"capabilities": {}})
    assert reply.status == 400 and error_code(reply) == mcp_framing.INVALID_PARAMS
    assert not McpSession.objects.exists()


def test_ping_and_tools_list(mcp):
    mcp.initialize()
    assert mcp.rpc("ping").json == {"jsonrpc": "2.0", "id": 1, "result": {}}
    tools = mcp.rpc("tools/list").json["result"]["tools"]
    names = [tool["name"] for tool in tools]
    assert names == ["list_todos", "claim", "claim_next", "heartbeat", "complete", "fail",
                     "cancel", "release", "post_update", "repo_token", "read_secret", "clock_in",
                     "clock_out"]
    assert all(tool["inputSchema"]["type"] == "object" and tool["description"] for tool in tools)


def test_logging_set_level_is_accepted_and_validated(mcp):
    mcp.initialize()
    assert mcp.rpc("logging/setLevel", {"level": "warning"}).json["result"] == {}
    assert error_code(mcp.rpc("logging/setLevel", {"level": "loud"})) == -32602


def test_tools_list_shows_only_allowed_verbs(vend):
    endpoint, credential = vend(slug="narrow", verbs=["claim_next", "complete"])
    driver = McpDriver(endpoint.slug, credential)
    driver.initialize()
    assert [t["name"] for t in driver.rpc("tools/list").json["result"]["tools"]] == [
        "claim_next", "complete"]


# -- protocol faults: none of them a 500 ---------------------------------------------------------


def test_missing_bearer_is_401_with_challenge(mcp):
    reply = mcp.rpc("initialize", {}, authorization=None)
    assert reply.status == 401
    assert reply.headers["www-authenticate"].startswith("Bearer")


def test_wrong_bearer_is_401(mcp):
    reply = mcp.rpc("ping", authorization="Bearer sbk_not-a-real-one")
    assert reply.status == 401 and reply.headers["www-authenticate"].startswith("Bearer")


def test_valid_bearer_on_another_endpoints_url_is_401(mcp, vend):
    other, _ = vend(slug="other-agent")
    reply = mcp.request("POST", json.dumps({"jsonrpc": "2.0", "id": 1, "method": "ping"}).encode(),
                        path=f"/mcp/{other.slug}")
    assert reply.status == 401


def test_session_of_another_endpoint_is_404(mcp, vend):
    other, other_credential = vend(slug="other-agent")
    theirs = McpDriver(other.slug, other_credential)
    theirs.initialize()
    mcp.session_id = theirs.session_id
    assert mcp.rpc("ping").status == 404
    assert mcp.request("GET", accept="text/event-stream").status == 404
    assert mcp.request("DELETE").status == 404
    assert McpSession.objects.get(pk=theirs.session_id).terminated_at is None


def test_rotated_out_and_deactivated_credentials_stop_on_their_next_request(mcp):
    # Nothing about a verified bearer is remembered between requests (CONTRACT §6: rotation
    # and deactivation take effect at once), on a live session too.
    from datetime import timedelta

    from endpoints import transitions as endpoint_transitions
    from endpoints.models import Endpoint

    mcp.initialize()
    assert mcp.rpc("ping").status == 200
    new_credential = endpoint_transitions.rotate_credential(mcp.endpoint, grace=timedelta(0))
    assert mcp.rpc("ping").status == 401
    mcp.credential = new_credential
    # The session is bound to the credential that opened it (CONTRACT §12): the new one must
    # initialize its own.
    assert mcp.rpc("ping").status == 404
    mcp.initialize()
    assert mcp.rpc("ping").status == 200
    Endpoint.objects.filter(pk=mcp.endpoint.pk).update(active=False)
    assert mcp.rpc("ping").status == 401


def test_a_tool_call_checks_bearer_and_session_in_one_query(mcp, django_assert_num_queries,
                                                           django_assert_max_num_queries):
    mcp.initialize()
    with django_assert_num_queries(1):
        assert mcp.rpc("ping").status == 200
    # The check and the claim's one statement (SQLite adds a savepoint around it).
    with django_assert_max_num_queries(4) as captured:
        assert mcp.rpc("tools/call", {"name": "claim_next", "arguments": {}}).status == 200
    checks = [q["sql"] for q in captured.captured_queries
              if "endpoints_" in q["sql"] or "channels_push_mcpsession" in q["sql"]]
    assert len(checks) == 1


def test_last_seen_is_written_only_when_older_than_the_touch_interval(mcp):
    from django.utils import timezone

    mcp.initialize()
    recent = timezone.now() - mcp_security.SESSION_TOUCH_INTERVAL / 2
    McpSession.objects.filter(pk=mcp.session_id).update(last_seen_at=recent)
    assert mcp.rpc("ping").status == 200
    assert McpSession.objects.get(pk=mcp.session_id).last_seen_at == recent
    stale = timezone.now() - mcp_security.SESSION_TOUCH_INTERVAL * 2
    McpSession.objects.filter(pk=mcp.session_id).update(last_seen_at=stale)
    assert mcp.rpc("ping").status == 200
    assert McpSession.objects.get(pk=mcp.session_id).last_seen_at > recent


def test_missing_session_is_400_and_unknown_is_404(mcp):
    assert mcp.rpc("ping").status == 400
    mcp.session_id = "no-such-session"
    assert mcp.rpc("ping").status == 404
    mcp.session_id = "bad id with spaces"
    assert mcp.rpc("ping").status == 404


def test_parse_error_batch_and_non_object(mcp):
    mcp.initialize()
    reply = mcp.post(b"{oops")
    assert reply.status == 400 and error_code(reply) == -32700 and reply.json["id"] is None
    batch = mcp.post([{"jsonrpc": "2.0", "id": 1, "method": "ping"}])
    assert batch.status == 400 and error_code(batch) == -32600
    assert error_code(mcp.post(b'"ping"')) == -32600
    assert error_code(mcp.post(b"null")) == -32600


def test_unknown_method_is_32601(mcp):
    mcp.initialize()
    reply = mcp.rpc("resources/list", request_id="r-9")
    assert reply.status == 200
    assert reply.json["id"] == "r-9" and error_code(reply) == -32601


def test_only_an_unknown_tool_or_non_object_arguments_are_32602(mcp):
    mcp.initialize()
    assert error_code(mcp.rpc("tools/call", {"name": "drop_table"})) == -32602
    assert error_code(mcp.rpc("tools/call", {"name": "claim", "arguments": "1"})) == -32602


@pytest.mark.parametrize("tool, arguments, named, expected", [
    ("claim", {}, "todo_id", "missing; expected a string or an integer"),
    ("claim", {"todo_id": ["1"]}, "todo_id", "expected a string or an integer, got list"),
    ("claim", {"todo_id": None}, "todo_id", "got None (null)"),
    ("claim_next", {"surprise": 1}, "surprise", "unknown argument; claim_next takes queues"),
    ("list_todos", {"limit": "10"}, "limit", "expected an integer from 1 to 200, got '10'"),
    ("list_todos", {"limit": 0}, "limit", "expected an integer from 1 to 200, got 0"),
    ("heartbeat", {"todo_id": "1", "lease_ttl_seconds": "soon"}, "lease_ttl_seconds",
     "expected a number from 1 to 86400"),
    ("claim_next", {"queues": "inbox"}, "queues", "expected a non-empty list of strings"),
    ("fail", {"todo_id": "1", "error": {"x": 1}}, "error", "expected a string, got object"),
])
def test_schema_violations_are_tool_results_the_model_sees(mcp, tool, arguments, named, expected):
    """Issue 13.6 (SEP-1303): wrong-type, missing and unknown arguments were JSON-RPC -32602
    errors, which clients do not show the model; they are isError tool results naming the
    argument and what it expects."""
    mcp.initialize()
    reply = mcp.rpc("tools/call", {"name": tool, "arguments": arguments})
    assert reply.status == 200 and "error" not in reply.json, reply.json
    result = reply.json["result"]
    assert result["isError"] is True
    error = result["structuredContent"]["error"]
    assert error["code"] == "invalid_argument"
    assert error["message"].startswith(f"{named}: ") and expected in error["message"], error


def test_bad_accept_is_406(mcp):
    mcp.initialize()
    assert mcp.rpc("ping", accept="text/html").status == 406
    assert mcp.rpc("ping", accept=None).status == 406
    assert mcp.rpc("ping", accept="application/json;q=0").status == 406
    assert mcp.rpc("ping", accept="*/*").status == 200
    assert mcp.request("GET", accept="application/json").status == 406


def test_wrong_content_type_is_415(mcp):
    mcp.initialize()
    assert mcp.rpc("ping", content_type="text/plain").status == 415


@pytest.mark.parametrize("origin", [
    "http://evil.example.com", "null", "file://x", "http://127.0.0.1.evil.example.com:8000",
    # Parsers disagree on these: a browser's host is "evil", Python's urlsplit says 127.0.0.1.
    "http://evil\\@127.0.0.1:8000", "http://evil@127.0.0.1:8000", "http://127.0.0.1:8000\\@evil",
    # Another port or scheme of the same host is another origin (another local web app).
    "http://localhost:5173", "http://127.0.0.1:8001", "https://127.0.0.1:8000",
    "http://127.0.0.1", "http://localhost:8000", "http://127.0.0.1:8000/", "http://127.0.0.1:8000#x",
    " ", "http://", "http://[::1]:8000",
])
def test_any_origin_but_the_configured_ones_is_403(mcp, origin):
    assert mcp.rpc("initialize", {}, origin=origin).status == 403
    assert not McpSession.objects.exists()


INIT = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "x", "version": "1"}}


@pytest.mark.parametrize("origin", ["http://127.0.0.1:8000", "HTTP://127.0.0.1:8000"])
def test_the_public_urls_origin_is_allowed(mcp, origin):
    assert settings.SWITCHBOARD_PUBLIC_URL == "http://127.0.0.1:8000"
    assert mcp.rpc("initialize", INIT, origin=origin).status == 200


@pytest.mark.parametrize("origin, status", [
    ("https://switchboard.example.org", 200), ("https://switchboard.example.org:443", 200),
    ("http://localhost:6274", 200), ("http://switchboard.example.org", 403),
    ("https://switchboard.example.org:8443", 403), ("http://localhost:6275", 403),
])
def test_configured_origins_are_compared_by_scheme_host_and_port(mcp, origin, status):
    allowed = [origins.parse_origin("https://switchboard.example.org/", allow_path=True),
               origins.parse_origin("http://localhost:6274")]
    with override_settings(SWITCHBOARD_ALLOWED_ORIGINS=allowed):
        assert mcp.rpc("initialize", INIT, origin=origin).status == status


def test_unsupported_protocol_version_header_is_400(mcp):
    mcp.initialize()
    reply = mcp.rpc("ping", mcp_protocol_version="1999-01-01")
    assert reply.status == 400
    assert error_code(reply) == mcp_framing.UNSUPPORTED_PROTOCOL_VERSION
    assert reply.json["error"]["data"]["supported"] == list(mcp_framing.SUPPORTED_PROTOCOL_VERSIONS)
    assert mcp.rpc("ping", mcp_protocol_version="2025-06-18").status == 200


def test_probe_for_the_sessionless_era_is_answered_so_clients_fall_back(mcp):
    reply = mcp.rpc("server/discover", {}, mcp_protocol_version="2026-07-28")
    assert reply.status == 400
    assert error_code(reply) == -32022
    assert "2025-11-25" in reply.json["error"]["data"]["supported"]
    # The same probe without the header (an older probe shape) gets the same answer.
    assert error_code(mcp.rpc("server/discover", {})) == -32022


@pytest.mark.parametrize("method", ["server/discover", "initialize", "tools/list"])
def test_version_refusal_echoes_the_request_id_and_lists_the_versions(mcp, method):
    reply = mcp.rpc(method, {"protocolVersion": "2026-07-28"}, request_id="probe-7",
                    mcp_protocol_version="2026-07-28")
    assert reply.status == 400 and error_code(reply) == -32022
    assert reply.json["id"] == "probe-7"
    assert reply.json["error"]["data"] == {
        "supported": ["2025-11-25", "2025-06-18", "2025-03-26"], "requested": "2026-07-28"}
    # A body that is no JSON-RPC request has no id to echo: null, still the same refusal.
    reply = mcp.post(b"{not json", mcp_protocol_version="2026-07-28")
    assert reply.status == 400 and error_code(reply) == -32022 and reply.json["id"] is None


def test_notifications_and_responses_are_202(mcp):
    mcp.initialize()
    assert mcp.post({"jsonrpc": "2.0", "method": "notifications/cancelled",
                     "params": {"requestId": 1}}).status == 202
    assert mcp.post({"jsonrpc": "2.0", "id": 5, "result": {}}).status == 202


@pytest.mark.parametrize("method", ["PUT", "PATCH", "OPTIONS", "HEAD"])
def test_other_methods_are_405_with_allow(mcp, method):
    reply = mcp.request(method)
    assert reply.status == 405
    assert reply.headers["allow"] == "GET, POST, DELETE"


@override_settings(SWITCHBOARD_MAX_BODY_BYTES=200)
def test_body_over_the_cap_is_413(mcp):
    reply = mcp.rpc("initialize", {"padding": "x" * 300})
    assert reply.status == 413
    assert not McpSession.objects.exists()


@override_settings(SWITCHBOARD_MCP_RATE_PER_MINUTE=3)
def test_rate_limit_is_per_credential_with_retry_after(mcp, vend):
    mcp.initialize()  # initialize + initialized notification: two tokens
    assert mcp.rpc("ping").status == 200
    limited = mcp.rpc("ping")
    assert limited.status == 429
    assert int(limited.headers["retry-after"]) >= 1
    other, credential = vend(slug="other-agent")
    assert McpDriver(other.slug, credential).rpc("ping").status == 400  # its own budget


def test_trailing_slash_is_served_without_redirect(mcp):
    reply = mcp.request("POST", json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                                            "params": {"protocolVersion": "2025-11-25"}}).encode(),
                        path=f"/mcp/{mcp.slug}/")
    assert reply.status == 200


def test_delete_ends_the_session(mcp):
    mcp.initialize()
    assert mcp.request("DELETE").status == 204
    assert McpSession.objects.get(pk=mcp.session_id).terminated_at is not None
    assert mcp.rpc("ping").status == 404
    assert mcp.request("DELETE").status == 404
    assert mcp.request("GET", accept="text/event-stream").status == 404


def test_answers_declare_their_length_but_a_204_does_not(mcp):
    reply = mcp.initialize()
    assert reply.headers["content-length"] == str(len(reply.body))
    refused = mcp.rpc("ping", authorization=None)
    assert refused.headers["content-length"] == str(len(refused.body))
    assert "content-length" not in mcp.request("DELETE").headers


def test_tool_refusal_is_a_result_not_an_error(mcp):
    mcp.initialize()
    reply = mcp.call("claim", {"todo_id": "424242"})
    result = reply["result"]
    assert result["isError"] is True
    assert result["structuredContent"] == {"error": {"code": "not_found",
                                                     "message": "no todo 424242"}}
    assert json.loads(result["content"][0]["text"]) == result["structuredContent"]


def test_a_bearer_never_reaches_the_logs(mcp, caplog):
    mcp.initialize()
    mcp.rpc("ping", authorization="Bearer sbk_wrong-secret-value")
    mcp.call("claim_next")
    assert mcp.credential not in caplog.text
    assert "sbk_wrong-secret-value" not in caplog.text


# -- fuzz ----------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6),
                                                                      children, max_size=3),
    max_leaves=8,
)
methods = st.sampled_from(["ping", "tools/list", "tools/call", "claim", "server/discover",
                           "notifications/initialized", "resources/list", ""]) | st.text(max_size=12)
tool_calls = st.fixed_dictionaries({
    "name": st.sampled_from(["claim", "claim_next", "complete", "fail", "release", "list_todos",
                             "heartbeat", "read_secret", "nope"]),
    "arguments": st.dictionaries(st.sampled_from(["todo_id", "lease_id", "queues", "limit", "x"]),
                                 json_values, max_size=3) | json_values,
})
messages = st.fixed_dictionaries(
    {},
    optional={"jsonrpc": st.sampled_from(["2.0", "1.0"]) | json_values,
              "id": st.integers() | st.text(max_size=5) | json_values,
              "method": methods, "params": tool_calls | json_values,
              "result": json_values, "error": json_values},
)
bodies = messages.map(lambda m: json.dumps(m).encode()) | st.binary(max_size=64) | \
    json_values.map(lambda v: json.dumps(v).encode())
sessions = st.sampled_from([None, "unknown-session", "x" * 80, "\u00e9t\u00e9"])


@hypothesis_settings(max_examples=120, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, session=sessions)
def test_random_jsonrpc_bodies_never_500_and_change_nothing_without_a_session(mcp, body, session):
    if not Todo.objects.filter(endpoint=mcp.endpoint).exists():
        transitions.create_todo(endpoint=mcp.endpoint, queue="inbox", title="t",
                                          actor="test")
    events_before = TodoEvent.objects.count()
    sessions_before = McpSession.objects.count()
    mcp.session_id = session if session is None or session.isascii() else None
    reply = mcp.post(body)
    assert reply.status < 500
    assert reply.status in (200, 400, 404)
    if reply.status == 200:  # only initialize can succeed without a session
        assert json.loads(body)["method"] == "initialize"
        McpSession.objects.filter(endpoint=mcp.endpoint).delete()
    assert TodoEvent.objects.count() == events_before
    assert McpSession.objects.count() == sessions_before
    assert set(Todo.objects.values_list("state", flat=True)) == {"pending"}


@pytest.mark.parametrize("method", ["\ud800", "tools/\udfff", "a\x00b"])
@pytest.mark.parametrize("with_session", [False, True], ids=["no session", "live session"])
def test_a_method_with_a_lone_surrogate_or_nul_is_a_jsonrpc_error_not_a_500(mcp, method,
                                                                           with_session):
    if with_session:
        mcp.initialize()
    for message in ({"jsonrpc": "2.0", "id": 9, "method": method},
                    {"jsonrpc": "2.0", "method": method}):  # a request, a notification
        reply = mcp.post(json.dumps(message).encode())
        assert reply.status == 400, (message, reply.status, reply.body)
        if with_session:  # without one, the missing session is what the answer names
            assert reply.json["error"]["code"] == -32600
            assert "method" in reply.json["error"]["message"]
            assert reply.json["id"] == message.get("id")


def test_an_id_with_a_lone_surrogate_is_not_echoed_into_a_500(mcp):
    mcp.initialize()
    reply = mcp.post(json.dumps({"jsonrpc": "2.0", "id": "\ud800", "method": "ping"}).encode())
    assert reply.status == 400, (reply.status, reply.body)
    assert reply.json["error"]["code"] == -32600 and reply.json["id"] is None
    assert "id" in reply.json["error"]["message"]


# Values a client can really send: floats with NaN/Infinity/overflow (written as bare JSON
# tokens), NUL characters and lone surrogates, huge integers.
hostile_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=2**63) | st.floats()
    | st.text(max_size=8) | st.sampled_from(["\x00", "a\x00b", "\ud800", "\u0661", " 1"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6),
                                                                      children, max_size=3),
    max_leaves=8,
)
live_tool_calls = st.fixed_dictionaries({
    "name": st.sampled_from(["claim", "claim_next", "complete", "fail", "release", "list_todos",
                             "heartbeat", "post_update", "read_secret", "clock_in",
                             "clock_out"]),
    "arguments": st.dictionaries(
        st.sampled_from(["todo_id", "lease_id", "lease_ttl_seconds", "queues", "queue", "state",
                         "limit", "result", "error", "ref", "text"]), hostile_values, max_size=4),
})


@hypothesis_settings(max_examples=150, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(call=live_tool_calls)
@example(call={"name": "complete", "arguments": {"todo_id": 0, "result": {"log": "a\x00b"}}})
@example(call={"name": "fail", "arguments": {"todo_id": 0, "error": "bad\x00error"}})
@example(call={"name": "claim", "arguments": {"todo_id": 0, "lease_ttl_seconds": 10**30}})
def test_random_tool_calls_on_a_live_session_never_500(mcp, call):
    """Past the session check: every tool with hostile arguments answers a result or a
    JSON-RPC error, never a 500 (NaN from the wire arrives as the bare token)."""
    if mcp.session_id is None:
        assert mcp.initialize().status == 200
    todo, _ = transitions.create_todo(endpoint=mcp.endpoint, queue="inbox", title="t", actor="t")
    arguments = dict(call["arguments"])
    if arguments.get("todo_id") == 0:  # aim at a real todo, claimed by this session
        arguments["todo_id"] = str(todo.pk)
        mcp.call("claim", {"todo_id": str(todo.pk)})
    body = json.dumps({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                       "params": {"name": call["name"], "arguments": arguments}})
    reply = mcp.post(body.encode())
    assert reply.status in (200, 400), (reply.status, body)


def test_the_asgi_application_routes_mcp_to_the_endpoint_in_the_thread_pool():
    from switchboard.asgi import http_routes

    route = http_routes[0]
    assert route.pattern.regex.pattern == mcp_shell.ROUTE_PATTERN
    # It checks Host itself (test_plain_http covers every route's refusal).
    assert isinstance(route.callback, mcp_shell.McpEndpoint)
    assert route.callback.thread_sensitive is False
