"""A header-adding reverse proxy for third-party MCP test tools that cannot send a bearer.

The MCP conformance suite (``@modelcontextprotocol/conformance server --url …``) has no option
for request headers, and every request to ``/mcp/<slug>`` needs ``Authorization: Bearer …``.
This proxy forwards each request unchanged (method, path, query, body, every header including
Host and Origin) to the target and adds the one header, streaming responses through as they
arrive so SSE behaves as it does on the real server. It changes nothing else: what the suite
tests is the real daphne process behind it.

    python -m tests.auth_proxy --listen-port 9000 --target http://127.0.0.1:8000 \
        --header "Authorization: Bearer sbk_…"
"""

import argparse

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-authorization", "proxy-authenticate", "content-length"}


def build_app(target: str, extra_headers: dict) -> Starlette:
    client = httpx.AsyncClient(base_url=target, timeout=httpx.Timeout(30.0, read=None))

    async def forward(request: Request):
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        headers += list(extra_headers.items())
        upstream = client.build_request(
            request.method, request.url.path + (f"?{request.url.query}" if request.url.query else ""),
            headers=headers, content=await request.body(),
        )
        response = await client.send(upstream, stream=True)

        async def body():
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        return StreamingResponse(
            body(), status_code=response.status_code,
            headers={k: v for k, v in response.headers.items() if k.lower() not in HOP_BY_HOP},
        )

    methods = ["GET", "POST", "DELETE", "PUT", "PATCH", "OPTIONS", "HEAD"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen-port", type=int, required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--header", action="append", default=[])
    args = parser.parse_args()
    extra = dict(h.split(": ", 1) for h in args.header)
    uvicorn.run(build_app(args.target, extra), host="127.0.0.1", port=args.listen_port,
                log_level="warning")


if __name__ == "__main__":
    main()
