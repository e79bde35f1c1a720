"""The agent recipes of docs/agents.md, run with the real CLIs against a real switchboard.

Claude Code, Codex and Gemini CLI are installed from npm at the versions pinned in
tests/agent_clis/ (``scripts/install-agent-clis``, which the fixture runs; skipped ONLY when npm
is absent). Each CLI talks to a local stand-in for its model API (tests/model_standins.py) that
scripts the model's turns, and to a live daphne over MCP with the endpoint's bearer taken from
the environment, configured with the snippets vend_endpoint and seed_demo print
(endpoints/connect_snippets.py) and the command lines docs/agents.md gives. For each CLI the tests show that it
connects, sees the tools, drains a todo by itself (claim_next, then complete), drains one under
the runner (``--require-settled``, its todo's own token, the CLI's JSON report and the built-in prompt)
with the usage the stand-in reported arriving on the attempt the agent settled, that the runner
completes a todo from the CLI's report with the usage the stand-in reported,
and that a model API failure ends the todo failed with a ``last_error`` that names it.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from channels_push.models import McpSession
from endpoints import transitions as endpoint_transitions
from endpoints.models import AGENT_VERBS
from endpoints import connect_snippets
from tests import model_standins
from tests.factories import UserFactory
from tests.servers import REPO_ROOT
from todos import queries, transitions
from todos.models import Trust

# One worker installs and drives the CLIs (var/agent-clis is one directory for the run).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.xdist_group("agent-clis")]

CLI_TIMEOUT_SECONDS = 180
INSTALL_TIMEOUT_SECONDS = 900
RUNNER = REPO_ROOT / "runner" / "switchboard_runner.py"
TOKEN = "SWITCHBOARD_TOKEN"
DRAIN_PROMPT = ("Drain one todo from switchboard: call claim_next, do what the todo needs, "
                "then call complete with a result.")


@pytest.fixture(scope="session")
def cli_bin():
    """The directory holding the pinned ``claude``, ``codex`` and ``gemini``; every test that
    drives a CLI skips (only) when npm is absent. CI installs Node and runs them."""
    if shutil.which("npm") is None:
        pytest.skip("npm (Node.js) is not installed; CI installs it and runs these")
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


def run(argv, env, cwd):
    return subprocess.run(argv, env=env, cwd=cwd, input="", capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_SECONDS)


def transcript(completed: subprocess.CompletedProcess, standin) -> str:
    return (f"exit {completed.returncode}\nstdout:\n{completed.stdout[-3000:]}\n"
            f"stderr:\n{completed.stderr[-3000:]}\nmodel turns: {standin.actions}")


# -- the recipes, as docs/agents.md writes them ---------------------------------------------------


@dataclass
class Recipe:
    """One CLI's configuration in a fresh project directory and HOME."""

    cli: str
    standin_class: type
    tool_prefix: str  # how the CLI names switchboard's tools for the model

    def tools(self) -> set[str]:
        return {f"{self.tool_prefix}{verb}" for verb in AGENT_VERBS}

    def tool(self, verb) -> str:
        return f"{self.tool_prefix}{verb}"

    # Filled by each recipe: the files it writes, the model API's variables, the command lines.
    def configure(self, project: Path, home: Path, standin, mcp_url: str):
        raise NotImplementedError

    def model_env(self, home: Path, standin) -> dict:
        raise NotImplementedError

    def direct_argv(self, cli_bin: Path) -> list[str]:
        raise NotImplementedError

    def runner_argv(self, cli_bin: Path) -> list[str]:
        raise NotImplementedError

    # Model turns the CLI adds before it can call a deferred tool.
    loader_calls: tuple = ()
    # How the line that leads last_error starts when the model API refuses (the CLI's own
    # error line, never the echo of the prompt it was given); a tuple: any of these.
    failure_reason: str | tuple[str, ...] = ""


