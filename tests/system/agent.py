"""An MCP agent process for the system suite: the official SDK client (Streamable HTTP) on one
endpoint, draining with claim_next + complete. One line per event on stdout (flushed):

    ready                                                      (a session is open)
    claimed <todo id> / completed <todo id> / lost <todo id>  (complete refused: lease_lost;
                                                   already_done, a retried complete whose
                                                   first answer was lost, is "completed")
    doorbell <todo id or "digest">                             (notifications/claude/channel)
    retry <exception type> <message>                   (a call failed; same session)
    recovered <tool>                                   (a call answered after failing)
    reconnect <exception type> <message>               (the client died, or its session kept
                                                        failing: a new session)
    done

    python -m tests.system.agent URL SLUG --credential-env VAR [--mode drain|hold]
        [--lease-seconds N] [--hold N] [--idle-seconds S] [--stop-file PATH]

The bearer comes from an environment variable (never argv: process listings are world-visible).
``drain`` ends when claim_next has answered empty for ``--idle-seconds`` in a row (other agents'
lapsed leases come back within lease + reaper interval) or when ``--stop-file`` exists. ``hold``
claims ``--hold`` todos and hangs with the leases held, waiting to be SIGKILLed (it polls until it got them).

A failed call (PostgreSQL restarting, a 5xx) is retried on the same client — the same MCP
session — until it answers; when the client itself dies, or its calls keep failing for
SESSION_GIVE_UP_SECONDS, the agent reconnects (see ``run``).
"""

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import anyio
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from tests.mcp_clients import ChannelListener

CALL_TIMEOUT_SECONDS = 10.0
RETRY_PAUSE_SECONDS = 0.2
# A fault (a killed web process, a PostgreSQL restart) must heal within this; beyond it the
# agent gives up loudly and the test fails on the unfinished ledger.
RETRY_WINDOW_SECONDS = 120.0
# Calls failing on one session for this long (the SDK client turns a proxy's 502 into an
# error answer and lives on, so it may never die by itself): the agent opens a new session, as
# an MCP harness reconnecting would. Longer than any fault's own healing (a web restart, a
# PostgreSQL restart: seconds), so a healthy session is not given up during one.
SESSION_GIVE_UP_SECONDS = 30.0


def say(*words):
    print(*words, flush=True)


async def print_doorbells(listener: ChannelListener):
    while True:
        _, params = await listener.received.get()
        say("doorbell", params.meta.get("todo_id") or params.meta.get("kind") or "?")


class SessionAbandoned(Exception):
    """Calls on this session kept failing for SESSION_GIVE_UP_SECONDS: open a new one."""


async def call(client, name, arguments):
    """One tool call, retried on the same session while it fails; after
    SESSION_GIVE_UP_SECONDS of failures the session is abandoned (``run`` opens a new one)."""
    give_up = time.monotonic() + SESSION_GIVE_UP_SECONDS
    failed = False
    while True:
        try:
            with anyio.fail_after(CALL_TIMEOUT_SECONDS):
                result = await client.call_tool(name, arguments)
            if result.is_error and (result.structured_content or {}).get("error", {}).get(
                    "code") not in ("lease_lost", "not_claimable", "not_found", "already_done"):
                # A domain answer we do not expect here (e.g. a 5xx turned into an error
                # result): treat like a transport failure and retry.
                raise RuntimeError(f"tool error {result.structured_content}")
            if failed:
                # The only sign of a recovered agent on an empty queue (an empty claim_next
                # prints nothing): the fault tests wait for it.
                say("recovered", name)
            return result
        except Exception as exc:  # noqa: BLE001 - any failure of the call is retried
            failed = True
            say("retry", type(exc).__name__, str(exc)[:200].replace("\n", " "))
            if time.monotonic() > give_up:
                raise SessionAbandoned(f"{name} failing for {SESSION_GIVE_UP_SECONDS:.0f} s") \
                    from exc
            await asyncio.sleep(RETRY_PAUSE_SECONDS)


async def work_one_session(args, credential, state) -> None:
    """Open one MCP session and drain (or hold) on it; returns when the work is over."""
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {credential}"})
    async with http:
        transport = streamable_http_client(f"{args.url}/mcp/{args.slug}", http_client=http)
        listener = ChannelListener()
        async with Client(transport, extensions=[listener], mode="legacy") as client:
            printer = asyncio.ensure_future(print_doorbells(listener))
            say("ready")
            try:
                idle_since = None
                while True:
                    if args.stop_file and Path(args.stop_file).exists():
                        return
                    answer = await call(client, "claim_next",
                                        {"lease_ttl_seconds": args.lease_seconds})
                    content = answer.structured_content or {}
                    if content.get("empty"):
                        if args.mode == "hold":  # wait for work to hold (the test delivers some)
                            await asyncio.sleep(0.05)
                            continue
                        idle_since = idle_since or time.monotonic()
                        if time.monotonic() - idle_since > args.idle_seconds:
                            return
                        await asyncio.sleep(0.25)
                        continue
                    idle_since = None
                    todo = content["todo"]
                    say("claimed", todo["id"])
                    if args.mode == "hold":
                        state["held"] += 1
                        if state["held"] >= args.hold:
                            say("holding")
                            await asyncio.sleep(3600)
                        continue
                    done = await call(client, "complete", {"todo_id": todo["id"],
                                                           "lease_id": todo["lease_id"],
                                                           "result": {"by": os.getpid()}})
                    code = (done.structured_content or {}).get("error", {}).get("code")
                    say("lost" if done.is_error and code != "already_done" else "completed",
                        todo["id"])
            finally:
                printer.cancel()


async def run(args, credential):
    """The SDK client does not outlive a request whose connection dies (the web process it
    talks to was SIGKILLed: the in-flight POST's error ends the client's task group), so the
    agent opens a new client then, as an MCP harness reconnecting would. That is a new MCP
    session; that an existing session survives a web restart is shown separately (a session id
    used again after the restart, test_faults)."""
    state = {"held": 0}
    deadline = time.monotonic() + RETRY_WINDOW_SECONDS
    while True:
        try:
            await work_one_session(args, credential, state)
            break
        except Exception as exc:  # noqa: BLE001 - the client died; reconnect within the window
            if time.monotonic() > deadline:
                raise
            say("reconnect", type(exc).__name__, str(exc)[:200].replace("\n", " "))
            await asyncio.sleep(RETRY_PAUSE_SECONDS)
            deadline = time.monotonic() + RETRY_WINDOW_SECONDS
    say("done")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("slug")
    parser.add_argument("--credential-env", default="SB_AGENT_CREDENTIAL")
    parser.add_argument("--mode", choices=["drain", "hold"], default="drain")
    parser.add_argument("--lease-seconds", type=int, default=30)
    parser.add_argument("--hold", type=int, default=3)
    parser.add_argument("--idle-seconds", type=float, default=15.0)
    parser.add_argument("--stop-file")
    args = parser.parse_args()
    asyncio.run(run(args, os.environ[args.credential_env]))
    sys.exit(0)


if __name__ == "__main__":
    main()
