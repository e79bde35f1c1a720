"""What an agent run cost, from the CLI's own report (docs/runner.md#usage): Claude Code's
``--output-format json`` result, Codex's ``exec --json`` events, Gemini CLI's
``--output-format json`` stats, or a usage file the agent writes itself
(``SWITCHBOARD_USAGE_FILE``). The runner sends it with ``complete`` or ``fail`` as ``usage``.

The report is also how the runner knows the run's outcome and final answer: ``ok`` False is a
run the CLI itself reports as failed, whatever its exit code; ``text`` its final answer."""

import json
import os
from dataclasses import dataclass

USAGE_FILE_VARIABLE = "SWITCHBOARD_USAGE_FILE"
USAGE_KEYS = ("input_tokens", "output_tokens", "cost_usd", "turns", "model")
# The whole of stdout is kept (up to this) only when the command prints a report to parse.
REPORT_MAX_BYTES = 8 * 1024 * 1024
# Keeps a usage file an agent writes from being more than a usage report.
USAGE_FILE_MAX_BYTES = 64 * 1024
MODEL_MAX_CHARS = 100


@dataclass
class Report:
    usage: dict | None = None
    ok: bool | None = None
    text: str | None = None


def _name(argv0: str) -> str:
    return os.path.basename(argv0)


def _unwrapped(command: list[str]) -> list[str]:
    """The agent's own command behind ``setpriv … --`` (the separate-user recipe)."""
    if command and _name(command[0]) == "setpriv" and "--" in command:
        return command[command.index("--") + 1:]
    return command


