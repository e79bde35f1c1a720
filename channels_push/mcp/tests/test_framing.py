import pytest

from channels_push.mcp import framing


def test_parse_request_notification_and_response():
    request = framing.parse_message(b'{"jsonrpc":"2.0","id":7,"method":"ping"}')
    assert (request.kind, request.method, request.id) == ("request", "ping", 7)
    note = framing.parse_message(b'{"jsonrpc":"2.0","method":"notifications/initialized"}')
    assert note.kind == "notification" and note.id is None
    response = framing.parse_message(b'{"jsonrpc":"2.0","id":"a","result":{}}')
    assert response.kind == "response"


@pytest.mark.parametrize("body, code", [
    (b"{not json", framing.PARSE_ERROR),
    (b"\xff\xfe", framing.PARSE_ERROR),
    # Not JSON although Python's json takes them: NaN, Infinity, numbers that overflow to inf,
    # and nesting deep enough to exhaust the parser's recursion.
    (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"x":NaN}}', framing.PARSE_ERROR),
    (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"x":-Infinity}}', framing.PARSE_ERROR),
    (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"x":1e400}}', framing.PARSE_ERROR),
    (b"[" * 100_000, framing.PARSE_ERROR),
    (b'[{"jsonrpc":"2.0","id":1,"method":"ping"}]', framing.INVALID_REQUEST),
    (b'"ping"', framing.INVALID_REQUEST),
    (b"42", framing.INVALID_REQUEST),
    (b'{"jsonrpc":"1.0","id":1,"method":"ping"}', framing.INVALID_REQUEST),
    (b'{"jsonrpc":"2.0","id":1,"method":5}', framing.INVALID_REQUEST),
    (b'{"jsonrpc":"2.0","id":1,"method":"x","params":[1]}', framing.INVALID_PARAMS),
    (b'{"jsonrpc":"2.0","id":null,"method":"ping"}', framing.INVALID_REQUEST),
    (b'{"jsonrpc":"2.0","id":true,"method":"ping"}', framing.INVALID_REQUEST),
    (b'{"jsonrpc":"2.0","id":1}', framing.INVALID_REQUEST),
])
def test_malformed_messages_raise_the_jsonrpc_code(body, code):
    with pytest.raises(framing.JsonRpcError) as raised:
        framing.parse_message(body)
    assert raised.value.code == code


def test_framing_error_keeps_a_readable_id():
    with pytest.raises(framing.JsonRpcError) as raised:
        framing.parse_message(b'{"jsonrpc":"1.0","id":"r1","method":"ping"}')
    assert raised.value.request_id == "r1"


def test_error_envelope_keeps_null_id():
    envelope = framing.error_envelope(None, -32700, "Parse error")
    assert envelope == {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "Parse error"}}


def test_result_envelope_drops_modern_only_fields():
    import mcp.types as types

    envelope = framing.result_envelope(3, types.ListToolsResult(tools=[]))
    assert envelope == {"jsonrpc": "2.0", "id": 3, "result": {"tools": []}}


@pytest.mark.parametrize("request_id", [7, "req-1"])
@pytest.mark.parametrize("result", [
    {}, {"tools": []},
    "call_tool_result", "call_tool_refusal",
], ids=["empty", "dict", "tool-result", "tool-refusal"])
def test_result_envelope_is_what_the_sdk_response_type_dumps(request_id, result):
    # result_envelope builds the dict itself (no model round trip per call): it must stay
    # exactly the SDK's JSONRPCResponse dump.
    import mcp.types as types

    if result == "call_tool_result":
        result = types.CallToolResult(
            content=[types.TextContent(text='{"todo": {"id": "1"}}')],
            structured_content={"todo": {"id": "1", "payload": {"a": [1, 2.5, None, "x"]}}},
            is_error=False)
    elif result == "call_tool_refusal":
        result = types.CallToolResult(
            content=[types.TextContent(text="refused")],
            structured_content={"error": {"code": "lease_lost", "message": "m"}}, is_error=True)
    wire = result if isinstance(result, dict) else framing.dump_result(result)
    expected = types.JSONRPCResponse(jsonrpc="2.0", id=request_id, result=wire).model_dump(
        by_alias=True, mode="json")
    assert framing.result_envelope(request_id, result) == expected