class ClaudeCode(Recipe):
    def __init__(self):
        super().__init__("claude", model_standins.AnthropicStandin, "mcp__switchboard__")
        # Claude Code defers MCP tools: it names them, the model loads schemas with ToolSearch.
        self.loader_calls = ("ToolSearch",)
        # `claude -p` rewords the API error and prints it on stdout, with no error marker.
        self.failure_reason = "agent exited with code 1: Credit balance is too low"

    def configure(self, project, home, standin, mcp_url):
        (project / ".mcp.json").write_text(json.dumps(connect_snippets.mcp_json(mcp_url), indent=2))

    def model_env(self, home, standin):
        return {"ANTHROPIC_BASE_URL": standin.url, "ANTHROPIC_API_KEY": "sk-ant-standin",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}

    def allowed(self, *verbs):
        return ["--mcp-config", ".mcp.json", "--strict-mcp-config",
                "--allowedTools", ",".join(self.tool(verb) for verb in verbs)]

    def direct_argv(self, cli_bin):
        return [str(cli_bin / "claude"), "-p", DRAIN_PROMPT,
                *self.allowed("claim_next", "heartbeat", "complete", "fail", "post_update")]

    def runner_argv(self, cli_bin):
        return [str(cli_bin / "claude"), "-p", "{prompt}", "--output-format", "json",
                *self.allowed("heartbeat", "complete", "fail", "post_update")]


class Codex(Recipe):
    def __init__(self):
        super().__init__("codex", model_standins.OpenAIResponsesStandin, "mcp__switchboard__")
        # Codex, too, defers them behind tool_search (they come back as a namespace).
        self.loader_calls = ("tool_search",)
        # Directly: its ERROR: line on stderr, below the prompt and the stdin it echoes there.
        # Under the runner (exec --json): its failed turn's event, which quotes the API's error.
        self.failure_reason = ('ERROR: {"error": {"message": "' + model_standins.ERROR_MESSAGE,
                               '{"error": {"message": "' + model_standins.ERROR_MESSAGE)

    def configure(self, project, home, standin, mcp_url):
        (home / ".codex").mkdir(parents=True, exist_ok=True)
        # The model provider points Codex at the stand-in; the MCP table is the printed one.
        (home / ".codex" / "config.toml").write_text(textwrap.dedent(f"""\
            model = "gpt-5.5"
            model_provider = "standin"

            [model_providers.standin]
            name = "Responses API stand-in"
            base_url = "{standin.url}/v1"
            wire_api = "responses"
            env_key = "STANDIN_OPENAI_API_KEY"

        """) + connect_snippets.codex_config_toml(mcp_url) + "\n")

    def model_env(self, home, standin):
        return {"STANDIN_OPENAI_API_KEY": "sk-standin"}

    def direct_argv(self, cli_bin):
        return [str(cli_bin / "codex"), "exec", "--skip-git-repo-check", DRAIN_PROMPT]

    def runner_argv(self, cli_bin):
        return [str(cli_bin / "codex"), "exec", "--json", "--skip-git-repo-check", "{prompt}"]


