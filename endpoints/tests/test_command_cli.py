"""manage.py vend_endpoint and rotate_credential: happy paths, bad arguments, --json, --help."""

import json
import tomllib

import pytest

from endpoints import queries
from channels_push.mcp.schemas import MAX_WAIT_SECONDS
from endpoints.models import AGENT_VERBS, Endpoint
from tests.cli import json_printed_after, run_manage

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("command", ["vend_endpoint", "rotate_credential"])
def test_help(capsys, command):
    run = run_manage(capsys, command, "--help")
    assert run.code == 0 and "usage:" in run.out and "--json" in run.out


def test_vend_endpoint_json(capsys, operator, settings):
    run = run_manage(capsys, "vend_endpoint", "reviewer", "--owner", "alice", "--queues",
                     "inbox,reviews", "--verbs", "list_todos,claim", "--lease-seconds", "60",
                     "--max-attempts", "2", "--json")
    assert run.code == 0, run.err
    data = run.json()
    assert set(data) == {"slug", "mcp_url", "credential", "mcp_json", "max_claimed"}
    assert data["slug"] == "reviewer"
    assert data["mcp_url"] == f"{settings.SWITCHBOARD_PUBLIC_URL}/mcp/reviewer"
    endpoint = Endpoint.objects.get(slug="reviewer")
    assert (endpoint.scope, endpoint.verbs, endpoint.default_lease_seconds, endpoint.max_attempts) == (
        ["inbox", "reviews"], ["list_todos", "claim"], 60, 2)
    assert queries.find_endpoint_for_credential("reviewer", data["credential"]) == endpoint


def test_vend_endpoint_prints_an_mcp_json_that_names_the_token_variable_not_the_token(
        capsys, operator, settings):
    settings.SWITCHBOARD_PUBLIC_URL = "https://sb.example"
    data = run_manage(capsys, "vend_endpoint", "coder", "--owner", "alice", "--json").json()
    assert data["mcp_json"] == {"mcpServers": {"switchboard": {
        "type": "http", "url": "https://sb.example/mcp/coder",
        "headers": {"Authorization": "Bearer ${SWITCHBOARD_TOKEN}"}}}}
    assert data["credential"] not in json.dumps(data["mcp_json"])

    run = run_manage(capsys, "vend_endpoint", "coder2", "--owner", "alice")
    credential = run.out.split("export SWITCHBOARD_TOKEN=")[1].split()[0]
    assert queries.find_endpoint_for_credential("coder2", credential)
    printed_json = json_printed_after(run.out, ".mcp.json")
    assert printed_json["mcpServers"]["switchboard"]["url"] == "https://sb.example/mcp/coder2"
    assert credential not in json.dumps(printed_json)
    # Single quotes, so the shell stores the variable, not the credential.
    assert ("claude mcp add --transport http --scope local switchboard "
            "https://sb.example/mcp/coder2 --header "
            "'Authorization: Bearer ${SWITCHBOARD_TOKEN}'") in run.out


def test_vend_endpoint_prints_codex_and_gemini_configurations_beside_claude_codes(
        capsys, operator, settings):
    settings.SWITCHBOARD_PUBLIC_URL = "https://sb.example"
    run = run_manage(capsys, "vend_endpoint", "multi", "--owner", "alice")
    assert run.code == 0, run.err
    credential = run.out.split("export SWITCHBOARD_TOKEN=")[1].split()[0]
    codex = tomllib.loads(run.out.split("config.toml", 1)[1].split("\n", 1)[1].split("\n\n")[0])
    assert codex == {"mcp_servers": {"switchboard": {
        "url": "https://sb.example/mcp/multi", "bearer_token_env_var": "SWITCHBOARD_TOKEN",
        "tool_timeout_sec": 90}}}
    assert codex["mcp_servers"]["switchboard"]["tool_timeout_sec"] > MAX_WAIT_SECONDS
    gemini = json_printed_after(run.out, "settings.json")
    assert gemini == {"mcpServers": {"switchboard": {
        "httpUrl": "https://sb.example/mcp/multi",
        "headers": {"Authorization": "Bearer ${SWITCHBOARD_TOKEN}"}, "trust": True}}}
    # Besides the header's "credential:" line, only on the export line.
    assert run.out.split("export the credential", 1)[1].count(credential) == 1
    assert "docs/agents.md" in run.out
    # --json keeps exactly its documented keys.
    data = run_manage(capsys, "vend_endpoint", "multi2", "--owner", "alice", "--json").json()
    assert set(data) == {"slug", "mcp_url", "credential", "mcp_json", "max_claimed"}


