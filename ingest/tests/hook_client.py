"""POST /hooks/<slug> in-process through the real ASGI app (test helper).

The route and app are production's (``hook.HOOK_ROUTE_PATTERN`` served by
``plain.SyncHandlerApp(hook.answer_hook, …)``); only the thread differs: the handler runs
on the calling thread (``thread_sensitive=True``) so it sees the test's transaction, as the MCP
tests do. Headers are given Django test-client style (``HTTP_X_HUB_SIGNATURE_256=…``,
``CONTENT_LENGTH=…``) so the signing helpers serve both.
"""

import json
from dataclasses import dataclass

from asgiref.sync import async_to_sync
from channels.routing import URLRouter
from channels.testing import ApplicationCommunicator
from django.urls import re_path

from switchboard.http import plain
from ingest import hook
from tests.processes import DEADLINE_SECONDS

application = URLRouter([
    re_path(hook.HOOK_ROUTE_PATTERN,
            plain.SyncHandlerApp(hook.answer_hook, hook.refusal_answer,
                                      thread_sensitive=True)),
])
# Host header of every request unless one is given (an ALLOWED_HOSTS entry).
DEFAULT_HOST = "localhost"
RESPONSE_TIMEOUT_SECONDS = DEADLINE_SECONDS


@dataclass
class HookAnswer:
    status_code: int
    headers: dict  # lower-cased names
    content: bytes
    # How many body chunks the app asked for before it answered.
    chunks_read: int = 0

    def json(self):
        return json.loads(self.content)

    def __getitem__(self, name: str) -> str:
        return self.headers[name.lower()]


def _header_name(meta_key: str) -> str:
    name = meta_key[len("HTTP_"):] if meta_key.startswith("HTTP_") else meta_key
    return name.lower().replace("_", "-")


def post(slug: str, body: bytes = b"", *, content_type: str | None = "application/json",
         method: str = "POST", path: str | None = None, chunks: list[bytes] | None = None,
         disconnect: bool = False, **meta) -> HookAnswer | None:
    """One request. ``chunks`` sends the body in several ``http.request`` messages (streamed
    uploads); Content-Length is ``len(body)`` unless ``CONTENT_LENGTH`` says otherwise (None
    leaves it out, as a chunked upload does). ``disconnect`` hangs up after the chunks, before
    the body is complete, and returns None after checking that nothing was answered."""
    chunks = chunks if chunks is not None else [body]
    headers = {"host": DEFAULT_HOST, "content-length": str(sum(map(len, chunks)))}
    if content_type is not None:
        headers["content-type"] = content_type
    for key, value in meta.items():
        headers[_header_name(key)] = value
    headers = {name: value for name, value in headers.items() if value is not None}
    path = path or f"/hooks/{slug}"
    scope = {
        "type": "http", "http_version": "1.1", "method": method, "path": path,
        "raw_path": path.encode(), "query_string": b"", "scheme": "http",
        "server": ("localhost", 80), "client": ("127.0.0.1", 50000),
        "headers": [(name.encode("latin-1"), str(value).encode("utf-8", "surrogatepass"))
                    for name, value in headers.items()],
    }

    async def exchange():
        communicator = ApplicationCommunicator(application, scope)
        sent = 0
        for index, chunk in enumerate(chunks):
            await communicator.send_input({"type": "http.request", "body": chunk,
                                           "more_body": index < len(chunks) - 1 or disconnect})
            sent += 1
        if disconnect:  # the client goes away mid-body: expect no answer at all
            await communicator.send_input({"type": "http.disconnect"})
            await communicator.wait(RESPONSE_TIMEOUT_SECONDS)
            assert await communicator.receive_nothing(), "answered a client that had gone"
            return None, None, sent
        start = await communicator.receive_output(RESPONSE_TIMEOUT_SECONDS)
        body_message = await communicator.receive_output(RESPONSE_TIMEOUT_SECONDS)
        # Whatever the app did not read is still in its input queue.
        unread = communicator.input_queue.qsize()
        await communicator.wait(RESPONSE_TIMEOUT_SECONDS)
        return start, body_message, sent - unread

    start, body_message, chunks_read = async_to_sync(exchange)()
    if start is None:
        return None
    return HookAnswer(
        status_code=start["status"],
        headers={k.decode("latin-1").lower(): v.decode("latin-1") for k, v in start["headers"]},
        content=body_message.get("body", b""), chunks_read=chunks_read,
    )