class GeminiCli(Recipe):
    def __init__(self):
        super().__init__("gemini", model_standins.GeminiStandin, "mcp_switchboard_")
        # Its first error line is the model-routing call's refusal, which quotes the API's
        # message; its own report of the turn follows between stack traces. The runner keeps
        # both (an error line is found anywhere in the output), the first leads.
        self.failure_reason = ("Error generating content via API",
                               "Error when talking to Gemini API")

    def configure(self, project, home, standin, mcp_url):
        """The project's .gemini/settings.json, and the user's trust in that folder (headless
        Gemini CLI ignores an untrusted folder's settings, its MCP servers included)."""
        (project / ".gemini").mkdir(parents=True, exist_ok=True)
        (project / ".gemini" / "settings.json").write_text(
            json.dumps(connect_snippets.gemini_settings_json(mcp_url), indent=2))
        (home / ".gemini").mkdir(parents=True, exist_ok=True)
        (home / ".gemini" / "settings.json").write_text(json.dumps({
            "security": {"auth": {"selectedType": "gemini-api-key"},
                         "folderTrust": {"enabled": True}},
            "privacy": {"usageStatisticsEnabled": False},
            "general": {"disableAutoUpdate": True, "disableUpdateNag": True}}, indent=2))
        (home / ".gemini" / "trustedFolders.json").write_text(
            json.dumps({str(project): "TRUST_FOLDER"}))

    def model_env(self, home, standin):
        return {"GOOGLE_GEMINI_BASE_URL": standin.url, "GEMINI_API_KEY": "standin-key"}

    def direct_argv(self, cli_bin):
        return [str(cli_bin / "gemini"), "-p", DRAIN_PROMPT]

    def runner_argv(self, cli_bin):
        return [str(cli_bin / "gemini"), "-p", "{prompt}", "--output-format", "json"]


RECIPES = [ClaudeCode(), Codex(), GeminiCli()]


@pytest.fixture(params=RECIPES, ids=lambda recipe: recipe.cli)
def recipe(request):
    return request.param


@dataclass
class Workspace:
    project: Path
    home: Path


@pytest.fixture
def workspace(tmp_path):
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    home.mkdir()
    return Workspace(project, home)


def run_runner(recipe, cli_bin, workspace, standin, mcp_url, credential, require_settled=True):
    """The runner as the recipe starts it, once: the agent's environment is scrubbed, so the
    model API's variables are passed by name; the agent's SWITCHBOARD_TOKEN is the todo
    token the runner's claim got, never the endpoint's credential."""
    model_env = recipe.model_env(workspace.home, standin)
    pass_env = [arg for name in model_env for arg in ("--pass-env", name)]
    strict = ["--require-settled"] if require_settled else []
    return subprocess.run(
        [sys.executable, str(RUNNER), "--url", mcp_url, "--once",
         *strict, *pass_env, "--", *recipe.runner_argv(cli_bin)],
        env=clean_env(workspace.home, **model_env, **{TOKEN: credential}), cwd=workspace.project,
        input="", capture_output=True, text=True, timeout=CLI_TIMEOUT_SECONDS)


@dataclass
class RunnerRun:
    todo: object
    credential: str
    standin: model_standins.Standin
    completed: subprocess.CompletedProcess
    output: str


def run_a_todo_under_the_runner(recipe, cli_bin, endpoint_for, workspace, case: str, mode: str, *,
                                require_settled: bool = True, tools_elsewhere: bool = False):
    """A fresh endpoint (``case`` names it) with one todo, run once under the runner, the model
    scripted by ``mode``. ``tools_elsewhere``: the CLI's MCP server is another endpoint's,
    which refuses the todo's token."""
    endpoint, credential, mcp_url = endpoint_for(f"{recipe.cli}-{case}")
    cli_url = endpoint_for(f"{recipe.cli}-elsewhere")[2] if tools_elsewhere else mcp_url
    todo = make_todo(endpoint)
    with recipe.standin_class(mode) as standin:
        recipe.configure(workspace.project, workspace.home, standin, cli_url)
        completed = run_runner(recipe, cli_bin, workspace, standin, mcp_url, credential,
                               require_settled=require_settled)
    todo.refresh_from_db()
    return RunnerRun(todo, credential, standin, completed, transcript(completed, standin))


def assert_usage_arrived(recipe, ran: RunnerRun, action: str):
    """The todo's usage is the one report the stand-in's answers added up to, kept on the
    attempt's ``action`` event."""
    todo, reported, output = ran.todo, ran.standin.reported_usage, ran.output
    print(f"\n{recipe.cli} usage: {queries.todo_as_dict(todo)['usage']}; stand-in: {reported}")
    assert (todo.usage_input_tokens, todo.usage_output_tokens) == (
        reported["input_tokens"], reported["output_tokens"]), (reported, output)
    assert todo.usage_reports == 1 and todo.usage_turns >= 1, output
    if recipe.cli == "claude":  # the only one of the three that prices its run
        assert todo.usage_cost_microusd > 0, output
    event = todo.events.get(action=action)
    assert event.detail["usage"]["input_tokens"] == reported["input_tokens"], output


