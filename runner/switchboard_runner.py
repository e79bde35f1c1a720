#!/usr/bin/env python3
"""switchboard runner: turn any agent CLI into a switchboard worker (CONTRACT §13).

    export SWITCHBOARD_TOKEN=sbk_…
    python switchboard_runner.py --url https://switchboard.example/mcp/my-agent \\
        --concurrency 2 --max-runtime 3600 -- claude -p "Do the todo on stdin …"

A client of the vended MCP endpoint and nothing more: it needs the ``mcp`` SDK and the standard
library, never the server's code, so it installs alone on the agent's machine
(``pip install -r requirements.txt``).

* Finding work: one MCP session with its notification stream, where a doorbell or digest
  (``notifications/claude/channel``) wakes the runner at once; otherwise ``claim_next`` with
  ``wait_seconds`` (a long poll). A server that does not know ``wait_seconds`` gets short polls
  every ``--poll-seconds`` instead.
* Per claimed todo: the agent command (everything after ``--``) runs in its own process group
  with the todo JSON on stdin, ``SWITCHBOARD_TODO_ID`` / ``SWITCHBOARD_LEASE_ID`` /
  ``SWITCHBOARD_URL`` in its environment (plus the token variable, passed through) and
  ``{todo_json}`` ``{todo_id}`` ``{title}`` substituted in its arguments. The runner heartbeats
  the lease (fenced by ``lease_id``) every third of its length and stops the agent if the lease
  is lost.
* When the agent exits: if it settled the todo itself (its own MCP connection, the same
  ``lease_id``), nothing more; else exit 0 → ``complete`` with the tail of stdout, non-zero →
  ``fail`` with the exit code and the tail of stderr, over ``--max-runtime`` → the process group
  is killed and the todo failed.
* SIGTERM/SIGINT: no new claims; running agents get ``--grace-seconds`` to finish, then are
  killed and failed (a second signal skips the grace). A runner killed outright loses only its
  leases: they lapse and the todos come back (the queue's own guarantee).
"""

import argparse
import asyncio
import json
import logging
import os
import re
import shlex
import shutil
import signal
import sys
import time
from collections import deque
from datetime import datetime

from mcp import Client
from mcp.client.extension import ClientExtension, NotificationBinding
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError
from pydantic import BaseModel  # installed with the mcp SDK (its own models are pydantic)

log = logging.getLogger("switchboard.runner")

CHANNEL_METHOD = "notifications/claude/channel"
INVALID_PARAMS = -32602  # JSON-RPC: a server without long poll refuses the unknown argument
MAX_WAIT = 60  # claim_next's wait_seconds upper bound (CONTRACT §6)
# A tool call that is not a long poll answers in milliseconds; this only bounds a dead peer.
CALL_TIMEOUT_SECONDS = 30.0
# Beyond the long poll itself, time for the server's answer to arrive.
LONG_POLL_SLACK_SECONDS = 30.0
# SIGTERM to the agent's process group first, SIGKILL if it is still there after this.
KILL_GRACE_SECONDS = 5.0
# What of the agent's output lands in the todo's result / error.
TAIL_BYTES = 4000
ERROR_TAIL_CHARS = 500
# Reconnect backoff after the session breaks (server restart, network): doubling to the cap.
RECONNECT_FIRST_SECONDS = 0.5
RECONNECT_MAX_SECONDS = 30.0
# complete/fail are retried this long through a broken connection; past it the lease lapses
# and the todo comes back by itself, which is the right outcome for an unreachable server.
SETTLE_RETRY_SECONDS = 60.0
# The SDK retries a dropped notification stream twice at the server's retry hint (3 s); past
# this with no stream open the session is reopened (checked every STREAM_CHECK_SECONDS).
STREAM_LOST_SECONDS = 10.0
STREAM_CHECK_SECONDS = 2.0
# list_todos' page size: the live-state check after a lost lease looks at this many per state.
LIST_LIMIT = 200
# --once gives up (exit 1) after this many failed claims in a row with nothing running.
ONCE_ERROR_LIMIT = 3


