"""Reads on todos used by more than one surface (MCP verbs, operator API, board, commands)."""

from .models import State, Todo

LIST_LIMIT_DEFAULT = 50
LIST_LIMIT_MAX = 200


def _iso(value):
    return value.isoformat().replace("+00:00", "Z") if value is not None else None


def todo_as_dict(todo: Todo) -> dict:
    """The wire shape of a todo (CONTRACT §11). Ids are strings outside the database."""
    return {
        "id": str(todo.pk),
        "endpoint": todo.endpoint.slug,
        "queue": todo.queue,
        "state": todo.state,
        "title": todo.title,
        "kind": todo.kind,
        "source": todo.source,
        "trust": todo.trust,
        "payload": todo.payload,
        "attempts": todo.attempts,
        "max_attempts": todo.max_attempts,
        "lease_id": todo.lease_id,
        "lease_owner": todo.lease_owner,
        "lease_expires_at": _iso(todo.lease_expires_at),
        "retry_at": _iso(todo.retry_at),
        "dead_lettered_at": _iso(todo.dead_lettered_at),
        "result": todo.result,
        "last_error": todo.last_error,
        "created_at": _iso(todo.created_at),
        "updated_at": _iso(todo.updated_at),
    }


def list_todos(caller, *, queue=None, state=None, limit=LIST_LIMIT_DEFAULT):
    """The caller's visible todos, oldest first, with full payloads. A queue outside the
    caller's scope yields nothing (invisible, not an error)."""
    todos = Todo.objects.filter(endpoint=caller.endpoint)
    if caller.queues is not None:
        todos = todos.filter(queue__in=caller.queues)
    if queue is not None:
        todos = todos.filter(queue=queue)
    if state is not None:
        todos = todos.filter(state=state)
    rows = list(todos.order_by("created_at", "id")[:limit])
    for row in rows:
        row.endpoint = caller.endpoint
    return rows


def dead_letters(*, endpoint, queue=None):
    todos = Todo.objects.filter(
        endpoint=endpoint, state=State.FAILED, dead_lettered_at__isnull=False
    )
    if queue is not None:
        todos = todos.filter(queue=queue)
    return todos.order_by("created_at", "id")