# -- the tests ------------------------------------------------------------------------------------


def test_each_cli_connects_with_the_bearer_sees_the_tools_and_drains_a_todo_itself(
        recipe, cli_bin, endpoint_for, workspace):
    endpoint, credential, mcp_url = endpoint_for(f"{recipe.cli}-direct")
    todo = make_todo(endpoint)
    with recipe.standin_class("direct") as standin:
        recipe.configure(workspace.project, workspace.home, standin, mcp_url)
        completed = run(recipe.direct_argv(cli_bin),
                        clean_env(workspace.home, **recipe.model_env(workspace.home, standin),
                                  **{TOKEN: credential}),
                        workspace.project)
    output = transcript(completed, standin)
    # Connects: only a valid bearer opens an MCP session on the endpoint.
    assert McpSession.objects.filter(endpoint=endpoint).exists(), output
    # Sees the tools: every verb the endpoint grants was put in front of the model (by schema,
    # or by name for a CLI that defers the schemas).
    tools = recipe.tools()
    unseen = tools - standin.offered_tools() - standin.named_tools(tools)
    assert not unseen, (unseen, output)
    assert standin.called_tools() == [*recipe.loader_calls, recipe.tool("claim_next"),
                                      recipe.tool("complete")], output
    todo.refresh_from_db()
    assert (todo.state, todo.result) == ("done", {"summary": model_standins.RESULT_SUMMARY}), \
        (todo.state, todo.last_error, output)
    assert completed.returncode == 0, output
    assert model_standins.CLOSING_TEXT in completed.stdout, output


def test_each_cli_drains_a_todo_under_the_runner_with_the_built_in_prompt(
        recipe, cli_bin, endpoint_for, workspace):
    ran = run_a_todo_under_the_runner(recipe, cli_bin, endpoint_for, workspace, "runner", "stdin")
    todo, output = ran.todo, ran.output
    assert ran.completed.returncode == 0, output
    # The agent settled the todo itself (--require-settled fails it otherwise), with the ids
    # the built-in prompt gave it; the runner kept out of the way.
    assert ran.standin.called_tools() == [*recipe.loader_calls, recipe.tool("complete")], output
    assert (todo.state, todo.result) == ("done", {"summary": model_standins.RESULT_SUMMARY}), \
        (todo.state, todo.last_error, output)
    prompt = model_standins.strings([request["body"] for request in ran.standin.requests])
    assert f'todo_id "{todo.pk}"' in prompt and "untrusted" in prompt, output
    assert "call switchboard's complete tool" in prompt, output
    # The agent settled, and the runner's refused settle carried the CLI's report under the
    # same lease: the usage went to the attempt the agent completed.
    assert_usage_arrived(recipe, ran, "complete")
    assert "usage_sent" in ran.completed.stderr, output
    assert ran.credential not in ran.completed.stderr
    # The CLI connected with its todo's own token (the runner's session is the other one).
    assert McpSession.objects.filter(endpoint=todo.endpoint,
                                     todo_token__todo=todo).exists(), output


def test_each_cli_under_the_runner_completes_from_its_report_with_the_usage_the_model_reported(
        recipe, cli_bin, endpoint_for, workspace):
    """Without --require-settled the runner settles: the model answers without calling a
    switchboard tool (as the built-in prompt for a CLI with a report then asks), and the runner
    completes the todo from the CLI's own report, its final answer as the summary, with the
    usage the CLI added up from the stand-in's answers."""
    ran = run_a_todo_under_the_runner(recipe, cli_bin, endpoint_for, workspace, "usage", "report",
                                      require_settled=False)
    todo, output = ran.todo, ran.output
    assert ran.completed.returncode == 0, output
    assert recipe.tool("complete") not in ran.standin.called_tools(), output
    assert todo.state == "done", (todo.state, todo.last_error, output)
    assert todo.result["summary"] == model_standins.RESULT_SUMMARY, (todo.result, output)
    assert_usage_arrived(recipe, ran, "complete")