class Refused(Exception):
    """A domain refusal from a tool (``isError`` with ``error.code``)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class Unreachable(Exception):
    """The call did not get an answer (connection down, session gone, timeout)."""


# -- logging ---------------------------------------------------------------------------------


def _field(value) -> str:
    text = str(value)
    if text and not any(c.isspace() or c in '"=' for c in text):
        return text
    return json.dumps(text[:120], ensure_ascii=False)


def log_event(event: str, **fields) -> None:
    """One line per event: ``claim todo_id=12 queue=issues title="…"`` (never a token or a
    payload)."""
    log.info(" ".join([event] + [f"{key}={_field(value)}" for key, value in fields.items()
                                 if value is not None]))


# -- the MCP session -------------------------------------------------------------------------


class ChannelParams(BaseModel):
    content: str = ""
    meta: dict[str, str] = {}


class ChannelBell(ClientExtension):
    """Observe ``notifications/claude/channel``. The SDK hands notifications outside the core
    protocol only to a bound extension (its ``message_handler`` never sees them)."""

    identifier = "com.anthropic/claude-channel"

    def __init__(self, on_ring):
        self.on_ring = on_ring

    def notifications(self):
        return [NotificationBinding(method=CHANNEL_METHOD, params_type=ChannelParams,
                                    handler=self._ring)]

    async def _ring(self, params: ChannelParams):
        self.on_ring(params.meta)


class StreamWatch:
    """Counts the session's open notification streams (GET responses) through an HTTP response
    hook. The SDK reopens a dropped stream only twice and then gives up quietly; after a server
    restart longer than that the runner would hear no doorbell again. The owner task reopens
    the whole session when no stream has been open for STREAM_LOST_SECONDS."""

    def __init__(self):
        self.open = 0
        self.quiet_since = time.monotonic()

    async def on_response(self, response):
        if response.request.method != "GET" or response.status_code != 200:
            return
        self.open += 1
        close = response.aclose
        closed = False

        async def aclose():
            nonlocal closed
            try:
                await close()
            finally:
                if not closed:
                    closed = True
                    self.open -= 1
                    if not self.open:
                        self.quiet_since = time.monotonic()

        response.aclose = aclose

    def lost(self) -> bool:
        return not self.open and time.monotonic() - self.quiet_since > STREAM_LOST_SECONDS


class Switchboard:
    """One MCP session, kept open by its own task and reopened with backoff when it breaks.

    The SDK's client lives in anyio task groups that must be exited by the task that entered
    them, so one owner task holds it; callers on other tasks use ``call``. Heartbeats and
    settles are fenced by ``lease_id``, so they work from a reopened session too."""

    def __init__(self, url: str, token: str, on_ring):
        self.url, self._token, self._on_ring = url, token, on_ring
        self._client = None
        self._ready = asyncio.Event()
        self._broken = asyncio.Event()
        self._closing = False
        self._owner = None
        self.first_error = None  # set when the first connection attempt fails

    def start(self):
        self._owner = asyncio.create_task(self._hold())

    async def _hold(self):
        delay = RECONNECT_FIRST_SECONDS
        while not self._closing:
            http = create_mcp_http_client(headers={"Authorization": f"Bearer {self._token}"})
            streams = StreamWatch()
            http.event_hooks = {"response": [streams.on_response]}
            try:
                # mode="legacy": the initialize handshake and a session, which is what carries
                # the notification stream (switchboard deliberately speaks only that era).
                async with http, Client(streamable_http_client(self.url, http_client=http),
                                        mode="legacy", extensions=[ChannelBell(self._on_ring)],
                                        read_timeout_seconds=CALL_TIMEOUT_SECONDS) as client:
                    self._client = client
                    self._ready.set()
                    delay = RECONNECT_FIRST_SECONDS
                    log_event("connected", url=self.url)
                    while not self._broken.is_set():
                        await wait_first(self._broken.wait(), timeout=STREAM_CHECK_SECONDS)
                        if streams.lost():
                            log_event("stream_lost", reopening="session")
                            break
            except Exception as error:  # noqa: BLE001 — any failure: log, back off, reconnect
                if self.first_error is None and not self._ready.is_set():
                    self.first_error = error
                log_event("connection_error", error=_describe(error), retry_in_s=delay)
            finally:
                self._client = None
                self._ready.clear()
                self._broken.clear()
            if self._closing:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_SECONDS)

    async def wait_connected(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def call(self, name: str, arguments: dict, *, timeout: float = CALL_TIMEOUT_SECONDS):
        """The tool's ``structuredContent``; raises Refused (a domain refusal), MCPError with
        ``INVALID_PARAMS`` (a malformed call), or Unreachable."""
        if not await self.wait_connected(timeout):
            raise Unreachable("not connected")
        client = self._client
        try:
            answer = await client.call_tool(name, arguments, read_timeout_seconds=timeout)
        except MCPError as error:
            if error.code == INVALID_PARAMS:
                raise
            self._break(client)  # the session is gone or timed out: open a fresh one
            raise Unreachable(_describe(error)) from error
        except Exception as error:  # noqa: BLE001 — transport faults come in many types
            self._break(client)
            raise Unreachable(_describe(error)) from error
        content = answer.structured_content
        if content is None:
            content = json.loads(answer.content[0].text) if answer.content else {}
        if answer.is_error:
            error = content.get("error") or {}
            raise Refused(error.get("code", "unknown"), error.get("message", ""))
        return content

    def _break(self, client):
        # A call that failed on a session already replaced says nothing about the new one.
        if client is self._client:
            self._broken.set()

    def reopen(self):
        self._broken.set()

    async def close(self):
        self._closing = True
        self._broken.set()
        if self._owner is not None:
            await self._owner


def _describe(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return f"{type(error).__name__}: {text}"[:200]


# -- the agent process -----------------------------------------------------------------------


class Tail:
    """The last ``limit`` bytes of a stream."""

    def __init__(self, limit: int = TAIL_BYTES):
        self.limit, self.chunks, self.size = limit, deque(), 0

    def add(self, chunk: bytes):
        self.chunks.append(chunk)
        self.size += len(chunk)
        while self.size - len(self.chunks[0]) >= self.limit:
            self.size -= len(self.chunks.popleft())

    def text(self) -> str:
        data = b"".join(self.chunks)[-self.limit:]
        # NUL is not storable in a todo's result (PostgreSQL text/jsonb).
        return data.decode("utf-8", "replace").replace("\x00", "")


async def _drain(stream, tail: Tail):
    while chunk := await stream.read(65536):
        tail.add(chunk)


PLACEHOLDER = re.compile(r"\{(todo_json|todo_id|title)\}")


def agent_argv(command: list[str], todo: dict) -> list[str]:
    """Substitute the three placeholders, literally (a prompt may hold other braces), in one
    pass: a title or payload that itself contains ``{title}`` or ``{todo_id}`` is text, never
    substituted again. Each result stays one argument (no shell sees it)."""
    values = {"todo_json": json.dumps(todo, ensure_ascii=False), "todo_id": str(todo["id"]),
              "title": todo.get("title") or ""}
    return [PLACEHOLDER.sub(lambda match: values[match.group(1)], arg) for arg in command]


def agent_env(todo: dict, url: str) -> dict:
    """The runner's own environment (PATH, HOME, the token variable, the agent's API keys) plus
    the todo's coordinates."""
    env = dict(os.environ)
    env.update(SWITCHBOARD_TODO_ID=str(todo["id"]), SWITCHBOARD_LEASE_ID=todo.get("lease_id") or "",
               SWITCHBOARD_URL=url)
    return env


