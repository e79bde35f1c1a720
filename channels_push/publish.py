"""The one after-commit publish helper: every todo change leaves the request through here.

``publish_on_commit`` registers the announcement with ``transaction.on_commit`` so a row that
rolls back is never announced (Zulip's rule). Delivery is best effort: the channel layer may be
Redis, which may be down; a failure is logged with context and dropped, because the durable
queue is the record and every consumer can re-read it.
"""

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

log = logging.getLogger("switchboard.publish")

BOARD_GROUP = "todos.board"
# Changes after which a todo is ready for an agent to pick up: the doorbell's triggers (§7).
READY_ACTIONS = frozenset({"create", "retry", "requeue"})

# In-process listeners (called after commit with each change). The doorbell and tests hook in
# here; a listener that raises is logged and does not stop the others.
_listeners = []


def add_listener(listener):
    _listeners.append(listener)


def remove_listener(listener):
    _listeners.remove(listener)


def todo_change(todo, action: str) -> dict:
    """What a change looks like on the wire to the board: identifiers and state, no payload."""
    return {
        "type": "todo.changed",
        "action": action,
        "todo_id": str(todo.pk),
        "endpoint_id": todo.endpoint_id,
        "queue": todo.queue,
        "state": todo.state,
    }


def publish_on_commit(todo, action: str) -> None:
    """Announce ``action`` on ``todo`` once the surrounding transaction commits (at once when
    there is none)."""
    change = todo_change(todo, action)
    transaction.on_commit(lambda: deliver(todo, change))


def deliver(todo, change: dict) -> None:
    for listener in list(_listeners):
        try:
            listener(todo, change)
        except Exception:
            log.exception("publish listener failed", extra={"todo_id": change["todo_id"]})
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(BOARD_GROUP, change)
    except Exception as exc:  # Redis down or slow: drop, the board re-syncs from the database.
        log.warning(
            "board publish dropped",
            extra={"todo_id": change["todo_id"], "action": change["action"], "error": type(exc).__name__},
        )
