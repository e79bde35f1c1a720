"""The MCP session fixtures every channels_push sub-package's tests share."""

from channels_push.tests.conftest import digests, mcp, vend  # noqa: F401
