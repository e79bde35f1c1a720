"""Real third-party MCP clients against a real daphne process: the MCP Inspector CLI and the
official conformance suite (both Node packages, run with npx on Node 22).

These need ``npx`` (Node.js ≥ 20 with npm; ``-p node@22`` fetches Node 22 for the tools) and
the npm registry. They are skipped ONLY when npx is absent; CI installs Node and runs them.
Versions are pinned so a new release of a tool cannot change the verdict silently.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from endpoints import transitions as endpoint_transitions
from endpoints.models import AGENT_VERBS
from tests.factories import UserFactory
from tests.servers import REPO_ROOT, free_port
from todos import transitions

INSPECTOR = "@modelcontextprotocol/inspector@2.12.0"
CONFORMANCE = "@modelcontextprotocol/conformance@0.1.16"
NPX_TIMEOUT_SECONDS = 600
# Scenarios the product itself must pass (never allowed into the baseline).
REQUIRED_SCENARIOS = ("server-initialize", "ping", "tools-list", "server-sse-multiple-streams",
                      "dns-rebinding-protection")

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(shutil.which("npx") is None,
                       reason="npx (Node.js + npm) is not installed; CI installs it and runs these"),
]


def vend(slug):
    owner = UserFactory(username=f"owner-{slug}")
    return endpoint_transitions.vend_endpoint(slug=slug, owner=owner)


def npx(*args):
    return subprocess.run(
        ["npx", "-y", "-p", "node@22", *args], capture_output=True, text=True,
        timeout=NPX_TIMEOUT_SECONDS, cwd=REPO_ROOT, env={**os.environ, "NO_COLOR": "1"},
    )


def run_inspector(url, credential, *args):
    return npx("-p", INSPECTOR, "--", "mcp-inspector", "--cli", url, "--transport", "http",
               "--header", f"Authorization: Bearer {credential}", *args)


def inspector(url, credential, *args):
    result = run_inspector(url, credential, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def test_mcp_inspector_strict_schema_check_finds_nothing(daphne_server):
    """Issue 13.8: todo_id's ``"type": ["string", "integer"]`` and the untyped ``result``
    were portability findings; every tool schema, input and output, passes --strict clean."""
    endpoint, credential = vend("inspector-strict")
    url = f"{daphne_server.url}/mcp/{endpoint.slug}"
    result = run_inspector(url, credential, "--method", "tools/list", "--strict", "--format", "json")
    assert result.returncode == 0, result.stdout + result.stderr
    envelope = json.loads(result.stdout)
    assert "schemaFindings" not in envelope, envelope.get("schemaFindings")
    assert "Warning:" not in result.stderr and "Error:" not in result.stderr, result.stderr
    tools = envelope["result"]["tools"]
    # A freshly vended endpoint grants every agent verb: each is a tool, and repo_token (each
    # route grants it; docs/write-back.md#repository-tokens-for-agents), none else.
    assert sorted(tool["name"] for tool in tools) == sorted([*AGENT_VERBS, "repo_token"])
    assert all("outputSchema" in tool and tool["annotations"] for tool in tools)


def test_mcp_inspector_cli_lists_tools_and_calls_claim_next(daphne_server):
    endpoint, credential = vend("inspector")
    todo, _ = transitions.create_todo(endpoint=endpoint, queue="inbox", title="from inspector",
                                      actor="test")
    url = f"{daphne_server.url}/mcp/{endpoint.slug}"
    tools = inspector(url, credential, "--method", "tools/list")
    assert {"claim_next", "complete", "list_todos"} <= {t["name"] for t in tools["tools"]}
    called = inspector(url, credential, "--method", "tools/call", "--tool-name", "claim_next")
    assert called.get("isError") in (None, False)
    assert called["structuredContent"]["todo"]["id"] == str(todo.pk)
    assert called["structuredContent"]["todo"]["state"] == "claimed"


@pytest.fixture
def bearer_proxy(start_daphne):
    """The conformance CLI cannot send headers: front daphne with tests/auth_proxy.py. The
    proxy's localhost origin is the deployment's public origin here, so daphne allows it (and,
    as the suite's DNS-rebinding scenario checks, no other)."""
    endpoint, credential = vend("conformance")
    port = free_port()
    daphne_server = start_daphne(SWITCHBOARD_ALLOWED_ORIGINS=f"http://localhost:{port}")
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.auth_proxy", "--listen-port", str(port),
         "--target", daphne_server.url, "--header", f"Authorization: Bearer {credential}"],
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    from tests.servers import DaphneServer

    DaphneServer.wait_ready_at(f"http://127.0.0.1:{port}", process)
    # The suite's DNS-rebinding scenario requires a localhost URL.
    yield f"http://localhost:{port}/mcp/{endpoint.slug}"
    process.terminate()
    process.wait(10)


def test_conformance_suite_passes_with_only_fixture_scenarios_in_the_baseline(bearer_proxy,
                                                                               tmp_path):
    result = npx("-p", CONFORMANCE, "--", "conformance", "server", "--url", bearer_proxy,
                 "--expected-failures", str(REPO_ROOT / "tests" / "conformance-baseline.yml"),
                 "-o", str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for scenario in REQUIRED_SCENARIOS:
        assert f"✓ {scenario}:" in output, f"{scenario} did not pass:\n{output}"
