"""The reference for bench/mcp.py: the official ``mcp`` SDK's own Streamable HTTP server
(MCPServer, stateless, JSON answers) on uvicorn, answering a tool that does nothing.

    python bench/mcp_reference_server.py PORT                                  (uvicorn)
    python -m daphne -p PORT bench.mcp_reference_server:daphne_application    (daphne)

Serves ``/mcp/reference``. The second form serves the very same app on daphne, switchboard's
server, so bench/mcp.py can tell the HTTP server's share of a call from the app's. It authenticates nobody and touches no database: the server cost of
the protocol itself, which switchboard's per-call server CPU is compared with.
"""

import asyncio
import sys
from pathlib import Path

# This folder holds mcp.py (the benchmark); keep it off the path so `import mcp` is the SDK.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

from mcp.server.mcpserver import MCPServer  # noqa: E402

server = MCPServer("reference", log_level="WARNING")


@server.tool()
def noop(todo_id: str = "", lease_id: str = "", result: dict | None = None) -> dict:
    """Answers at once; takes the arguments a claim_next / complete call carries."""
    return {"ok": True}


REFERENCE_PATH = "/mcp/reference"


def reference_app():
    return server.streamable_http_app(streamable_http_path=REFERENCE_PATH, json_response=True,
                                      stateless_http=True)


_daphne_app = None


async def daphne_application(scope, receive, send):
    """The reference app for a server that speaks no ASGI lifespan (daphne): the app is built,
    and its session manager (which the Starlette app's lifespan would start) started, with the
    first request. Built on first use so the uvicorn form never builds a second app."""
    global _daphne_app
    if scope["type"] != "http":
        return
    if _daphne_app is None:
        _daphne_app = asyncio.get_running_loop().create_future()
        app = reference_app()
        asyncio.get_running_loop().create_task(_run_session_manager(app))
    app = await asyncio.shield(_daphne_app)
    await app(scope, receive, send)


async def _run_session_manager(app):
    async with server.session_manager.run():
        _daphne_app.set_result(app)
        await asyncio.Event().wait()  # for the life of the process


if __name__ == "__main__":
    asyncio.run(server.run_streamable_http_async(
        port=int(sys.argv[1]), streamable_http_path=REFERENCE_PATH, json_response=True,
        stateless_http=True,
    ))
