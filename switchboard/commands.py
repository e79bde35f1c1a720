"""Shared shape of switchboard's management commands (CONTRACT §11).

Every command that prints accepts ``--json`` and then prints exactly one JSON object on stdout;
errors go to stderr with a non-zero exit (``CommandError``).
"""

import json
import os
import shlex
import socket
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

# How long the drift check waits for something to answer at the default public URL.
PUBLIC_URL_PROBE_SECONDS = 0.5


class JsonCommand(BaseCommand):
    def create_parser(self, prog_name, subcommand, **kwargs):
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        return parser

    def emit(self, options, data: dict, human: str):
        if any(key.endswith("_url") for key in data):
            warning = public_url_drift_warning()
            if warning:
                self.stderr.write(warning)  # stderr: stdout keeps exactly what --json promises
        if options.get("json"):
            self.stdout.write(json.dumps(data))
        else:
            self.stdout.write(human)


def _answers(url: str) -> bool:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", port),
                                      timeout=PUBLIC_URL_PROBE_SECONDS):
            return True
    except OSError:
        return False


def public_url_drift_warning(environ=None) -> str:
    """A warning for commands that print URLs: SWITCHBOARD_PUBLIC_URL is unset and nothing
    answers at the default it falls back to, so the printed URLs are likely not where this
    server is reached ("" when it is set, or when something answers there)."""
    environ = os.environ if environ is None else environ
    if environ.get("SWITCHBOARD_PUBLIC_URL"):
        return ""
    url = settings.SWITCHBOARD_PUBLIC_URL
    if _answers(url):
        return ""
    return (f"warning: SWITCHBOARD_PUBLIC_URL is unset and nothing answers at {url}: the URLs "
            "printed assume a server there. Set SWITCHBOARD_PUBLIC_URL to the address "
            "agents and senders reach this server at (e.g. https://switchboard.example.com).")


def get_user(username: str):
    try:
        return get_user_model().objects.get(username=username)
    except get_user_model().DoesNotExist:
        raise CommandError(
            f"no user {username!r} (create one: manage.py createsuperuser)"
        ) from None


def csv_list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


# -- connecting an agent (CONTRACT §6, §11) -------------------------------------------------------

# The environment variable the printed client config reads the bearer from. Claude Code expands
# ``${VAR}`` in .mcp.json, so the file can be committed while the credential stays in the shell.
TOKEN_VARIABLE = "SWITCHBOARD_TOKEN"
MCP_SERVER_NAME = "switchboard"


def mcp_json(mcp_url: str) -> dict:
    """The ``.mcp.json`` for an endpoint: never the credential itself, only its variable."""
    return {"mcpServers": {MCP_SERVER_NAME: {
        "type": "http", "url": mcp_url,
        "headers": {"Authorization": f"Bearer ${{{TOKEN_VARIABLE}}}"},
    }}}


# Codex's per-call tool timeout must outlast claim_next's longest long poll (60 s), or Codex
# gives up on a wait the server is still holding.
CODEX_TOOL_TIMEOUT_SECONDS = 90


def claude_mcp_add_line(mcp_url: str) -> str:
    """``claude mcp add`` for the endpoint. Single quotes: the shell passes ``${SWITCHBOARD_TOKEN}``
    through literally and Claude Code expands it each time it connects, so the secret never
    lands in its config (double quotes would store the expanded credential)."""
    header = shlex.quote(f"Authorization: Bearer ${{{TOKEN_VARIABLE}}}")
    return (f"claude mcp add --transport http --scope local {MCP_SERVER_NAME} "
            f"{shlex.quote(mcp_url)} --header {header}")


def codex_config_toml(mcp_url: str) -> str:
    """The ``~/.codex/config.toml`` table: the bearer read from the environment by name."""
    return "\n".join([
        f"[mcp_servers.{MCP_SERVER_NAME}]",
        f"url = {json.dumps(mcp_url)}",
        f'bearer_token_env_var = "{TOKEN_VARIABLE}"',
        f"tool_timeout_sec = {CODEX_TOOL_TIMEOUT_SECONDS}",
    ])


def gemini_settings_json(mcp_url: str) -> dict:
    """Gemini CLI's ``settings.json`` entry: it expands ``${VAR}`` in headers; ``trust`` lets a
    headless run call the tools without a confirmation prompt."""
    return {"mcpServers": {MCP_SERVER_NAME: {
        "httpUrl": mcp_url,
        "headers": {"Authorization": f"Bearer ${{{TOKEN_VARIABLE}}}"},
        "trust": True,
    }}}


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
        f"  {claude_mcp_add_line(mcp_url)}",
        "",
        "Codex: add to ~/.codex/config.toml (tool_timeout_sec outlasts a 60 s long poll):",
        codex_config_toml(mcp_url),
        "",
        "Gemini CLI: .gemini/settings.json (headless runs also need the folder trusted):",
        json.dumps(gemini_settings_json(mcp_url), indent=2),
        "",
        "headless agents, the runner and permissions: docs/agents.md",
    ])
