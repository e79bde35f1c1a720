"""The worker: claim todos (doorbells and digests wake it, a long poll waits for work), run
the agent command for each, heartbeat its lease, settle the todo when the agent exits.

* Per claimed todo: the agent command runs in its own process group with the todo JSON on
  stdin and in a private file, a scrubbed environment, and the placeholders substituted in
  its arguments. The runner heartbeats the lease (fenced by ``lease_id``) every third of its
  length, at most FOLLOWUP_HEARTBEAT_SECONDS apart and at once on a holder's doorbell, and
  stops the agent if the lease is lost. Follow-ups go to the file ``SWITCHBOARD_FOLLOWUPS``
  names; asked to stop (``cancel_requested``), it stops the agent and cancels the todo.
* A todo the command cannot even start with (exec failure, arguments over the system's limit)
  is failed with the reason, so backoff and the dead letter apply: given back, it would be
  claimed again at once, forever.
* When the agent exits: if it settled the todo itself (its own MCP connection, the same
  ``lease_id``), nothing more; else exit 0 → ``complete`` with the tail of stdout (with
  --require-settled: ``fail``, as the agent was expected to settle it, whatever its CLI's
  report says), non-zero → ``fail`` with the exit code and the tails, over --max-runtime →
  the group is killed and the todo failed. Every settle of the runner's carries the run's
  usage, from the agent's usage file or its CLI's report (``usage``). When the agent settled
  the todo itself, that settle is refused, and the server records its usage on the attempt
  the agent settled under the same lease: logged ``usage_sent``, or ``usage_unsent`` with the
  reason when the answer says it was not recorded.
* A command that cannot start for a reason of its own (its file, its interpreter, its
  permissions: the next todo would fail the same way) fails the first todo only: no claimed
  todo is started after it, and one claimed or started beside it is released. Then ``--once``
  stops claiming and exits 1 naming why, and a long-running runner claims nothing while it
  waits with backoff, looking at the command again after each wait.
* SIGTERM/SIGINT: no new claims; running agents get --grace-seconds to finish, then are
  killed and failed (a second signal skips the grace). A runner killed outright loses only
  its leases: they lapse and the todos come back (the queue's own guarantee).
"""

import asyncio
import errno
import json
import logging
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone

from mcp.shared.exceptions import MCPError

from . import traces
from .agent import (TAIL_BYTES, Tail, _drain, _parent_death_signal, agent_argv, agent_env,
                    append_followups, command_problem, create_followups_file, ended_with,
                    failure_message, first_error_line, last_line, oversized_argument,
                    render_prompt, start_failure, stop_group, write_todo_file)
from .usage import REPORT_MAX_BYTES, Report, read_report, read_usage_file
from .session import (CALL_TIMEOUT_SECONDS, INVALID_PARAMS, RECONNECT_FIRST_SECONDS,
                      RECONNECT_MAX_SECONDS, Refused, Switchboard, Unreachable, _describe,
                      escape_unprintable, log_event, wait_first)

MAX_WAIT = 60  # claim_next's wait_seconds upper bound
# Each todo's private directory names the runner's pid, so a later runner can tell the ones a
# killed runner left behind (SIGKILL runs no cleanup) from those of a runner still at work.
TODO_DIR_PREFIX = "switchboard-todo-"


def todo_dir_prefix() -> str:
    return f"{TODO_DIR_PREFIX}{os.getpid()}-"


