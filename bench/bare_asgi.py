"""The HTTP stack's floor for bench/ingest.py: a bare ASGI app under the same daphne that
reads the whole request body and answers 202 with a small JSON body, touching nothing else."""

ANSWER = b'{"delivery": null, "todos": []}'


async def application(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 202,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(ANSWER)).encode())]})
    await send({"type": "http.response.body", "body": ANSWER})
