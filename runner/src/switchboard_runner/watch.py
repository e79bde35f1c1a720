"""``switchboard-runner watch``: one line on stdout per todo that becomes ready, nothing else.

For an interactive agent without channels: Claude Code's Monitor tool, ``tail``-style tools
and shell loops turn each line into a wake-up. Claims nothing.

What becomes ready is learnt from the session's doorbells and digests, each followed by a
listing of pending todos (a doorbell names only the todo, the listing gives its trust and
title); a listing at start-up, after every reconnection (doorbells sent meanwhile are lost),
and every --poll-seconds (unverified todos are never rung) fills the gaps. A todo is printed
once while it stays pending; one that comes back (released, retried) is printed again.

Claimed todos are listed too, for what their holder should hear of
(docs/runner.md#watch-wake-an-interactive-agent): a new follow-up is a line ``<id>.<n>`` with
kind ``followup``, and a request to stop a line with kind ``cancel_requested``, each with the
todo's queue, trust and title. Follow-ups a todo had when watch first saw it claimed are not
repeated (its claim gave them to its holder).
"""

import asyncio
import signal
import sys
from datetime import datetime, timezone

from mcp.shared.exceptions import MCPError

from .agent import sanitize_name, sanitize_text
from .session import CALL_TIMEOUT_SECONDS, Refused, Switchboard, Unreachable, log_event, wait_first

PAGE_LIMIT = 200
# At most this many pages per listing: a backlog deeper than 2,000 todos is shown from its
# oldest end, and the rest as they come up.
MAX_PAGES = 10
ERROR_RETRY_SECONDS = 2.0


def watch_line(todo: dict) -> str:
    """``id<TAB>queue<TAB>kind<TAB>trust<TAB>title``: the first four never hold whitespace, so
    ``read -r id queue kind trust title`` splits it; the title is one sanitised line."""
    return "\t".join([sanitize_name(todo.get("id")), sanitize_name(todo.get("queue")),
                      sanitize_name(todo.get("kind")), sanitize_name(todo.get("trust")),
                      sanitize_text(todo.get("title") or "")])


def _ready(todo: dict, now: datetime, accept_unverified: bool) -> bool:
    if todo.get("trust") == "unverified" and not accept_unverified:
        return False
    not_before = todo.get("not_before")
    if not_before:
        try:
            return datetime.fromisoformat(not_before.replace("Z", "+00:00")) <= now
        except ValueError:
            return True
    return True


def holder_lines(todo: dict, seen: dict) -> list[str]:
    """The lines a claimed ``todo`` calls for since ``seen`` (todo id -> (follow-up count,
    cancel requested), updated here): one per new follow-up, one for a new request to stop."""
    todo_id = str(todo.get("id"))
    count = todo.get("followup_count") or 0
    stop = todo.get("cancel_requested") is True
    before_count, before_stop = seen.get(todo_id, (count, False))
    seen[todo_id] = (count, stop)
    lines = [watch_line({**todo, "id": f"{todo_id}.{n}", "kind": "followup"})
             for n in range(before_count + 1, count + 1)]
    if stop and not before_stop:
        lines.append(watch_line({**todo, "kind": "cancel_requested"}))
    return lines


async def _pending(sb: Switchboard, queues, state: str = "pending") -> list[dict]:
    todos = []
    for queue in queues or [None]:
        arguments = {"state": state, "limit": PAGE_LIMIT}
        if queue:
            arguments["queue"] = queue
        for _ in range(MAX_PAGES):
            page = await sb.call("list_todos", arguments)
            todos += page.get("todos", [])
            if not page.get("has_more") or not page.get("next_cursor"):
                break
            arguments = {**arguments, "cursor": page["next_cursor"]}
    return todos


async def watch(args, token: str, out=None) -> int:
    out = out or sys.stdout
    wake, stopping = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

    def on_ring(meta: dict):
        if args.queues and meta.get("queue") and meta["queue"] not in args.queues:
            return
        wake.set()

    sb = Switchboard(args.url, token, on_ring, on_connected=wake.set)
    sb.start()
    shown: set[str] = set()
    held: dict = {}  # claimed todo id -> (follow-up count, cancel requested), as last seen
    try:
        connecting = asyncio.ensure_future(sb.wait_first_connection(CALL_TIMEOUT_SECONDS))
        await wait_first(connecting, stopping.wait())
        if not connecting.done():  # stopped while connecting: a stop, not a failure
            connecting.cancel()
            return 0
        if not connecting.result():
            print(f"could not connect to {args.url}: {sb.first_failure_text()}", file=sys.stderr)
            return 1
        while not stopping.is_set():
            wake.clear()
            # A signal ends a listing in progress too: while the session is down (a revoked
            # credential, a server away) a call waits up to its timeout to connect.
            listing = asyncio.ensure_future(asyncio.gather(
                _pending(sb, args.queues), _pending(sb, args.queues, "claimed")))
            await wait_first(listing, stopping.wait())
            if not listing.done():
                listing.cancel()
                break
            try:
                todos, claimed = listing.result()
            except Refused as refused:
                print(f"switchboard refused the listing: {refused}", file=sys.stderr)
                if refused.code in ("not_in_scope", "verb_not_allowed"):
                    return 1
                await wait_first(stopping.wait(), timeout=ERROR_RETRY_SECONDS)
                continue
            except (Unreachable, MCPError) as error:
                log_event("list_error", error=str(error))
                await wait_first(stopping.wait(), timeout=ERROR_RETRY_SECONDS)
                continue
            now = datetime.now(timezone.utc)
            ready = [todo for todo in todos if _ready(todo, now, args.accept_unverified)]
            for todo in ready:
                if str(todo["id"]) not in shown:
                    out.write(watch_line(todo) + "\n")
            for todo in claimed:
                for line in holder_lines(todo, held):
                    out.write(line + "\n")
            held = {str(todo["id"]): held[str(todo["id"])] for todo in claimed}
            out.flush()
            shown = {str(todo["id"]) for todo in ready}
            await wait_first(wake.wait(), stopping.wait(), timeout=args.poll_seconds)
        return 0
    except BrokenPipeError:
        return 0  # the reader went away (head -1, a closed Monitor): nothing more to say
    finally:
        await sb.close()