def sweep_stale_todo_dirs(root: str | None = None) -> list[str]:
    """Remove the private todo directories of runners that are gone (this user's only): a
    killed runner leaves the todo JSON it was working on behind."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(TODO_DIR_PREFIX):
            continue
        pid_text = name[len(TODO_DIR_PREFIX):].split("-", 1)[0]
        path = os.path.join(root, name)
        try:
            if not pid_text.isdigit() or os.lstat(path).st_uid != os.getuid():
                continue
            if _alive(int(pid_text)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
# At most this long between heartbeats, whatever the lease: a follow-up or a request to stop
# reaches the agent within it even when no doorbell says so (a doorbell beats at once).
FOLLOWUP_HEARTBEAT_SECONDS = 10.0
# Doorbells to a todo's holder: look now (heartbeat) rather than claim.
HOLDER_RING_KINDS = frozenset({"followup", "cancel_requested"})
# Beyond the long poll itself, time for the server's answer to arrive.
LONG_POLL_SLACK_SECONDS = 30.0
# complete/fail are retried this long through a broken connection; past it the lease lapses
# and the todo comes back by itself, which is the right outcome for an unreachable server.
SETTLE_RETRY_SECONDS = 60.0
# list_todos' page size: the live-state check after a lost lease looks at this many per state.
LIST_LIMIT = 200
# --once gives up (exit 1) after this many failed claims in a row with nothing running.
ONCE_ERROR_LIMIT = 3
NOT_SETTLED = "agent exited 0 without settling the todo"
# An exec failure that is the command's own (no such file, no interpreter, not executable, not
# a format the kernel runs), whatever the todo: every todo would fail the same way. E2BIG is
# the todo's (its arguments), and a fork's EAGAIN or ENOMEM passes.
SETUP_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EACCES, errno.EPERM,
                          errno.ENOEXEC})
# What a shell or env(1) answers when the program it was to run is not found (127) or cannot
# be executed (126): an agent behind `sh -c` or `#!/usr/bin/env`.
SETUP_EXIT_CODES = {126: "found but not executable", 127: "not found"}
# Long-running, after such a failure: wait this long before looking at the command again,
# doubling up to the most. Looking costs nothing (no todo is claimed for it).
SETUP_RETRY_FIRST_SECONDS = 5.0
SETUP_RETRY_MAX_SECONDS = 300.0
# The server hands the same repository token back while it has more than this left, and a
# new one after: the runner asks again then (docs/write-back.md#repository-tokens-for-agents).
REPO_TOKEN_REFRESH = timedelta(minutes=5)
# After a refused or failed refresh.
REPO_TOKEN_RETRY_SECONDS = 30.0
# At least this long between two asks, for a token already inside the margin.
REPO_TOKEN_MIN_WAIT_SECONDS = 5.0
REPO_TOKEN_FILE_VARIABLE = "SWITCHBOARD_REPO_TOKEN_FILE"


def repo_token_wait_seconds(expires_at, now: datetime | None = None) -> float:
    """How long until a repository token expiring at ``expires_at`` (ISO 8601) is due for a
    refresh: REPO_TOKEN_REFRESH before it, at least REPO_TOKEN_MIN_WAIT_SECONDS."""
    try:
        expires = datetime.fromisoformat(str(expires_at).replace("Z", "+00:00"))
        left = (expires - (now or datetime.now(timezone.utc))).total_seconds()
    except (TypeError, ValueError):
        return REPO_TOKEN_RETRY_SECONDS
    return max(left - REPO_TOKEN_REFRESH.total_seconds(), REPO_TOKEN_MIN_WAIT_SECONDS)


def write_secret_file(path: str, secret: str):
    """``secret`` into ``path``, created 0600 and swapped in whole: a reader never sees half."""
    partial = f"{path}.partial"
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as out:
        out.write(secret + "\n")
    os.replace(partial, path)


def lease_seconds(todo: dict) -> float:
    """The granted lease length, from two server timestamps (so no clock skew): a claim sets
    ``updated_at = now`` and ``lease_expires_at = now + ttl``."""
    def parse(value):
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    try:
        return (parse(todo["lease_expires_at"]) - parse(todo["updated_at"])).total_seconds()
    except (KeyError, TypeError, ValueError):
        return 300.0



class Runner:
    def __init__(self, args, token: str):
        self.args = args
        self.token = token
        self.prompt_template = args.prompt_template
        self.report_format = getattr(args, "report_format", None)
        self.queues = args.queues
        self.sb = Switchboard(args.url, token, self.on_ring)
        self.wait_seconds = 0 if args.once else args.wait_seconds
        self.tasks: set[asyncio.Task] = set()
        self.stopping = asyncio.Event()   # first signal: no new claims
        self.kill_now = asyncio.Event()   # grace over (or second signal): kill running agents
        self.wake = asyncio.Event()       # a doorbell or digest arrived
        self.task_done = asyncio.Event()
        self.parent_death_signal = _parent_death_signal()
        self.shutdown_error = (f"runner stopped: agent killed after the "
                               f"{args.grace_seconds:g} s grace period")
        # Why the agent command cannot start (set by the first todo that found out), or None.
        self.cannot_start: str | None = None
        self.setup_retry_seconds = SETUP_RETRY_FIRST_SECONDS
        # Per running todo id: set by a holder's doorbell to heartbeat at once.
        self.beat_now: dict[str, asyncio.Event] = {}
        # Per claimed todo id: its todo token, the only switchboard credential its agent gets.
        self.todo_tokens: dict[str, str | None] = {}

    # -- notifications

    def on_ring(self, meta: dict):
        if meta.get("kind") in HOLDER_RING_KINDS:
            beat = self.beat_now.get(str(meta.get("todo_id")))
            log_event("holder_doorbell", kind=meta["kind"], todo_id=meta.get("todo_id"),
                      running=beat is not None)
            if beat is not None:
                beat.set()
            return
        if self.queues and meta.get("queue") and meta["queue"] not in self.queues:
            return
        if meta.get("kind") == "digest" and "todo_id" not in meta:
            log_event("digest", pending=meta.get("pending"), queues=meta.get("queues"),
                      reason=meta.get("reason"))
        else:
            log_event("doorbell", todo_id=meta.get("todo_id"), queue=meta.get("queue"))
        self.wake.set()

    def on_signal(self, signame: str):
        if self.stopping.is_set():
            log_event("stop_now", signal=signame, running=len(self.tasks))
            self.shutdown_error = f"runner stopped: agent killed at a second {signame}"
            self.kill_now.set()
            return
        log_event("stopping", signal=signame, running=len(self.tasks),
                  grace_s=self.args.grace_seconds)
        self.stopping.set()

    # -- claiming

    async def claim(self):
        """One claim_next: ``(outcome, todo)`` with outcome ``todo``, ``empty`` (the server
        answered there is nothing; the second part then says what held work back:
        ``over_budget``, ``at_capacity`` or None), ``retry`` (at once), ``error`` (logged;
        retry later), ``fatal`` (logged; stop) or ``stopped``."""
        arguments = {}
        if not self.args.accept_unverified:
            arguments["verified_only"] = True
        if self.queues:
            arguments["queues"] = self.queues
        if self.args.lease_seconds:
            arguments["lease_ttl_seconds"] = self.args.lease_seconds
        wait = self.wait_seconds
        if wait:
            arguments["wait_seconds"] = wait
        started_ns = traces.now_ns()
        call = asyncio.ensure_future(
            self.sb.call("claim_next", arguments, timeout=wait + LONG_POLL_SLACK_SECONDS))
        await wait_first(call, self.stopping.wait())
        if not call.done():
            call.cancel()
            if wait:
                # The SDK keeps the abandoned POST open in its transport; a long poll still
                # waiting there could claim a todo nobody would run (until its lease lapsed).
                # Reopening the session closes that request, and the server claims nothing for
                # a caller that went away. Running agents' calls are fenced by lease_id, so
                # the new session serves them.
                self.sb.reopen()
            return "stopped", None
        try:
            answer = call.result()
        except MCPError as error:
            if wait and error.code == INVALID_PARAMS:
                return self._no_long_poll(error.message)
            log_event("claim_error", error=_describe(error))
            return "error", None
        except Refused as refused:
            if wait and refused.code == "invalid_argument" and "wait_seconds" in refused.message:
                return self._no_long_poll(refused.message)
            log_event("claim_refused", code=refused.code, message=refused.message)
            # Queues outside the scope, or claim_next not granted: the runner's configuration
            # is wrong, and asking again will not change the answer.
            fatal = refused.code in ("not_in_scope", "verb_not_allowed")
            return ("fatal" if fatal else "error"), None
        except Unreachable as error:
            log_event("claim_error", error=str(error))
            return "error", None
        todo = answer.get("todo")
        if todo is not None:
            # The agent's credential for this todo alone; it dies with the lease.
            self.todo_tokens[todo["id"]] = answer.get("todo_token")
        if todo is None:
            # What held work back, when something did: the endpoint's daily budget is spent or
            # a cap is reached (docs/reference.md#usage-and-budgets), not an empty queue.
            held_back = next((why for why in ("over_budget", "at_capacity") if answer.get(why)),
                             None)
            return "empty", held_back
        if self.stopping.is_set():  # claimed just as the stop came: hand it straight back
            await self.release(todo)
            return "stopped", None
        # Recorded once the todo, and so its trace, is known.
        with traces.span("claim", todo, start_ns=started_ns,
                         **{"switchboard.attempt": todo.get("attempts")}):
            pass
        log_event("claim", todo_id=todo["id"], queue=todo.get("queue"),
                  attempt=todo.get("attempts"), lease_s=round(lease_seconds(todo)),
                  title=todo.get("title"))
        return "todo", todo

    def _no_long_poll(self, message: str):
        log_event("long_poll_unavailable", poll_s=self.args.poll_seconds, server_said=message)
        self.wait_seconds = 0
        return "retry", None

    async def release(self, todo: dict, reason: str | None = None):
        try:
            await self.sb.call("release", {"todo_id": todo["id"], "lease_id": todo["lease_id"]})
            log_event("released", todo_id=todo["id"], reason=reason)
        except (Refused, Unreachable, MCPError) as error:
            log_event("release_failed", todo_id=todo["id"], error=str(error))

    async def serve(self) -> int:
        """Claim while there is room, until stopped (or, with --once, until drained)."""
        errors = 0
        idle = None  # logged once per idle stretch and what held work back, not per poll
        while not self.stopping.is_set():
            if len(self.tasks) >= self.args.concurrency:
                self.task_done.clear()
                await wait_first(self.task_done.wait(), self.stopping.wait())
                continue
            if self.cannot_start:
                if self.args.once:
                    log_event("giving_up", level=logging.WARNING,
                              reason=f"the agent command cannot start: {self.cannot_start}")
                    return 1
                await self._wait_for_command()
                continue
            self.wake.clear()  # a ring from here on means: look again
            started = time.monotonic()
            wait = self.wait_seconds
            outcome, todo = await self.claim()
            if outcome == "todo":
                errors, idle = 0, None
                task = asyncio.create_task(self.run_todo(todo))
                self.tasks.add(task)
                task.add_done_callback(self._forget)
                continue
            if outcome == "stopped":
                break
            if outcome == "retry":
                continue
            if outcome == "fatal":
                return 1
            if outcome == "error":
                errors += 1
                if self.args.once and errors >= ONCE_ERROR_LIMIT and not self.tasks:
                    log_event("giving_up", reason=f"{errors} claims in a row failed")
                    return 1
                # Back off on repeated failures; the first retry is quick (a reopened session
                # after a server restart answers at once).
                await wait_first(self.stopping.wait(), timeout=min(
                    RECONNECT_FIRST_SECONDS * 2 ** (errors - 1), RECONNECT_MAX_SECONDS))
                continue
            errors = 0
            held_back = todo  # an empty answer's second part: over_budget, at_capacity or None
            if idle != (held_back or "empty"):
                idle = held_back or "empty"
                log_event("idle", running=len(self.tasks), long_poll_s=self.wait_seconds or None,
                          poll_s=None if self.wait_seconds else self.args.poll_seconds,
                          held_back=held_back)
            if self.args.once:
                if not self.tasks:
                    break  # drained
                # A running agent may fail and free its todo: look again when one ends.
                self.task_done.clear()
                await wait_first(self.task_done.wait(), self.wake.wait(), self.stopping.wait())
                continue
            if wait and time.monotonic() - started >= wait / 2:
                continue  # the long poll did the waiting: ask again at once
            await wait_first(self.wake.wait(), self.stopping.wait(), timeout=self.args.poll_seconds)
        return 0

    async def _wait_for_command(self):
        """Long-running, while the command cannot start: wait (with backoff) and look at it
        again, claiming nothing; clears ``cannot_start`` when nothing is seen wrong with it."""
        delay = self.setup_retry_seconds
        log_event("agent_cannot_start", level=logging.WARNING, reason=self.cannot_start,
                  retry_in_s=f"{delay:g}")
        await wait_first(self.stopping.wait(), timeout=delay)
        self.setup_retry_seconds = min(delay * 2, SETUP_RETRY_MAX_SECONDS)
        if self.stopping.is_set():
            return
        problem = command_problem(self.args.command[0])
        if problem:
            self.cannot_start = problem
            return
        # Nothing seen wrong: the next claim tries it. Should it fail again (a cause a look
        # cannot see), one more todo fails and the wait doubles.
        log_event("agent_command_retry", after_s=f"{delay:g}")
        self.cannot_start = None

    def _command_cannot_start(self, reason: str):
        if self.cannot_start is None:
            self.cannot_start = reason
        self.wake.set()

    def _forget(self, task):
        self.tasks.discard(task)
        self.task_done.set()

    # -- one todo

    async def run_todo(self, todo: dict):
        # The agent's TRACEPARENT is this run's span when the runner exports, else the todo's.
        with traces.span("run", todo) as run:
            # The follow-ups file goes with the directory when the todo is settled.
            with tempfile.TemporaryDirectory(prefix=todo_dir_prefix()) as directory:
                await self._run_todo(todo, write_todo_file(directory, todo), run.traceparent,
                                     create_followups_file(directory, todo.get("followups")))

    async def _run_todo(self, todo: dict, todo_file: str, traceparent: str | None,
                        followups_file: str | None = None):
        todo_id = todo["id"]
        prompt = render_prompt(self.prompt_template, todo, todo_file)
        argv = agent_argv(self.args.command, todo, prompt)
        # Beside the todo file, in the todo's private directory (removed afterwards).
        usage_file = os.path.join(os.path.dirname(todo_file), "usage.json")
        env = agent_env(todo, self.args.url, pass_env=self.args.pass_env,
                        token=self.todo_tokens.pop(todo_id, None),
                        usage_file=usage_file, traceparent=traceparent,
                        followups_file=followups_file)
        if todo.get("cancel_requested") is True:
            # Asked to stop before it started (an older server handed such a todo on).
            log_event("cancel_requested", todo_id=todo_id, started=False)
            await self._settle_call(todo, "cancel", {"reason": "asked to stop before it started"})
            return
        if self.cannot_start:
            # Claimed beside the todo that found the command broken (or by a claim already in
            # flight): every start would fail the same way, and this todo is not at fault.
            await self.release(todo, reason="the agent command cannot start")
            return
        repo_token_file = os.path.join(os.path.dirname(todo_file), "repo-token")
        repo_token = await self.fetch_repo_token(todo, env, repo_token_file)
        reason = oversized_argument(argv)
        proc, setup_failure = None, False
        if reason is None:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True,
                    preexec_fn=self.parent_death_signal)
            except OSError as error:
                reason = start_failure(error, argv)
                setup_failure = error.errno in SETUP_ERRNOS
        else:
            reason = (f"agent not started: {reason}; read the todo from stdin (or the file the "
                      f"prompt's {{todo_file}} names) instead of {{todo_json}}")
        if proc is None:
            log_event("start_failed", todo_id=todo_id, error=reason)
            if setup_failure and self.cannot_start:
                # Another todo (claimed beside this one) already found the command broken:
                # this one is not at fault, and no more claims follow to loop on it.
                await self.release(todo, reason="the agent command cannot start")
                return
            if setup_failure:
                self._command_cannot_start(reason)
            # Failed, not released: a release would hand the same todo straight back to this
            # runner (or another), which fails the same way, in a loop that stalls the queue.
            # A failure counts an attempt, backs off, and ends in the dead letter.
            await self._settle_call(todo, "fail", {"error": reason,
                                                   "result": {"started": False}})
            return
        started = time.monotonic()
        log_event("start", todo_id=todo_id, pid=proc.pid)
        out = Tail(keep_bytes=REPORT_MAX_BYTES if self.report_format else 0)
        err = Tail()
        readers = [asyncio.create_task(_drain(proc.stdout, out)),
                   asyncio.create_task(_drain(proc.stderr, err))]
        feeder = asyncio.create_task(self._feed(proc, todo))
        lease_lost, cancel_requested = asyncio.Event(), asyncio.Event()
        self.beat_now[todo_id] = asyncio.Event()
        beats = asyncio.create_task(self.heartbeat(todo, lease_lost, followups_file,
                                                   cancel_requested))
        refresher = (asyncio.create_task(self.refresh_repo_token(todo, repo_token,
                                                                 repo_token_file))
                     if repo_token else None)
        exited = asyncio.create_task(proc.wait())
        deadline = started + self.args.max_runtime
        stopped_for = None
        try:
            await wait_first(exited, lease_lost.wait(), self.kill_now.wait(),
                             cancel_requested.wait(),
                             timeout=max(0.0, deadline - time.monotonic()))
            if not exited.done():
                stopped_for = ("lease_lost" if lease_lost.is_set() else
                               "shutdown" if self.kill_now.is_set() else
                               "cancel_requested" if cancel_requested.is_set() else
                               "max_runtime")
                log_event("stopping_agent", todo_id=todo_id, reason=stopped_for)
            # Whatever the reason, the group ends with the agent: no stray children keep
            # working (or keep its output pipes open) after it is settled. Asked to stop, the
            # agent gets --grace-seconds to wrap up first.
            await stop_group(proc, **({"grace_seconds": self.args.grace_seconds}
                                      if stopped_for == "cancel_requested" else {}))
        finally:
            beats.cancel()
            feeder.cancel()
            if refresher is not None:
                refresher.cancel()
            self.beat_now.pop(todo_id, None)
        await wait_first(asyncio.gather(*readers), timeout=2.0)
        for reader in readers:
            reader.cancel()
        code = proc.returncode
        elapsed = round(time.monotonic() - started, 1)
        log_event("exit", todo_id=todo_id, code=code, elapsed_s=elapsed, reason=stopped_for)
        if stopped_for is None and code in SETUP_EXIT_CODES:
            if self.cannot_start:
                # Started beside the todo that found the command broken, before that was known:
                # only the first such todo is failed (one per look at the command).
                await self.release(todo, reason="the agent command cannot start")
                return
            self._command_cannot_start(
                f"agent exited with code {code} (what a shell or env answers when the program "
                f"it runs is {SETUP_EXIT_CODES[code]}): "
                f"{first_error_line(err.text(), out.text()) or last_line(err.text(), out.text())}")
        elif stopped_for is None:
            self.setup_retry_seconds = SETUP_RETRY_FIRST_SECONDS
        # What the agent was given, so that an echo of it is not taken for its error line.
        echoed = (*argv[1:], json.dumps(todo, ensure_ascii=False))
        report = self.read_usage(todo_id, usage_file, out)
        # A report's stdout is JSON, whose lines say "is_error" whatever happened: its own
        # text stands for stdout instead (settle).
        notable = err.notable + (out.notable if report.ok is None else [])
        await self.settle(todo, code, stopped_for, out.text(), err.text(), elapsed, echoed,
                          notable=notable, report=report)

    def read_usage(self, todo_id, usage_file: str, out: Tail) -> Report:
        """The run's report: the CLI's own (its outcome, final answer and usage), with the
        usage the agent wrote to its usage file instead, when it wrote one."""
        report = read_report(self.report_format, out.whole() or "")
        if self.report_format and report.ok is None:
            log_event("no_report", todo_id=todo_id, format=self.report_format)
        written, problem = read_usage_file(usage_file)
        if problem:
            log_event("usage_file_ignored", todo_id=todo_id, problem=problem)
        if written is not None:
            report.usage = written
        return report

    async def _feed(self, proc, todo):
        try:
            proc.stdin.write(json.dumps(todo, ensure_ascii=False).encode() + b"\n")
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the agent does not read stdin: fine
        finally:
            proc.stdin.close()

    async def heartbeat(self, todo: dict, lease_lost: asyncio.Event, followups_file=None,
                        cancel_requested: asyncio.Event | None = None):
        """Every third of the lease, at most FOLLOWUP_HEARTBEAT_SECONDS apart, and at once on a
        holder's doorbell: extend it (fenced by lease_id), append the follow-ups it answers to
        ``followups_file``, and set ``cancel_requested`` when the todo is asked to stop. On
        lease_lost: when the todo is still live (back to pending, or someone else's claim) stop
        the agent; when it is no longer live the agent most likely settled it itself, so let it
        finish."""
        interval = min(max(lease_seconds(todo) / 3, 0.2), FOLLOWUP_HEARTBEAT_SECONDS)
        pause = interval
        beat_now = self.beat_now.get(todo["id"]) or asyncio.Event()
        while True:
            await wait_first(beat_now.wait(), timeout=pause)
            beat_now.clear()
            pause = interval
            try:
                answer = await self.sb.call(
                    "heartbeat", {"todo_id": todo["id"], "lease_id": todo["lease_id"]},
                    timeout=max(interval, 1.0))
            except Refused as refused:
                state = await self.live_state(todo)
                log_event("lease_lost", todo_id=todo["id"], code=refused.code,
                          todo_state=state or "ended")
                if refused.code != "lease_lost" or state is not None:
                    lease_lost.set()
                return
            except (Unreachable, MCPError) as error:
                # Try again sooner: two missed beats at the full interval would lose the lease.
                pause = max(interval / 3, 0.2)
                log_event("heartbeat_error", todo_id=todo["id"], error=str(error))
                continue
            followups = answer.get("followups") if isinstance(answer, dict) else None
            if followups and followups_file is not None:
                try:
                    added = append_followups(followups_file, followups)
                except OSError as error:
                    log_event("followups_unwritten", todo_id=todo["id"], error=str(error))
                else:
                    log_event("followups", todo_id=todo["id"], added=added)
            if cancel_requested is not None and answer.get("cancel_requested") is True:
                log_event("cancel_requested", todo_id=todo["id"])
                cancel_requested.set()
                return

    async def fetch_repo_token(self, todo: dict, env: dict, path: str) -> dict | None:
        """With --repo-token-env: the todo's repository token (``repo_token``) in ``env`` under
        that name and in the 0600 file ``path`` (SWITCHBOARD_REPO_TOKEN_FILE), or None (logged
        once: no grant, or the call failed) and the agent runs without."""
        if not self.args.repo_token_env:
            return None
        answer = await self._call_repo_token(todo)
        if answer is None:
            return None
        env[self.args.repo_token_env] = answer["token"]
        env[REPO_TOKEN_FILE_VARIABLE] = path
        write_secret_file(path, answer["token"])
        log_event("repo_token", todo_id=todo["id"], repository=answer.get("repository"),
                  expires_at=answer.get("expires_at"))
        return answer

    async def _call_repo_token(self, todo: dict) -> dict | None:
        try:
            answer = await self.sb.call("repo_token", {"todo_id": todo["id"],
                                                       "lease_id": todo["lease_id"]})
        except Refused as refused:
            log_event("repo_token_refused", todo_id=todo["id"], code=refused.code,
                      message=refused.message)
            return None
        except (Unreachable, MCPError) as error:
            log_event("repo_token_error", todo_id=todo["id"], error=str(error))
            return None
        return answer if isinstance(answer, dict) and answer.get("token") else None

    async def refresh_repo_token(self, todo: dict, answer: dict, path: str):
        """While the agent runs: ask again when the token has less than REPO_TOKEN_REFRESH
        left (the server reuses or mints one) and rewrite ``path``; an environment cannot be
        changed from outside, so a long-running agent reads the file."""
        while True:
            await asyncio.sleep(repo_token_wait_seconds(answer.get("expires_at")))
            fresh = await self._call_repo_token(todo)
            if fresh is None:
                await asyncio.sleep(REPO_TOKEN_RETRY_SECONDS)
                continue
            if fresh["token"] != answer["token"]:
                write_secret_file(path, fresh["token"])
                log_event("repo_token_refreshed", todo_id=todo["id"],
                          expires_at=fresh.get("expires_at"))
            answer = fresh

    async def live_state(self, todo: dict):
        """``pending`` or ``claimed`` when the todo is live in its queue (within one page of
        each), else None: ended (done, failed or dead) — or beyond the page, which only costs
        a later kill."""
        for state in ("pending", "claimed"):
            try:
                page = await self.sb.call("list_todos", {"queue": todo["queue"], "state": state,
                                                         "limit": LIST_LIMIT})
            except (Refused, Unreachable, MCPError):
                return "unknown"
            if any(row.get("id") == todo["id"] for row in page.get("todos", [])):
                return state
        return None

    async def settle(self, todo, code, stopped_for, stdout, stderr, elapsed, echoed=(),
                     notable=(), report: Report | None = None):
        if stopped_for == "lease_lost":
            return  # not ours any more: whoever holds the todo now settles it
        report = report or Report()
        tails = {"exit_code": code, "stderr_tail": stderr, "stdout_tail": stdout}
        if report.text is not None:
            # The CLI's final answer (its report is JSON, not something to read in a tail).
            stdout = report.text[-TAIL_BYTES:]
        if stopped_for == "cancel_requested":
            verb, arguments = "cancel", {
                "reason": "asked to stop: the runner stopped the agent"}
        elif stopped_for == "max_runtime":
            verb, arguments = "fail", {
                "error": f"max runtime exceeded ({self.args.max_runtime:g} s): agent killed",
                "result": tails}
        elif stopped_for == "shutdown":
            verb, arguments = "fail", {"error": self.shutdown_error, "result": tails}
        elif code == 0 and report.ok is False:
            verb, arguments = "fail", {"error": failure_message(
                "agent reported an error", stdout, stderr, echoed, notable), "result": tails}
        elif code == 0 and self.args.require_settled:
            # The agent was to call complete/fail itself. Failing is the check: the statement
            # is fenced by the lease, so it is refused when the agent did settle (and lands
            # when it did not), with no window between looking and acting. An agent CLI that
            # lost its connection to switchboard still exits 0, and its report says success;
            # this catches that. The reason leads: the agent did not do what it was run for.
            verb, arguments = "fail", {"error": ended_with(NOT_SETTLED, stdout), "result": tails}
        elif code == 0 and report.ok:
            verb, arguments = "complete", {"result": {"summary": stdout, "exit_code": 0,
                                                      "elapsed_seconds": elapsed}}
        elif code == 0:
            verb, arguments = "complete", {"result": {"exit_code": 0, "stdout_tail": stdout,
                                                      "elapsed_seconds": elapsed}}
        else:
            how = (f"agent killed by signal {signal.Signals(-code).name}" if code < 0
                   else f"agent exited with code {code}")
            verb, arguments = "fail", {"error": failure_message(how, stdout, stderr, echoed,
                                                                notable),
                                       "result": tails}
        if report.usage:
            arguments["usage"] = report.usage
        await self._settle_call(todo, verb, arguments)

    async def _settle_call(self, todo, verb, arguments):
        with traces.span("settle", todo, **{"switchboard.verb": verb}):
            await self._settle(todo, verb, arguments)

    async def _settle(self, todo, verb, arguments):
        arguments = {**arguments, "todo_id": todo["id"], "lease_id": todo["lease_id"]}
        give_up = time.monotonic() + SETTLE_RETRY_SECONDS
        delay = RECONNECT_FIRST_SECONDS
        while True:
            try:
                await self.sb.call(verb, arguments)
                log_event({"complete": "completed", "cancel": "cancelled"}.get(verb, "failed"),
                          todo_id=todo["id"], error=arguments.get("error"))
                return
            except Refused as refused:
                if refused.code == "invalid_argument" and "usage" in arguments:
                    # A usage report the server refuses (an agent's file out of range) must not
                    # cost the settle: it goes without.
                    log_event("usage_refused", todo_id=todo["id"], message=refused.message)
                    arguments = {k: v for k, v in arguments.items() if k != "usage"}
                    continue
                if refused.code == "already_done":
                    self._settled_by_agent(todo, "done", verb, arguments, refused)
                    return
                state = await self.live_state(todo) if refused.code == "lease_lost" else None
                if state is None and refused.code == "lease_lost":
                    # The lease ended with the todo: the agent completed or failed it.
                    self._settled_by_agent(todo, "ended", verb, arguments, refused)
                    return
                log_event("settle_refused", todo_id=todo["id"], verb=verb, code=refused.code,
                          todo_state=state or "ended", message=refused.message)
                return
            except (Unreachable, MCPError) as error:
                if time.monotonic() > give_up:
                    log_event("settle_gave_up", todo_id=todo["id"], verb=verb, error=str(error))
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_SECONDS)

    @staticmethod
    def _settled_by_agent(todo, todo_state: str, verb: str, arguments: dict, refused: Refused):
        log_event("settled_by_agent", todo_id=todo["id"], todo_state=todo_state)
        if "usage" not in arguments:
            return
        # The refused settle carried the run's usage under the lease the agent settled with:
        # the server adds it to that attempt when the attempt has none (docs/runner.md#usage),
        # and its answer says whether it did. No second call: it would meet the same guard.
        if refused.data.get("usage_recorded") is True:
            log_event("usage_sent", todo_id=todo["id"], via=verb)
        else:
            # The attempt already had a report (the agent passed its own), or the todo was
            # handed out again since; a server from before this answer records none.
            log_event("usage_unsent", reason="not_recorded", code=refused.code,
                      todo_id=todo["id"])

    # -- the whole run

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal, sig.name)
        for path in sweep_stale_todo_dirs():
            log_event("removed_stale_todo_dir", path=path)
        self.sb.start()
        try:
            if self.args.once and not await self.sb.wait_first_connection(CALL_TIMEOUT_SECONDS):
                log_event("giving_up", reason="could not connect", **self.sb.first_failure())
                return 1
            status = await self.serve()
            if self.tasks:
                if not self.kill_now.is_set():
                    log_event("draining", running=len(self.tasks), grace_s=self.args.grace_seconds)
                    await wait_first(asyncio.wait(set(self.tasks)), self.kill_now.wait(),
                                     timeout=self.args.grace_seconds)
                if self.tasks:
                    self.kill_now.set()
                    await asyncio.wait(set(self.tasks))
            log_event("stopped")
            return status
        finally:
            await self.sb.close()


async def dry_run(args, token: str) -> int:
    """List what is pending and print the command each todo would get. Claims nothing."""
    sb = Switchboard(args.url, token, lambda meta: None)
    sb.start()
    try:
        if not await sb.wait_first_connection(CALL_TIMEOUT_SECONDS):
            print(f"could not connect to {args.url}: {sb.first_failure_text()}", file=sys.stderr)
            return 1
        todos = []
        for queue in args.queues or [None]:
            arguments = {"state": "pending", "limit": LIST_LIMIT}
            if queue:
                arguments["queue"] = queue
            todos += (await sb.call("list_todos", arguments)).get("todos", [])
        print(f"dry run: {len(todos)} pending todo(s) (nothing claimed); for each the runner "
              "would run, with the todo JSON on stdin:")
        for todo in todos:
            if todo.get("trust") == "unverified" and not args.accept_unverified:
                print(f"todo {todo['id']} [{todo.get('queue')}] {todo.get('title')!r}: "
                      "skipped (unverified; --accept-unverified runs it)")
                continue
            todo_file = f"<private dir>/todo-{todo['id']}.json"
            argv = agent_argv(args.command, todo,
                              render_prompt(args.prompt_template, todo, todo_file))
            # A scheduled todo is pending but not claimable before its not_before.
            when = f" (scheduled: not before {todo['not_before']})" if todo.get("not_before") else ""
            print(escape_unprintable(
                f"todo {todo['id']} [{todo.get('queue')}] {todo.get('title')!r}{when}: "
                f"SWITCHBOARD_TODO_ID={todo['id']} {shlex.join(argv)}", keep="\n"))
        return 0
    except (Refused, Unreachable, MCPError) as error:
        print(f"dry run failed: {error}", file=sys.stderr)
        return 1
    finally:
        await sb.close()