def test_each_cli_refused_by_switchboard_reports_success_and_still_fails_the_todo(
        recipe, cli_bin, endpoint_for, workspace):
    """The CLI's MCP server is another endpoint's, which refuses the todo's token: the CLI runs
    without the tools, exits 0 and reports success. Under --require-settled that is not a
    settle: the runner fails the todo, and its fail carries the usage the CLI reported."""
    ran = run_a_todo_under_the_runner(recipe, cli_bin, endpoint_for, workspace, "refused", "stdin",
                                      tools_elsewhere=True)
    todo, output = ran.todo, ran.output
    assert ran.completed.returncode == 0, output
    assert "code=0" in ran.completed.stderr and "no_report" not in ran.completed.stderr, output
    assert not [name for name in ran.standin.called_tools() if "switchboard" in name], output
    assert todo.state == "failed", (todo.state, todo.result, output)
    assert todo.last_error.startswith("agent exited 0 without settling the todo"), \
        (todo.last_error, output)
    reported = ran.standin.reported_usage
    assert (todo.usage_reports, todo.usage_input_tokens, todo.usage_output_tokens) == (
        1, reported["input_tokens"], reported["output_tokens"]), (reported, output)


def test_each_cli_under_the_runner_fails_the_todo_with_the_model_api_error(
        recipe, cli_bin, endpoint_for, workspace):
    ran = run_a_todo_under_the_runner(recipe, cli_bin, endpoint_for, workspace, "api-error",
                                      "api_error")
    todo, output = ran.todo, ran.output
    assert ran.standin.requests, output  # the CLI did reach its (refusing) model API
    assert todo.state == "failed", (todo.state, output)
    # last_error leads with the CLI's own error line, which names the API's refusal (Claude
    # Code rewords it, the others quote it): the part a person reads first on the board.
    reason = todo.last_error.split(" | ")[0]
    print(f"\n{recipe.cli} last_error: {todo.last_error[:400]!r}")
    assert reason.startswith(recipe.failure_reason), (todo.last_error, output)
    assert "credit balance is too low" in reason.lower(), (todo.last_error, output)
    assert "standing instructions" not in reason, (todo.last_error, output)  # not the prompt


def test_claude_mcp_add_as_printed_stores_the_variable_not_the_secret_and_drains(
        cli_bin, endpoint_for, workspace, settings):
    """The ``claude mcp add`` line vend_endpoint prints, pasted into a shell that holds the
    token: single quotes keep ``${SWITCHBOARD_TOKEN}`` literal in Claude Code's config, which
    expands it when it connects."""
    endpoint, credential, mcp_url = endpoint_for("claude-mcp-add")
    todo = make_todo(endpoint)
    recipe = ClaudeCode()
    line = connect_snippets.claude_mcp_add(mcp_url)
    assert "'Authorization: Bearer ${SWITCHBOARD_TOKEN}'" in line
    with recipe.standin_class("direct") as standin:
        env = clean_env(workspace.home, **recipe.model_env(workspace.home, standin),
                        **{TOKEN: credential}, PATH=f"{cli_bin}:{os.environ['PATH']}")
        added = run(["bash", "-c", line], env, workspace.project)
        assert added.returncode == 0, added.stdout + added.stderr
        stored = (workspace.home / ".claude.json").read_text()
        assert "${SWITCHBOARD_TOKEN}" in stored and credential not in stored
        completed = run([str(cli_bin / "claude"), "-p", DRAIN_PROMPT, "--allowedTools",
                         "mcp__switchboard__claim_next,mcp__switchboard__complete"],
                        env, workspace.project)
    output = transcript(completed, standin)
    todo.refresh_from_db()
    assert todo.state == "done", (todo.state, output)
    assert completed.returncode == 0, output