def _parent_death_signal():
    """``preexec_fn`` for the agent (Linux; None elsewhere): if the runner dies, even by
    SIGKILL, the agent gets SIGTERM (PR_SET_PDEATHSIG) instead of working on under a lease that
    is lapsing. Its writes are fenced by the lease either way; this saves the wasted work. The
    libc function is looked up here, in the parent, so the forked child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def set_signal():
        prctl(pr_set_pdeathsig, signal.SIGTERM)

    return set_signal


async def stop_group(proc) -> None:
    """SIGTERM the agent's process group, SIGKILL it if it is still there after the grace."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_SECONDS), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        if wait is None:
            await proc.wait()
            return
        try:
            await asyncio.wait_for(proc.wait(), wait)
            return
        except asyncio.TimeoutError:
            continue


def lease_seconds(todo: dict) -> float:
    """The granted lease length, from two server timestamps (so no clock skew): a claim sets
    ``updated_at = now`` and ``lease_expires_at = now + ttl``."""
    def parse(value):
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    try:
        return (parse(todo["lease_expires_at"]) - parse(todo["updated_at"])).total_seconds()
    except (KeyError, TypeError, ValueError):
        return 300.0


async def wait_first(*awaitables, timeout=None):
    """Wait for the first of ``awaitables`` (coroutines are wrapped and cancelled after)."""
    tasks = [a if isinstance(a, asyncio.Future) else asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task, awaitable in zip(tasks, awaitables):
            if task is not awaitable:
                task.cancel()


# -- the runner ------------------------------------------------------------------------------


class Runner:
    def __init__(self, args, token: str):
        self.args = args
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

    # -- notifications

    def on_ring(self, meta: dict):
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
        answered there is nothing), ``retry`` (at once), ``error`` (logged; retry later),
        ``fatal`` (logged; stop) or ``stopped``."""
        arguments = {}
        if self.queues:
            arguments["queues"] = self.queues
        if self.args.lease_seconds:
            arguments["lease_ttl_seconds"] = self.args.lease_seconds
        wait = self.wait_seconds
        if wait:
            arguments["wait_seconds"] = wait
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
        if todo is None:
            return "empty", None
        if self.stopping.is_set():  # claimed just as the stop came: hand it straight back
            await self.release(todo)
            return "stopped", None
        log_event("claim", todo_id=todo["id"], queue=todo.get("queue"),
                  attempt=todo.get("attempts"), lease_s=round(lease_seconds(todo)),
                  title=todo.get("title"))
        return "todo", todo

    def _no_long_poll(self, message: str):
        log_event("long_poll_unavailable", poll_s=self.args.poll_seconds, server_said=message)
        self.wait_seconds = 0
        return "retry", None

    async def release(self, todo: dict):
        try:
            await self.sb.call("release", {"todo_id": todo["id"], "lease_id": todo["lease_id"]})
            log_event("released", todo_id=todo["id"])
        except (Refused, Unreachable, MCPError) as error:
            log_event("release_failed", todo_id=todo["id"], error=str(error))

    async def serve(self) -> int:
        """Claim while there is room, until stopped (or, with --once, until drained)."""
        errors = 0
        idle = False  # logged once per idle stretch, not per poll
        while not self.stopping.is_set():
            if len(self.tasks) >= self.args.concurrency:
                self.task_done.clear()
                await wait_first(self.task_done.wait(), self.stopping.wait())
                continue
            self.wake.clear()  # a ring from here on means: look again
            started = time.monotonic()
            wait = self.wait_seconds
            outcome, todo = await self.claim()
            if outcome == "todo":
                errors, idle = 0, False
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
            if not idle:
                idle = True
                log_event("idle", running=len(self.tasks), long_poll_s=self.wait_seconds or None,
                          poll_s=None if self.wait_seconds else self.args.poll_seconds)
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

    def _forget(self, task):
        self.tasks.discard(task)
        self.task_done.set()

    # -- one todo

    async def run_todo(self, todo: dict):
        todo_id = todo["id"]
        argv = agent_argv(self.args.command, todo)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=agent_env(todo, self.args.url),
                start_new_session=True, preexec_fn=self.parent_death_signal)
        except OSError as error:
            # The runner's command is broken, not the todo: give it back, attempt refunded.
            log_event("start_failed", todo_id=todo_id, error=_describe(error))
            await self.release(todo)
            return
        started = time.monotonic()
        log_event("start", todo_id=todo_id, pid=proc.pid)
        out, err = Tail(), Tail()
        readers = [asyncio.create_task(_drain(proc.stdout, out)),
                   asyncio.create_task(_drain(proc.stderr, err))]
        feeder = asyncio.create_task(self._feed(proc, todo))
        lease_lost = asyncio.Event()
        beats = asyncio.create_task(self.heartbeat(todo, lease_lost))
        exited = asyncio.create_task(proc.wait())
        deadline = started + self.args.max_runtime
        stopped_for = None
        try:
            await wait_first(exited, lease_lost.wait(), self.kill_now.wait(),
                             timeout=max(0.0, deadline - time.monotonic()))
            if not exited.done():
                stopped_for = ("lease_lost" if lease_lost.is_set() else
                               "shutdown" if self.kill_now.is_set() else "max_runtime")
                log_event("stopping_agent", todo_id=todo_id, reason=stopped_for)
            # Whatever the reason, the group ends with the agent: no stray children keep
            # working (or keep its output pipes open) after it is settled.
            await stop_group(proc)
        finally:
            beats.cancel()
            feeder.cancel()
        await wait_first(asyncio.gather(*readers), timeout=2.0)
        for reader in readers:
            reader.cancel()
        code = proc.returncode
        elapsed = round(time.monotonic() - started, 1)
        log_event("exit", todo_id=todo_id, code=code, elapsed_s=elapsed, reason=stopped_for)
        await self.settle(todo, code, stopped_for, out.text(), err.text(), elapsed)

    async def _feed(self, proc, todo):
        try:
            proc.stdin.write(json.dumps(todo, ensure_ascii=False).encode() + b"\n")
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the agent does not read stdin: fine
        finally:
            proc.stdin.close()

    async def heartbeat(self, todo: dict, lease_lost: asyncio.Event):
        """Every third of the lease: extend it (fenced by lease_id). On lease_lost: when the
        todo is still live (back to pending, or someone else's claim) stop the agent; when it
        is no longer live the agent most likely settled it itself, so let it finish."""
        interval = max(lease_seconds(todo) / 3, 0.2)
        pause = interval
        while True:
            await asyncio.sleep(pause)
            pause = interval
            try:
                await self.sb.call("heartbeat",
                                   {"todo_id": todo["id"], "lease_id": todo["lease_id"]},
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

    async def settle(self, todo, code, stopped_for, stdout, stderr, elapsed):
        if stopped_for == "lease_lost":
            return  # not ours any more: whoever holds the todo now settles it
        if stopped_for == "max_runtime":
            verb, arguments = "fail", {
                "error": f"max runtime exceeded ({self.args.max_runtime:g} s): agent killed",
                "result": {"exit_code": code, "stderr_tail": stderr, "stdout_tail": stdout}}
        elif stopped_for == "shutdown":
            verb, arguments = "fail", {
                "error": self.shutdown_error,
                "result": {"exit_code": code, "stderr_tail": stderr, "stdout_tail": stdout}}
        elif code == 0:
            verb, arguments = "complete", {"result": {"exit_code": 0, "stdout_tail": stdout,
                                                      "elapsed_seconds": elapsed}}
        else:
            how = (f"agent killed by signal {signal.Signals(-code).name}" if code < 0
                   else f"agent exited with code {code}")
            last = " ".join(stderr.split())[-ERROR_TAIL_CHARS:]
            verb, arguments = "fail", {"error": f"{how}: {last}" if last else how,
                                       "result": {"exit_code": code, "stderr_tail": stderr}}
        arguments.update(todo_id=todo["id"], lease_id=todo["lease_id"])
        give_up = time.monotonic() + SETTLE_RETRY_SECONDS
        delay = RECONNECT_FIRST_SECONDS
        while True:
            try:
                await self.sb.call(verb, arguments)
                log_event("completed" if verb == "complete" else "failed", todo_id=todo["id"],
                          error=arguments.get("error"))
                return
            except Refused as refused:
                if refused.code == "already_done":
                    log_event("settled_by_agent", todo_id=todo["id"], todo_state="done")
                    return
                state = await self.live_state(todo) if refused.code == "lease_lost" else None
                log_event("settle_refused", todo_id=todo["id"], verb=verb, code=refused.code,
                          todo_state=state or "ended", message=refused.message)
                return
            except (Unreachable, MCPError) as error:
                if time.monotonic() > give_up:
                    log_event("settle_gave_up", todo_id=todo["id"], verb=verb, error=str(error))
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_SECONDS)

    # -- the whole run

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal, sig.name)
        self.sb.start()
        try:
            if self.args.once and not await self.sb.wait_connected(CALL_TIMEOUT_SECONDS):
                log_event("giving_up", reason="could not connect",
                          error=_describe(self.sb.first_error) if self.sb.first_error else None)
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
        if not await sb.wait_connected(CALL_TIMEOUT_SECONDS):
            print(f"could not connect to {args.url}", file=sys.stderr)
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
            print(f"todo {todo['id']} [{todo.get('queue')}] {todo.get('title')!r}: "
                  f"SWITCHBOARD_TODO_ID={todo['id']} {shlex.join(agent_argv(args.command, todo))}")
        return 0
    except (Refused, Unreachable, MCPError) as error:
        print(f"dry run failed: {error}", file=sys.stderr)
        return 1
    finally:
        await sb.close()


# -- command line ----------------------------------------------------------------------------


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


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="switchboard_runner.py",
        description="Claim switchboard todos and run an agent command for each.",
        epilog="Placeholders in the command: {todo_json} {todo_id} {title}. The todo JSON is "
               "also on the agent's stdin; its environment carries SWITCHBOARD_TODO_ID, "
               "SWITCHBOARD_LEASE_ID, SWITCHBOARD_URL and the token variable.")
    parser.add_argument("--url", default=os.environ.get("SWITCHBOARD_URL"),
                        help="the endpoint's MCP URL, …/mcp/<slug> (default: $SWITCHBOARD_URL)")
    parser.add_argument("--token-env", default="SWITCHBOARD_TOKEN", metavar="NAME",
                        help="environment variable holding the bearer credential "
                             "(default SWITCHBOARD_TOKEN)")
    parser.add_argument("--concurrency", type=_positive(int, 1), default=1, metavar="N",
                        help="at most this many agents at once (default 1)")
    parser.add_argument("--max-runtime", type=_positive(float, 1), default=3600.0,
                        metavar="SECONDS",
                        help="seconds an agent may run before it is killed and the todo failed "
                             "(default 3600)")
    parser.add_argument("--grace-seconds", type=_positive(float, 0), default=30.0,
                        metavar="SECONDS",
                        help="on SIGTERM/SIGINT, how long running agents may finish (default 30)")
    parser.add_argument("--queues", type=_queues, metavar="A,B",
                        help="only these queues (comma-separated)")
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
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("give the agent command after --")
    if not args.url:
        parser.error("--url is required (or set SWITCHBOARD_URL)")
    return args, parser


def main(argv=None) -> int:
    args, parser = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, datefmt="%Y-%m-%dT%H:%M:%S",
                        format="%(asctime)s.%(msecs)03dZ switchboard-runner %(message)s")
    logging.Formatter.converter = time.gmtime
    # The SDK logs each GET-stream reconnect at INFO; keep the runner's one-line-per-event log.
    logging.getLogger("mcp").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    token = os.environ.get(args.token_env)
    if not token:
        parser.error(f"the environment variable {args.token_env} (--token-env) is empty")
    if shutil.which(args.command[0]) is None:
        parser.error(f"agent command not found: {args.command[0]}")
    if args.dry_run:
        return asyncio.run(dry_run(args, token))
    return asyncio.run(Runner(args, token).run())


if __name__ == "__main__":
    sys.exit(main())
