"""An operator hands over a todo with secrets; the agent sees only refs in the payload and
fetches the value with the read_secret verb — only on its own endpoint and scope."""

import json

import pytest

from channels_push.mcp import tools as mcp_tools
from endpoints import transitions as endpoint_transitions
from ingest import transitions as ingest_transitions
from tests.factories import EndpointFactory

pytestmark = pytest.mark.django_db


def call(endpoint, name, arguments):
    result = mcp_tools.call_tool(endpoint=endpoint, session_id="s",
                                 params={"name": name, "arguments": arguments})
    return result.is_error, result.structured_content


def test_secret_handed_over_is_read_back_by_ref_and_only_in_scope(client, operator):
    endpoint, _ = endpoint_transitions.vend_endpoint(slug="deployer", owner=operator,
                                                     scope=["deploys", "other"])
    narrow = EndpointFactory(slug="narrow", owner=operator, scope=["other"])
    token = ingest_transitions.mint_operator_token(user=operator, name="cli")[1]
    answer = client.post(
        "/api/v1/endpoints/deployer/todos", content_type="application/json",
        data=json.dumps({"queue": "deploys", "title": "ship it",
                         "secrets": {"token": "tok-live-123"}}),
        HTTP_AUTHORIZATION=f"Bearer {token}")
    assert answer.status_code == 201, answer.content
    assert "tok-live-123" not in answer.content.decode()

    _, listed = call(endpoint, "list_todos", {})
    ref = listed["todos"][0]["payload"]["secrets"]["token"]["$secret"]
    assert "tok-live-123" not in json.dumps(listed)
    # Readable only while this session holds the todo's lease (CONTRACT §12).
    is_error, refused = call(endpoint, "read_secret", {"ref": ref})
    assert is_error and refused["error"]["code"] == "lease_lost"
    assert not call(endpoint, "claim", {"todo_id": listed["todos"][0]["id"]})[0]
    assert call(endpoint, "read_secret", {"ref": ref}) == (False, {"ref": ref, "value": "tok-live-123"})

    # Another endpoint, and the same endpoint with a scope that does not cover the queue,
    # cannot tell the secret from a missing one.
    for outsider in (narrow, EndpointFactory(slug="stranger", owner=operator)):
        is_error, refused = call(outsider, "read_secret", {"ref": ref})
        assert is_error and refused["error"]["code"] == "not_found"
    endpoint.scope = ["other"]
    endpoint.save()
    is_error, refused = call(endpoint, "read_secret", {"ref": ref})
    assert is_error and refused["error"]["code"] == "not_found"
    is_error, refused = call(endpoint, "read_secret", {"ref": "not-a-ref"})
    assert is_error and refused["error"]["code"] == "invalid_argument"