# -- what the recipes' permissions and trust settings are for -------------------------------------


def test_claude_code_without_allowed_tools_cannot_call_switchboard_headless(
        cli_bin, endpoint_for, workspace):
    """Why the recipes pass --allowedTools: ``claude -p`` cannot ask, so an MCP tool that is not
    allowed is refused and the todo stays pending."""
    endpoint, credential, mcp_url = endpoint_for("claude-no-allow")
    todo = make_todo(endpoint)
    recipe = ClaudeCode()
    with recipe.standin_class("direct") as standin:
        recipe.configure(workspace.project, workspace.home, standin, mcp_url)
        completed = run([str(cli_bin / "claude"), "-p", DRAIN_PROMPT, "--mcp-config", ".mcp.json",
                         "--strict-mcp-config"],
                        clean_env(workspace.home, **recipe.model_env(workspace.home, standin),
                                  **{TOKEN: credential}), workspace.project)
    output = transcript(completed, standin)
    assert recipe.tool("claim_next") in standin.called_tools(), output  # it tried
    todo.refresh_from_db()
    assert todo.state == "pending", (todo.state, output)


def test_gemini_cli_in_an_untrusted_folder_does_not_load_the_project_settings(
        cli_bin, endpoint_for, workspace):
    """Why the Gemini recipe trusts the folder: headless, Gemini CLI skips an untrusted
    folder's .gemini/settings.json, MCP servers included."""
    endpoint, credential, mcp_url = endpoint_for("gemini-untrusted")
    todo = make_todo(endpoint)
    recipe = GeminiCli()
    with recipe.standin_class("direct") as standin:
        recipe.configure(workspace.project, workspace.home, standin, mcp_url)
        (workspace.home / ".gemini" / "trustedFolders.json").write_text("{}")
        completed = run(recipe.direct_argv(cli_bin),
                        clean_env(workspace.home, **recipe.model_env(workspace.home, standin),
                                  **{TOKEN: credential}), workspace.project)
    output = transcript(completed, standin)
    assert not McpSession.objects.filter(endpoint=endpoint).exists(), output
    assert not recipe.tools() & standin.offered_tools(), output
    todo.refresh_from_db()
    assert todo.state == "pending", (todo.state, output)


def test_plain_script_recipe_drains_a_todo_under_the_runner(endpoint_for, workspace):
    """The plain-script recipe: the todo JSON on stdin, exit 0 → complete with the stdout
    tail; the script gets its todo's own token, never the endpoint's credential."""
    endpoint, credential, mcp_url = endpoint_for("plain-script")
    todo = make_todo(endpoint)
    script = workspace.project / "handle-todo"
    script.write_text(textwrap.dedent("""\
        #!/usr/bin/env python3
        import json, os, sys
        todo = json.load(sys.stdin)
        print(f"handled todo {todo['id']} from queue {todo['queue']}",
              os.environ.get("SWITCHBOARD_TOKEN", "no token")[:4])
    """))
    script.chmod(0o755)
    completed = subprocess.run(
        [sys.executable, str(RUNNER), "--url", mcp_url, "--once", "--", str(script)],
        env=clean_env(workspace.home, **{TOKEN: credential}), cwd=workspace.project, input="",
        capture_output=True, text=True, timeout=CLI_TIMEOUT_SECONDS)
    assert completed.returncode == 0, completed.stderr
    todo.refresh_from_db()
    assert todo.state == "done", (todo.state, todo.last_error, completed.stderr)
    assert todo.result["stdout_tail"] == f"handled todo {todo.pk} from queue inbox sbt_\n"
