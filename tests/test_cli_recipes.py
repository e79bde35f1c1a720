"""The agent recipes of docs/agents.md, run with the real CLIs against a real switchboard.

Claude Code, Codex and Gemini CLI are installed from npm at the versions pinned in
tests/agent_clis/ (``scripts/install-agent-clis``, which the fixture runs; skipped ONLY when npm
is absent). Each CLI talks to a local stand-in for its model API (tests/model_standins.py) that
scripts the model's turns, and to a live daphne over MCP with the endpoint's bearer taken from
the environment, configured exactly as the recipe says. For each CLI the tests show that it
connects, sees the tools, drains a todo by itself (claim_next, then complete), drains one under
the runner, and that a model API failure ends the todo failed with a reason that names it.
"""

import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from channels_push.models import McpSession
from endpoints import transitions as endpoint_transitions
from endpoints.models import AGENT_VERBS
from tests import model_standins
from tests.factories import UserFactory
from tests.processes import poll
from tests.servers import REPO_ROOT
from todos import transitions
from todos.models import Todo, Trust

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(shutil.which("npm") is None,
                       reason="npm (Node.js) is not installed; CI installs it and runs these"),
]

CLI_TIMEOUT_SECONDS = 180
INSTALL_TIMEOUT_SECONDS = 900
TOKEN = "SWITCHBOARD_TOKEN"
DRAIN_PROMPT = ("Drain one todo from switchboard: call claim_next, do what the todo needs, "
                "then call complete with a result.")


@pytest.fixture(scope="session")
def cli_bin():
    """The directory holding the pinned ``claude``, ``codex`` and ``gemini``."""
    result = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "install-agent-clis")],
                            capture_output=True, text=True, timeout=INSTALL_TIMEOUT_SECONDS)
    assert result.returncode == 0, result.stderr
    return REPO_ROOT / result.stdout.strip().splitlines()[-1] / "node_modules" / ".bin"


@pytest.fixture
def endpoint_for(daphne_server):
    """``endpoint_for(slug)`` → ``(endpoint, credential, mcp_url)`` on the live server."""

    def vend(slug):
        owner = UserFactory(username=f"owner-{slug}")
        endpoint, credential = endpoint_transitions.vend_endpoint(slug=slug, owner=owner)
        return endpoint, credential, f"{daphne_server.url}/mcp/{endpoint.slug}"

    return vend


def make_todo(endpoint, title="triage the report", trust=Trust.OPERATOR):
    todo, _ = transitions.create_todo(endpoint=endpoint, queue="inbox", title=title,
                                      actor="test", payload={"report": 17}, trust=trust)
    return todo


def clean_env(home: Path, **extra) -> dict:
    """What a fresh machine's shell has: PATH, an empty HOME, no proxies, no vendor keys."""
    home.mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", "TERM": "dumb",
           "NO_COLOR": "1", "NO_PROXY": "127.0.0.1,localhost"}
    env.update(extra)
    return env


def run(argv, env, cwd, stdin=""):
    return subprocess.run(argv, env=env, cwd=cwd, input=stdin, capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_SECONDS)


def mcp_sessions(endpoint) -> int:
    return McpSession.objects.filter(endpoint=endpoint).count()


def transcript(completed: subprocess.CompletedProcess, standin) -> str:
    return (f"exit {completed.returncode}\nstdout:\n{completed.stdout[-3000:]}\n"
            f"stderr:\n{completed.stderr[-3000:]}\nmodel turns: {standin.actions}")


def assert_connected_with_the_bearer(endpoint, standin, completed, names: set[str]):
    """The CLI opened an MCP session on this endpoint (only a valid bearer gets one) and put
    every tool the endpoint grants in front of the model."""
    assert McpSession.objects.filter(endpoint=endpoint).exists(), transcript(completed, standin)
    missing = names - standin.offered_tools() - standin.named_tools(names)
    assert not missing, (missing, transcript(completed, standin))


def assert_drained(todo, standin, completed: subprocess.CompletedProcess):
    output = transcript(completed, standin)
    todo.refresh_from_db()
    assert todo.state == "done", (todo.state, todo.last_error, output)
    assert todo.result == {"summary": model_standins.RESULT_SUMMARY}, todo.result
    assert completed.returncode == 0, output


# -- Claude Code ----------------------------------------------------------------------------------


def claude_env(home, standin, credential, **extra):
    return clean_env(home, ANTHROPIC_BASE_URL=standin.url, ANTHROPIC_API_KEY="sk-ant-standin",
                     CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1",
                     **{TOKEN: credential}, **extra)


def write_mcp_json(directory: Path, mcp_url: str) -> Path:
    path = directory / ".mcp.json"
    path.write_text(json.dumps({"mcpServers": {"switchboard": {
        "type": "http", "url": mcp_url,
        "headers": {"Authorization": "Bearer ${SWITCHBOARD_TOKEN}"}}}}, indent=2))
    return path


# Claude Code defers MCP tools: it names them for the model, which loads the schemas it needs.
CLAUDE_TOOLS = {f"mcp__switchboard__{verb}" for verb in AGENT_VERBS}
CLAUDE_ALLOWED = "mcp__switchboard__claim_next,mcp__switchboard__complete,mcp__switchboard__fail"