def _option(args: list[str], *names: str) -> str | None:
    """The value of ``--name value`` or ``--name=value`` among ``args`` (the last one given)."""
    value = None
    for position, arg in enumerate(args):
        for name in names:
            if arg == name and position + 1 < len(args):
                value = args[position + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def report_format(command: list[str]) -> str | None:
    """Which CLI report the agent command prints on stdout: ``claude``, ``codex``, ``gemini``,
    or None (no report the runner reads)."""
    command = _unwrapped(command)
    if not command:
        return None
    name, args = _name(command[0]), command[1:]
    if name == "claude" and _option(args, "--output-format") == "json":
        return "claude"
    if name == "codex" and "exec" in args and "--json" in args:
        return "codex"
    if name == "gemini" and _option(args, "--output-format", "-o") == "json":
        return "gemini"
    return None


def _whole(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _model(name) -> str | None:
    return name[:MODEL_MAX_CHARS] if isinstance(name, str) and name else None


def _json_object(text: str):
    """The JSON object ``text`` is, or the last line of it that is one (a CLI may print a
    warning line before its report)."""
    try:
        value = json.loads(text)
        return value if isinstance(value, dict) else None
    except ValueError:
        pass
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None


def _claude(text: str) -> Report:
    result = _json_object(text)
    if result is None or result.get("type") != "result":
        return Report()
    tokens = result.get("usage") or {}
    models = result.get("modelUsage") or {}
    model = max(models, key=lambda name: _whole((models[name] or {}).get("outputTokens")),
                default=None) if isinstance(models, dict) else None
    usage = {
        # Cache writes and reads are input tokens too (billed at their own rates).
        "input_tokens": sum(_whole(tokens.get(name)) for name in (
            "input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")),
        "output_tokens": _whole(tokens.get("output_tokens")),
        "turns": _whole(result.get("num_turns")),
    }
    cost = result.get("total_cost_usd")
    if isinstance(cost, (int, float)) and not isinstance(cost, bool) and cost >= 0:
        usage["cost_usd"] = cost
    if _model(model):
        usage["model"] = _model(model)
    ok = not result.get("is_error") and result.get("subtype") == "success"
    answer = result.get("result")
    return Report(usage=usage, ok=ok, text=answer if isinstance(answer, str) else None)


def _codex(text: str) -> Report:
    usage = {"input_tokens": 0, "output_tokens": 0, "turns": 0}
    seen, failed, answer, error = False, False, None, None
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        kind = event.get("type")
        if kind == "turn.completed":
            seen = True
            tokens = event.get("usage") or {}
            usage["input_tokens"] += _whole(tokens.get("input_tokens"))
            usage["output_tokens"] += _whole(tokens.get("output_tokens"))
            usage["turns"] += 1
        elif kind in ("turn.failed", "error"):
            seen = failed = True
            detail = event.get("error") if kind == "turn.failed" else event
            message = (detail or {}).get("message") if isinstance(detail, dict) else None
            error = message if isinstance(message, str) else error
        elif kind == "item.completed":
            item = event.get("item") or {}
            if item.get("type") == "agent_message" and isinstance(item.get("text"), str):
                answer = item["text"]
    if not seen:
        return Report()
    return Report(usage=usage, ok=not failed, text=error if failed else answer)


def _gemini(text: str) -> Report:
    result = _json_object(text)
    if result is None or not ({"response", "stats", "error"} & set(result)):
        return Report()
    models = ((result.get("stats") or {}).get("models") or {})
    usage = {"input_tokens": 0, "output_tokens": 0, "turns": 0}
    main = None
    for name, stats in models.items() if isinstance(models, dict) else ():
        stats = stats or {}
        tokens = stats.get("tokens") or {}
        usage["input_tokens"] += _whole(tokens.get("prompt"))
        # Thinking is billed as output.
        usage["output_tokens"] += _whole(tokens.get("candidates")) + _whole(tokens.get("thoughts"))
        usage["turns"] += _whole((stats.get("api") or {}).get("totalRequests"))
        if "main" in (stats.get("roles") or {}) or main is None:
            main = name
    if _model(main):
        usage["model"] = _model(main)
    error = result.get("error")
    if error:
        message = error.get("message") if isinstance(error, dict) else str(error)
        return Report(usage=usage, ok=False, text=message if isinstance(message, str) else None)
    answer = result.get("response")
    return Report(usage=usage, ok=True, text=answer if isinstance(answer, str) else None)


PARSERS = {"claude": _claude, "codex": _codex, "gemini": _gemini}


def read_report(fmt: str | None, stdout: str) -> Report:
    """The CLI's report in ``stdout`` (empty Report: none found or no format)."""
    if fmt is None:
        return Report()
    return PARSERS[fmt](stdout)


def read_usage_file(path: str) -> tuple[dict | None, str | None]:
    """``(usage, problem)`` from the file an agent may write: a JSON object of USAGE_KEYS.
    ``(None, None)`` when it wrote none; a file that is not such an object is a ``problem``
    (the runner logs it and sends no usage: the server would refuse the whole settle)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(USAGE_FILE_MAX_BYTES + 1)
    except FileNotFoundError:
        return None, None
    except OSError as error:
        return None, f"unreadable: {error}"
    if len(data) > USAGE_FILE_MAX_BYTES:
        return None, f"over {USAGE_FILE_MAX_BYTES} bytes"
    try:
        usage = json.loads(data)
    except ValueError:
        return None, "not JSON"
    if not isinstance(usage, dict):
        return None, "not a JSON object"
    unknown = sorted(set(usage) - set(USAGE_KEYS))
    if unknown:
        return None, f"unknown keys {unknown} (known: {', '.join(USAGE_KEYS)})"
    return {key: value for key, value in usage.items() if value is not None}, None


# The agent CLIs that settle their own todo and exit 0 when switchboard refused or could not be
# reached: under the runner they need --require-settled.
SETTLING_CLIS = {"claude": "Claude Code", "codex": "Codex", "gemini": "Gemini CLI"}


def settling_cli(command: list[str]) -> str | None:
    """The product name when ``command`` runs one of SETTLING_CLIS, else None."""
    command = _unwrapped(command)
    return SETTLING_CLIS.get(_name(command[0])) if command else None
