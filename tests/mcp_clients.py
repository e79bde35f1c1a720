"""The official MCP Python SDK client, authenticated for a vended endpoint (shared by the
end-to-end tests and bench/mcp.py, bench/push.py)."""

import asyncio
from contextlib import asynccontextmanager

from mcp import Client
from mcp.client.extension import ClientExtension, NotificationBinding
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from pydantic import BaseModel

from tests.processes import DEADLINE_SECONDS

CHANNEL_METHOD = "notifications/claude/channel"


class ChannelParams(BaseModel):
    content: str
    meta: dict[str, str] = {}


class ChannelListener(ClientExtension):
    """What a channel-capable harness does: observe ``notifications/claude/channel`` (the SDK
    drops vendor notifications nobody binds). Each doorbell lands in ``received`` (an asyncio
    queue of ``(monotonic time, ChannelParams)``)."""

    identifier = "com.anthropic/claude-channel"

    def __init__(self):
        self.received = asyncio.Queue()

    def notifications(self):
        return [NotificationBinding(method=CHANNEL_METHOD, params_type=ChannelParams,
                                    handler=self._on_channel)]

    async def _on_channel(self, params: ChannelParams):
        self.received.put_nowait((asyncio.get_running_loop().time(), params))

    async def next(self, timeout: float = DEADLINE_SECONDS) -> ChannelParams:
        return (await asyncio.wait_for(self.received.get(), timeout))[1]


@asynccontextmanager
async def sdk_client(base_url: str, slug: str, credential: str, *, listener=None):
    """``Client`` in its default mode ("auto"): it probes the sessionless era first and falls
    back to ``initialize``, so this also exercises our answer to that probe. With
    ``listener`` (a ChannelListener) it receives doorbells."""
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {credential}"})
    async with http:
        transport = streamable_http_client(f"{base_url}/mcp/{slug}", http_client=http)
        extensions = [listener] if listener is not None else None
        async with Client(transport, extensions=extensions) as client:
            yield client