def test_vend_endpoint_defaults_and_human_output(capsys, operator):
    run = run_manage(capsys, "vend_endpoint", "plain", "--owner", "alice")
    assert run.code == 0 and "credential:" in run.out and "shown only now" in run.out
    endpoint = Endpoint.objects.get(slug="plain")
    assert endpoint.scope == ["*"] and endpoint.verbs == list(AGENT_VERBS)


@pytest.mark.parametrize("argv, message", [
    (["x"], "the following arguments are required: --owner"),
    (["x", "--owner", "nobody"], "no user 'nobody'"),
    (["x", "--owner", "alice", "--verbs", "claim,fly"], "unknown verbs"),
    (["x", "--owner", "alice", "--verbs", ""], "at least one verb"),
    (["x", "--owner", "alice", "--verbs", ","], "at least one verb"),
    (["x", "--owner", "alice", "--queues", "bad name"], "queue names"),
    (["x", "--owner", "alice", "--lease-seconds", "0"], "between 1 and 86400"),
    (["x", "--owner", "alice", "--lease-seconds", "soon"], "invalid int value"),
    (["x", "--owner", "alice", "--max-attempts", "0"], "from 1 to 100"),
    # One message per field, the model's own (Django's "Ensure this value…" said it twice).
    (["x", "--owner", "alice", "--max-attempts", "-1"],
     "CommandError: max_attempts: from 1 to 100\n"),
    (["x", "--owner", "alice", "--max-claimed", "-1"],
     "CommandError: max_claimed: a whole number from 0 to 10000, or unset; got '-1'\n"),
    # Two of Django's validators failing on one field: both said.
    (["x" * 80 + "!", "--owner", "alice"], "slug: Enter a valid “slug” consisting of letters, "
     "numbers, underscores or hyphens. Ensure this value has at most 64 characters (it has 81)."),
    (["taken", "--owner", "alice"], "already exists"),
])
def test_vend_endpoint_bad_arguments(capsys, operator, argv, message):
    from endpoints import transitions

    transitions.vend_endpoint(slug="taken", owner=operator)
    run = run_manage(capsys, "vend_endpoint", *argv, "--json")
    assert run.code != 0 and message in run.err and run.out == ""
    assert not Endpoint.objects.filter(slug="x").exists()


def test_rotate_credential_json_keeps_the_old_one_for_the_grace(capsys, operator):
    vended = run_manage(capsys, "vend_endpoint", "ep", "--owner", "alice", "--json").json()
    run = run_manage(capsys, "rotate_credential", "ep", "--grace-seconds", "60", "--json")
    assert run.code == 0
    data = run.json()
    assert set(data) == {"slug", "credential"} and data["slug"] == "ep"
    assert data["credential"] != vended["credential"]
    assert queries.find_endpoint_for_credential("ep", data["credential"])
    assert queries.find_endpoint_for_credential("ep", vended["credential"])  # grace
    run_manage(capsys, "rotate_credential", "ep", "--grace-seconds", "0")
    assert queries.find_endpoint_for_credential("ep", vended["credential"]) is None


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: slug"),
    (["nope"], "no endpoint 'nope'"),
    (["ep", "--grace-seconds", "-1"], "--grace-seconds must be between 0 and 2592000"),
    (["ep", "--grace-seconds", "x"], "invalid int value"),
])
def test_rotate_credential_bad_arguments(capsys, operator, argv, message):
    from endpoints import transitions

    transitions.vend_endpoint(slug="ep", owner=operator)
    run = run_manage(capsys, "rotate_credential", *argv, "--json")
    assert run.code != 0 and message in run.err and run.out == ""
