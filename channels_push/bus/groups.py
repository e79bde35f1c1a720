"""Channel-layer group names and the message types sent to them: the one place a sender and
the streams that listen agree on them, so neither imports the other for it."""

# Every committed todo change, in per-process batches (``publish._BoardBatch``): the board's
# hub and the long poll's wait room follow it. Its one message type carries a batch.
BOARD_GROUP = "todos.board"
BOARD_CHANGES_TYPE = "todos.changed"

# Channel-layer group per MCP session; the doorbell (any process) sends to it, the session's
# notification stream(s) listen.
SESSION_GROUP_PREFIX = "mcp.session."
NOTIFY_MESSAGE_TYPE = "mcp.notify"
TERMINATE_MESSAGE_TYPE = "mcp.terminate"

# Each board viewer's streams also listen on a group of their own: a logout asks them to
# re-check at once, a stop ends them.
VIEWER_GROUP_PREFIX = "todos.viewer."
RECHECK_MESSAGE_TYPE = "board.recheck"
STOP_MESSAGE_TYPE = "board.stop"


def session_group(session_id: str) -> str:
    return SESSION_GROUP_PREFIX + session_id


def viewer_group(user_id: int) -> str:
    return f"{VIEWER_GROUP_PREFIX}{user_id}"
