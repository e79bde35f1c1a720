"""How to point an agent at an endpoint: one snippet per client, without the credential.

Every snippet names the environment variable the credential lives in (``SWITCHBOARD_TOKEN``),
never the credential, so a page can show it and a file holding it can be committed. Pure
functions over the MCP URL: the endpoint page and the commands that vend or rotate a credential
render the same text, and tests/test_cli_recipes.py configures the real CLIs with it.
"""

import json
import shlex

TOKEN_VARIABLE = "SWITCHBOARD_TOKEN"
SERVER_NAME = "switchboard"
# The longest long poll ``claim_next`` grants (its ``wait_seconds`` ceiling): a client whose
# tool timeout is shorter would give up on a claim the server is still holding open for it.
LONGEST_LONG_POLL_SECONDS = 60
TOOL_TIMEOUT_SECONDS = 90
BEARER_HEADER = f"Bearer ${{{TOKEN_VARIABLE}}}"
# The runner's built-in prompt frames the todo as data; the title never sits where the agent
# reads instructions. The agent may call only the verbs that settle or extend its own lease, and
# post_update, which reports its progress to the todo's source (the prompt tells it so).
RUNNER_AGENT_TOOLS = ",".join(f"mcp__{SERVER_NAME}__{verb}"
                              for verb in ("heartbeat", "complete", "fail", "post_update"))


def mcp_json(mcp_url: str) -> dict:
    """Claude Code's project ``.mcp.json``: Claude Code expands ``${VAR}`` in headers."""
    return {"mcpServers": {SERVER_NAME: {
        "type": "http", "url": mcp_url, "headers": {"Authorization": BEARER_HEADER},
    }}}


def claude_mcp_add(mcp_url: str) -> str:
    """``claude mcp add``: the header in single quotes, so the shell passes ``${…}`` through
    and Claude Code expands it from the environment when it connects (double quotes would store
    the expanded credential); ``--scope local`` keeps it out of the project's files."""
    return (f"claude mcp add --transport http --scope local {SERVER_NAME} "
            f"{shlex.quote(mcp_url)} --header 'Authorization: {BEARER_HEADER}'")


def codex_config_toml(mcp_url: str) -> str:
    """Codex's ``~/.codex/config.toml`` table: it reads the bearer from the named variable."""
    return "\n".join([
        f"[mcp_servers.{SERVER_NAME}]",
        f"url = {json.dumps(mcp_url)}",
        f'bearer_token_env_var = "{TOKEN_VARIABLE}"',
        f"# above the longest long poll of claim_next ({LONGEST_LONG_POLL_SECONDS} s)",
        f"tool_timeout_sec = {TOOL_TIMEOUT_SECONDS}",
    ])


def gemini_settings_json(mcp_url: str) -> dict:
    """Gemini CLI's ``settings.json`` entry: ``httpUrl`` for Streamable HTTP, ``${VAR}``
    expanded in headers; ``trust`` lets a headless run call the tools without a prompt."""
    return {"mcpServers": {SERVER_NAME: {
        "httpUrl": mcp_url, "headers": {"Authorization": BEARER_HEADER}, "trust": True,
    }}}


def runner_line(mcp_url: str) -> str:
    """The runner, for agents without MCP channels: it claims and runs a command per todo.
    The agent's environment is scrubbed, so the model's API key is passed by name (skipped
    when unset: a claude.ai sign-in needs none). With ``--output-format json`` Claude Code
    reports the run; the agent settles the todo itself with its todo's own token, which the
    runner gives it as SWITCHBOARD_TOKEN (never the endpoint's credential)."""
    return (f"switchboard-runner --url {shlex.quote(mcp_url)} --token-env {TOKEN_VARIABLE} "
            f"--require-settled --pass-env ANTHROPIC_API_KEY -- "
            f"claude -p '{{prompt}}' --output-format json --mcp-config .mcp.json "
            f"--strict-mcp-config --allowedTools {RUNNER_AGENT_TOOLS}")


def export_line() -> str:
    return f"export {TOKEN_VARIABLE}=…  # the credential, shown once when vended or rotated"


def all_snippets(mcp_url: str) -> list[tuple[str, str, str]]:
    """``(key, title, text)`` for every client, in the order a page shows them."""
    return [
        ("mcp-json", "Claude Code: .mcp.json (safe to commit)",
         json.dumps(mcp_json(mcp_url), indent=2)),
        ("claude-mcp-add", "Claude Code: claude mcp add", claude_mcp_add(mcp_url)),
        ("codex", "Codex: ~/.codex/config.toml", codex_config_toml(mcp_url)),
        ("gemini", "Gemini CLI: .gemini/settings.json",
         json.dumps(gemini_settings_json(mcp_url), indent=2)),
        ("runner", "Any CLI agent: the runner", runner_line(mcp_url)),
    ]


def connect_text(mcp_url: str, credential: str) -> str:
    """What a person pastes to connect an agent: the export line (the one place the credential
    appears), then for Claude Code, Codex and Gemini CLI a configuration that names the
    variable, never the credential (docs/agents.md has the full recipes)."""
    return "\n".join([
        "export the credential (shown only now; keep it out of files you commit):",
        f"  export {TOKEN_VARIABLE}={shlex.quote(credential)}",
        "",
        "Claude Code: .mcp.json (safe to commit: it names the variable, not the credential):",
        json.dumps(mcp_json(mcp_url), indent=2),
        "",
        "or register it with Claude Code (single quotes: the variable is stored, not the secret):",
        f"  {claude_mcp_add(mcp_url)}",
        "",
        f"Codex: add to ~/.codex/config.toml (tool_timeout_sec outlasts a "
        f"{LONGEST_LONG_POLL_SECONDS} s long poll):",
        codex_config_toml(mcp_url),
        "",
        "Gemini CLI: .gemini/settings.json (headless runs also need the folder trusted):",
        json.dumps(gemini_settings_json(mcp_url), indent=2),
        "",
        "headless agents, the runner and permissions: docs/agents.md",
    ])
