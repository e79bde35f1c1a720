"""The official MCP Python SDK client, authenticated for a vended endpoint (shared by the
end-to-end tests and bench/mcp.py)."""

from contextlib import asynccontextmanager

from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client


@asynccontextmanager
async def sdk_client(base_url: str, slug: str, credential: str):
    """``Client`` in its default mode ("auto"): it probes the sessionless era first and falls
    back to ``initialize``, so this also exercises our answer to that probe."""
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {credential}"})
    async with http:
        transport = streamable_http_client(f"{base_url}/mcp/{slug}", http_client=http)
        async with Client(transport) as client:
            yield client