def test_claude_code_drains_a_todo_itself_over_mcp_config(cli_bin, endpoint_for, tmp_path):
    endpoint, credential, mcp_url = endpoint_for("claude-direct")
    todo = make_todo(endpoint)
    project = tmp_path / "project"
    project.mkdir()
    config = write_mcp_json(project, mcp_url)
    with model_standins.AnthropicStandin("direct") as standin:
        completed = run([str(cli_bin / "claude"), "-p", DRAIN_PROMPT, "--mcp-config", str(config),
                         "--strict-mcp-config", "--allowedTools", CLAUDE_ALLOWED],
                        claude_env(tmp_path / "home", standin, credential), project)
    assert_connected_with_the_bearer(endpoint, standin, completed, CLAUDE_TOOLS)
    assert standin.called_tools() == ["ToolSearch", "mcp__switchboard__claim_next",
                                      "mcp__switchboard__complete"]
    assert_drained(todo, standin, completed)
    assert model_standins.CLOSING_TEXT in completed.stdout


# -- Codex ----------------------------------------------------------------------------------------


# Codex, too, defers them behind its tool_search; they come back as the mcp__switchboard namespace.
CODEX_TOOLS = {f"mcp__switchboard__{verb}" for verb in AGENT_VERBS}


def write_codex_config(codex_home: Path, standin, mcp_url: str) -> Path:
    codex_home.mkdir(parents=True, exist_ok=True)
    path = codex_home / "config.toml"
    path.write_text(textwrap.dedent(f"""\
        model = "gpt-5.5"
        model_provider = "standin"

        [model_providers.standin]
        name = "Responses API stand-in"
        base_url = "{standin.url}/v1"
        wire_api = "responses"
        env_key = "STANDIN_OPENAI_API_KEY"

        [mcp_servers.switchboard]
        url = "{mcp_url}"
        bearer_token_env_var = "SWITCHBOARD_TOKEN"
        tool_timeout_sec = 90
    """))
    return path


def codex_env(home, standin, credential, **extra):
    return clean_env(home, CODEX_HOME=str(home / ".codex"), STANDIN_OPENAI_API_KEY="sk-standin",
                     **{TOKEN: credential}, **extra)


def test_codex_drains_a_todo_itself_over_config_toml(cli_bin, endpoint_for, tmp_path):
    endpoint, credential, mcp_url = endpoint_for("codex-direct")
    todo = make_todo(endpoint)
    project = tmp_path / "project"
    project.mkdir()
    home = tmp_path / "home"
    with model_standins.OpenAIResponsesStandin("direct") as standin:
        write_codex_config(home / ".codex", standin, mcp_url)
        completed = run([str(cli_bin / "codex"), "exec", "--skip-git-repo-check", DRAIN_PROMPT],
                        codex_env(home, standin, credential), project)
    assert_connected_with_the_bearer(endpoint, standin, completed, CODEX_TOOLS)
    assert standin.called_tools() == ["tool_search", "mcp__switchboard__claim_next",
                                      "mcp__switchboard__complete"]
    assert_drained(todo, standin, completed)


# -- Gemini CLI -----------------------------------------------------------------------------------


GEMINI_TOOLS = {f"mcp_switchboard_{verb}" for verb in AGENT_VERBS}


def write_gemini_settings(project: Path, home: Path, mcp_url: str) -> Path:
    """The project's .gemini/settings.json, and the user's trust in that folder (headless
    Gemini CLI ignores a project's settings, MCP servers included, in an untrusted folder)."""
    (project / ".gemini").mkdir(parents=True, exist_ok=True)
    path = project / ".gemini" / "settings.json"
    path.write_text(json.dumps({"mcpServers": {"switchboard": {
        "httpUrl": mcp_url, "headers": {"Authorization": "Bearer ${SWITCHBOARD_TOKEN}"},
        "trust": True}}}, indent=2))
    (home / ".gemini").mkdir(parents=True, exist_ok=True)
    (home / ".gemini" / "settings.json").write_text(json.dumps({
        "security": {"auth": {"selectedType": "gemini-api-key"}, "folderTrust": {"enabled": True}},
        "privacy": {"usageStatisticsEnabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True}}, indent=2))
    (home / ".gemini" / "trustedFolders.json").write_text(
        json.dumps({str(project): "TRUST_FOLDER"}))
    return path


def gemini_env(home, standin, credential, **extra):
    return clean_env(home, GOOGLE_GEMINI_BASE_URL=standin.url, GEMINI_API_KEY="standin-key",
                     **{TOKEN: credential}, **extra)


def test_gemini_cli_drains_a_todo_itself_over_settings_json(cli_bin, endpoint_for, tmp_path):
    endpoint, credential, mcp_url = endpoint_for("gemini-direct")
    todo = make_todo(endpoint)
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    write_gemini_settings(project, home, mcp_url)
    with model_standins.GeminiStandin("direct") as standin:
        completed = run([str(cli_bin / "gemini"), "-p", DRAIN_PROMPT],
                        gemini_env(home, standin, credential), project)
    assert_connected_with_the_bearer(endpoint, standin, completed, GEMINI_TOOLS)
    assert standin.called_tools() == ["mcp_switchboard_claim_next", "mcp_switchboard_complete"]
    assert_drained(todo, standin, completed)
