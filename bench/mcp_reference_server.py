"""The reference for bench/mcp.py: the official ``mcp`` SDK's own Streamable HTTP server
(MCPServer, stateless, JSON answers) on uvicorn, answering a tool that does nothing.

    python bench/mcp_reference_server.py PORT

Serves ``/mcp/reference``. It authenticates nobody and touches no database: the server cost of
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


if __name__ == "__main__":
    asyncio.run(server.run_streamable_http_async(
        port=int(sys.argv[1]), streamable_http_path="/mcp/reference", json_response=True,
        stateless_http=True,
    ))
