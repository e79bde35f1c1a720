"""A diagnostic for bench/ingest.py: the least any Python server can do per delivery on this
machine. Under the same daphne, it reads the body, checks the GitHub signature, parses the
JSON and makes the delivery's durable write with psycopg directly (no Django, no rate limit,
no publish, no doorbell): the webhook + route lookup, then one transaction with the delivery
event and the todo with its create event (the statement shape todos.transitions uses).

Written out here rather than imported because the point is to measure the statements without
the framework around them. Its todos go to queue ``bare-sql`` with keys ``bare-sql:<id>`` so
they never collide with switchboard's. Not a product path: no checks beyond the signature.
"""

import asyncio
import hashlib
import hmac
import json
import os

from psycopg_pool import ConnectionPool

SECRET = os.environ.get("BENCH_WEBHOOK_SECRET", "").encode()
QUEUE = "bare-sql"
# The same pool bounds as switchboard's settings (DATABASE_POOL_MAX_SIZE default).
pool = ConnectionPool(os.environ.get("BENCH_BARE_SQL_DSN", ""), min_size=2, max_size=10,
                      open=True)

LOOKUP_SQL = (
    "SELECT w.id, w.owner_id, r.endpoint_id, e.max_attempts FROM ingest_webhook w"
    " JOIN ingest_route r ON r.webhook_id = w.id JOIN endpoints_endpoint e ON e.id = r.endpoint_id"
    " WHERE w.slug = %s AND w.active ORDER BY r.id LIMIT 1"
)
EVENT_SQL = (
    "INSERT INTO ingest_deliveryevent (webhook_id, trust, delivery_id, received_at, body_sha256,"
    " attributed_to_id, source, kind) VALUES (%s, 'signed', %s, now(), %s, %s, 'github', %s)"
    " RETURNING id"
)
TODO_SQL = (
    "WITH t AS (INSERT INTO todos_todo (endpoint_id, queue, state, title, kind, source, payload,"
    " idempotency_key, delivery_event_id, trust, attempts, max_attempts, created_at, updated_at,"
    " ring_attempts) VALUES (%s, %s, 'pending', %s, %s, 'github', %s::jsonb, %s, %s, 'signed', 0,"
    " %s, now(), now(), 0) RETURNING id),"
    " e AS (INSERT INTO todos_todoevent (todo_id, action, from_state, to_state, actor, at, detail)"
    " SELECT t.id, 'create', NULL, 'pending', 'webhook:bench', now(), '{}'::jsonb FROM t)"
    " SELECT id FROM t"
)


def store(slug: str, headers: dict, body: bytes) -> tuple[int, dict]:
    given = headers.get(b"x-hub-signature-256", b"").removeprefix(b"sha256=")
    expected = hmac.new(SECRET, body, hashlib.sha256).hexdigest().encode()
    if not hmac.compare_digest(expected, given):
        return 401, {"error": "bad_signature"}
    payload = json.loads(body)
    delivery = headers.get(b"x-github-delivery", b"").decode()
    kind = f"{headers.get(b'x-github-event', b'').decode()}.{payload.get('action', '')}"
    with pool.connection() as conn:
        webhook_id, owner_id, endpoint_id, max_attempts = conn.execute(
            LOOKUP_SQL, (slug,)).fetchone()
        with conn.transaction():
            (event_id,) = conn.execute(EVENT_SQL, (
                webhook_id, delivery, hashlib.sha256(body).hexdigest(), owner_id, kind)).fetchone()
            (todo_id,) = conn.execute(TODO_SQL, (
                endpoint_id, QUEUE, payload["issue"]["title"], kind, json.dumps(payload),
                f"{QUEUE}:{delivery}", event_id, max_attempts)).fetchone()
    return 202, {"delivery": str(event_id), "todos": [{"id": str(todo_id), "duplicate": False}]}


async def application(scope, receive, send):
    if scope["type"] != "http":
        return
    chunks, more = [], True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    if scope["method"] != "POST":  # the bench's readiness probe
        status, answer = 200, {}
    else:
        status, answer = await asyncio.get_running_loop().run_in_executor(
            None, store, scope["path"].rsplit("/", 1)[-1], dict(scope["headers"]), b"".join(chunks))
    body = json.dumps(answer).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
