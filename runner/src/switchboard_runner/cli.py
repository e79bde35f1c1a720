"""The command line: ``switchboard-runner [flags] -- agent command …`` runs the worker,
``switchboard-runner watch [flags]`` prints ready todos."""

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path

from . import __version__, credentials, traces
from .agent import (BASE_ENV, DEFAULT_PROMPT, REPORT_PROMPT, TOKEN_VARIABLE, command_problem,
                    misplaced_command_placeholder, misplaced_placeholder)
from .usage import report_format, settling_cli
from .work import MAX_WAIT, Runner, dry_run


def _queues(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("name at least one queue")
    return names


def _positive(kind, low, high=None):
    def parse(value):
        number = kind(value)
        if number < low or (high is not None and number > high):
            raise argparse.ArgumentTypeError(
                f"must be between {low} and {high}" if high is not None else f"must be ≥ {low}")
        return number
    return parse


def _variable_name(value: str) -> str:
    if not value or "=" in value or value.strip() != value:
        raise argparse.ArgumentTypeError("give a variable name (no value)")
    return value


class _PassTokenRefused(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error("--pass-token is gone: the agent gets its todo's own token as "
                     f"{TOKEN_VARIABLE} (valid for that todo and lease only), never the "
                     "runner's credential")


def _connection_flags(parser):
    parser.add_argument("--version", action="version",
                        version=f"switchboard-runner {__version__}")
    parser.add_argument("--url", default=os.environ.get("SWITCHBOARD_URL"),
                        help="the endpoint's MCP URL, …/mcp/<slug> (default: $SWITCHBOARD_URL)")
    parser.add_argument("--token-env", default="SWITCHBOARD_TOKEN", metavar="NAME",
                        help="environment variable holding the bearer credential "
                             "(default SWITCHBOARD_TOKEN); read once, then removed from the "
                             "runner's environment")
    parser.add_argument("--token-file", type=Path, metavar="PATH",
                        help="read the bearer credential from this file instead (its first "
                             "line; a pipe such as /dev/fd/3 works)")
    parser.add_argument("--queues", type=_queues, metavar="A,B",
                        help="only these queues (comma-separated)")
    parser.add_argument("--accept-unverified", action="store_true",
                        help="also take todos with trust 'unverified' (from anyone who knows "
                             "an unsigned webhook's URL); default: verified todos only")


def worker_parser():
    parser = argparse.ArgumentParser(
        prog="switchboard-runner",
        description="Claim switchboard todos and run an agent command for each. "
                    "'switchboard-runner watch --help': print ready todos instead.",
        epilog="Placeholders in the command: {prompt} (the built-in prompt, or --prompt-file's) "
               "{todo_id} {todo_json} {title}; keep {title} and {todo_json} out of instruction "
               "positions (they are the sender's text), and {title} after the agent's own -- "
               "or inside an option's value (--title={title}). The todo JSON is on the "
               "agent's stdin and in a private file the prompt names. Its environment: "
               f"{', '.join(BASE_ENV)}, SWITCHBOARD_TODO_ID, SWITCHBOARD_LEASE_ID, "
               f"SWITCHBOARD_URL, SWITCHBOARD_USAGE_FILE (where it may write its usage as "
               f"JSON), TRACEPARENT (the todo's trace, when it has one), the --pass-env "
               f"variables (OTEL_* for an agent that exports its own spans), "
               f"{TOKEN_VARIABLE} (the todo's own token, never the runner's credential) "
               f"and, with --repo-token-env, a repository token. "
               "A CLI's own report (claude/gemini --output-format json, codex exec --json) "
               "gives the run's outcome and usage, sent with the runner's complete or fail.")
    _connection_flags(parser)
    parser.add_argument("--pass-token", nargs=0, action=_PassTokenRefused,
                        help=argparse.SUPPRESS)
    parser.add_argument("--repo-token-env", type=_variable_name, metavar="NAME",
                        help="put a repository token for the todo (the repo_token tool: one "
                             "repository, the route's permissions) in the agent's environment "
                             "under NAME (e.g. GH_TOKEN), refreshed in the file "
                             "SWITCHBOARD_REPO_TOKEN_FILE names")
    parser.add_argument("--pass-env", action="append", default=[], type=_variable_name,
                        metavar="NAME",
                        help="pass this variable of the runner's environment to the agent "
                             "(repeatable; e.g. the agent's API key)")
    parser.add_argument("--prompt-file", type=Path, metavar="FILE",
                        help="replace the built-in prompt; it may use {todo_id} {queue} {kind} "
                             "{trust} {lease_id} {todo_file}")
    parser.add_argument("--require-settled", action="store_true",
                        help="the agent must call complete or fail itself: exit 0 without "
                             "that fails the todo, whatever its CLI's report says")
    parser.add_argument("--concurrency", type=_positive(int, 1), default=1, metavar="N",
                        help="at most this many agents at once (default 1)")
    parser.add_argument("--max-runtime", type=_positive(float, 1), default=3600.0,
                        metavar="SECONDS",
                        help="seconds an agent may run before it is killed and the todo failed "
                             "(default 3600)")
    parser.add_argument("--grace-seconds", type=_positive(float, 0), default=30.0,
                        metavar="SECONDS",
                        help="on SIGTERM/SIGINT, how long running agents may finish (default 30)")
    parser.add_argument("--lease-seconds", type=_positive(int, 1, 86400), metavar="SECONDS",
                        help="lease length per claim (default: the endpoint's)")
    parser.add_argument("--wait-seconds", type=_positive(int, 0, MAX_WAIT), default=30,
                        metavar="SECONDS",
                        help="long-poll claim_next this long when idle (0-60, default 30; "
                             "0: no long poll)")
    parser.add_argument("--poll-seconds", type=_positive(float, 0.1), default=10.0,
                        metavar="SECONDS",
                        help="without long poll, look for work this often when no doorbell "
                             "rings (default 10)")
    parser.add_argument("--once", action="store_true",
                        help="drain until nothing is claimable and no agent runs, then exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="claim nothing: list pending todos and print the command each "
                             "would get")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- the agent command and its arguments")
    return parser


def watch_parser():
    parser = argparse.ArgumentParser(
        prog="switchboard-runner watch",
        description="Print one line per todo that becomes ready, and nothing else: "
                    "id<TAB>queue<TAB>kind<TAB>trust<TAB>title (title sanitised). Claims "
                    "nothing; for Claude Code's Monitor tool and shell loops.")
    _connection_flags(parser)
    parser.add_argument("--poll-seconds", type=_positive(float, 0.5), default=30.0,
                        metavar="SECONDS",
                        help="list pending todos this often besides doorbells (default 30)")
    return parser


def parse_args(argv):
    """``(mode, args, parser)``: mode ``watch`` or ``work``."""
    if argv[:1] == ["watch"]:
        parser = watch_parser()
        args = parser.parse_args(argv[1:])
        mode = "watch"
    else:
        parser = worker_parser()
        args = parser.parse_args(argv)
        mode = "work"
        if args.command[:1] == ["--"]:
            args.command = args.command[1:]
        if not args.command:
            parser.error("give the agent command after --")
        if args.token_env in args.pass_env:
            parser.error(f"--pass-env {args.token_env} would hand the agent the runner's "
                         f"credential: the agent gets its todo's own token as {TOKEN_VARIABLE}")
        if args.repo_token_env in (*args.pass_env, TOKEN_VARIABLE):
            parser.error(f"--repo-token-env {args.repo_token_env}: that name is taken")
        # A CLI that prints its own report (claude/gemini --output-format json, codex exec
        # --json): without --require-settled the runner completes the todo from it, so the
        # agent is not asked to; with it, only the agent's own complete or fail counts.
        args.report_format = report_format(args.command)
        args.prompt_template = (REPORT_PROMPT if args.report_format and not args.require_settled
                                else DEFAULT_PROMPT)
        if args.prompt_file is not None:
            try:
                args.prompt_template = args.prompt_file.read_text(encoding="utf-8")
            except OSError as error:
                parser.error(f"--prompt-file: {error}")
            misplaced = misplaced_placeholder(args.prompt_template)
            if misplaced:
                parser.error(f"--prompt-file: {misplaced}")
        misplaced = misplaced_command_placeholder(args.command, args.prompt_template)
        if misplaced:
            parser.error(f"agent command: {misplaced}")
    if not args.url:
        parser.error("--url is required (or set SWITCHBOARD_URL)")
    return mode, args, parser


def main(argv=None) -> int:
    mode, args, parser = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING if mode == "watch" else logging.INFO,
                        stream=sys.stderr, datefmt="%Y-%m-%dT%H:%M:%S",
                        format="%(asctime)s.%(msecs)03dZ switchboard-runner %(message)s")
    logging.Formatter.converter = time.gmtime
    # The SDK logs each GET-stream reconnect at INFO; keep the runner's one-line-per-event log.
    logging.getLogger("mcp").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    token = credentials.read_credential(args.token_env, args.token_file)
    if not token:
        parser.error(f"--token-file {args.token_file}: empty or unreadable" if args.token_file
                     else f"the environment variable {args.token_env} (--token-env) is empty")
    credentials.make_undumpable()
    if mode == "work" and not args.require_settled and settling_cli(args.command):
        logging.warning("%s settles its own todo and exits 0 even when switchboard refused or "
                        "could not reach it: give --require-settled (docs/runner.md)",
                        settling_cli(args.command))
    if mode == "watch":
        from .watch import watch
        return asyncio.run(watch(args, token))
    problem = command_problem(args.command[0])
    if problem:
        parser.error(problem)
    if args.dry_run:
        return asyncio.run(dry_run(args, token))
    # Its own spans only where its environment configures an exporter (docs/runner.md#traces).
    try:
        traces.configure()
    except traces.Unsupported as error:
        # argparse's prefix and status, without its usage: no argument was wrong.
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(Runner(args, token).run())
    finally:
        traces.shutdown()
