"""How to point an agent at an endpoint: one snippet per client, without the credential.

Every snippet names the environment variable the credential lives in (``SWITCHBOARD_TOKEN``),
never the credential, so a page can show it and a file holding it can be committed. Pure
functions over the MCP URL: the endpoint page, management commands and docs can all render the
same text.
"""

import json
import shlex

TOKEN_VARIABLE = "SWITCHBOARD_TOKEN"
SERVER_NAME = "switchboard"
# The longest long poll ``claim_next`` grants (its ``wait_seconds`` ceiling): a client whose
# tool timeout is shorter would give up on a claim the server is still holding open for it.
LONGEST_LONG_POLL_SECONDS = 60
TOOL_TIMEOUT_SECONDS = 120
BEARER_HEADER = f"Bearer ${{{TOKEN_VARIABLE}}}"
RUNNER_PROMPT = "Handle switchboard todo {todo_id}: {title} (the todo JSON is on stdin)"


def mcp_json(mcp_url: str) -> str:
    """Claude Code's project ``.mcp.json``: Claude Code expands ``${VAR}`` in headers."""
    return json.dumps({"mcpServers": {SERVER_NAME: {
        "type": "http", "url": mcp_url, "headers": {"Authorization": BEARER_HEADER},
    }}}, indent=2)


def claude_mcp_add(mcp_url: str) -> str:
    """``claude mcp add``: the header in single quotes, so the shell passes ``${…}`` through
    and Claude Code expands it from the environment when it connects; ``--scope local`` keeps
    it out of the project's files."""
    return (f"claude mcp add --transport http --scope local {SERVER_NAME} "
            f"{shlex.quote(mcp_url)} --header 'Authorization: {BEARER_HEADER}'")


def codex_config_toml(mcp_url: str) -> str:
    """Codex's ``~/.codex/config.toml``: it reads the bearer from the named variable."""
    return "\n".join([
        f"[mcp_servers.{SERVER_NAME}]",
        f"url = {json.dumps(mcp_url)}",
        f'bearer_token_env_var = "{TOKEN_VARIABLE}"',
        f"# above the longest long poll of claim_next ({LONGEST_LONG_POLL_SECONDS} s)",
        f"tool_timeout_sec = {TOOL_TIMEOUT_SECONDS}",
    ])


def gemini_settings_json(mcp_url: str) -> str:
    """Gemini CLI's ``settings.json``: ``httpUrl`` for Streamable HTTP, ``$VAR`` expanded."""
    return json.dumps({"mcpServers": {SERVER_NAME: {
        "httpUrl": mcp_url, "headers": {"Authorization": BEARER_HEADER},
        "timeout": TOOL_TIMEOUT_SECONDS * 1000, "trust": True,
    }}}, indent=2)


def runner_line(mcp_url: str) -> str:
    """The runner, for agents without MCP channels: it claims and runs a command per todo."""
    return (f"switchboard-runner --url {shlex.quote(mcp_url)} --token-env {TOKEN_VARIABLE} "
            f"-- claude -p {shlex.quote(RUNNER_PROMPT)}")


def export_line() -> str:
    return f"export {TOKEN_VARIABLE}=…  # the credential, shown once when vended or rotated"


def all_snippets(mcp_url: str) -> list[tuple[str, str, str]]:
    """``(key, title, text)`` for every client, in the order a page shows them."""
    return [
        ("mcp-json", "Claude Code: .mcp.json (safe to commit)", mcp_json(mcp_url)),
        ("claude-mcp-add", "Claude Code: claude mcp add", claude_mcp_add(mcp_url)),
        ("codex", "Codex: ~/.codex/config.toml", codex_config_toml(mcp_url)),
        ("gemini", "Gemini CLI: ~/.gemini/settings.json", gemini_settings_json(mcp_url)),
        ("runner", "Any CLI agent: the runner", runner_line(mcp_url)),
    ]
