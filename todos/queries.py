"""Reads on todos used by more than one surface (MCP verbs, operator API, board, commands)."""

from .models import LIVE_FOR_IDEMPOTENCY, State, Todo

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


# The board shows the newest rows only; older ones are reached through the filters or admin.
BOARD_LIMIT = 200


def with_board_version(todos):
    """Annotate ``version``: the id of the todo's latest event.

    Per todo this grows in commit order — every transition holds the todo's row lock from its
    UPDATE until commit and inserts its event inside that window — so the board can tell an
    older snapshot of a row from a newer one, whichever reaches the browser first.
    """
    from django.db.models import OuterRef, Subquery

    from .models import TodoEvent

    latest = TodoEvent.objects.filter(todo=OuterRef("pk")).order_by("-id").values("id")[:1]
    return todos.annotate(version=Subquery(latest))


def board_todos(endpoints, *, endpoint_slug=None, queue=None, state=None, limit=BOARD_LIMIT):
    """The newest todos of ``endpoints`` (a queryset the caller may see), filtered."""
    todos = Todo.objects.filter(endpoint__in=endpoints).select_related("endpoint")
    if endpoint_slug:
        todos = todos.filter(endpoint__slug=endpoint_slug)
    if queue:
        todos = todos.filter(queue=queue)
    if state:
        todos = todos.filter(state=state)
    return list(with_board_version(todos).order_by("-id")[:limit])


def matches_board_filters(todo, *, endpoint_slug=None, queue=None, state=None) -> bool:
    return (
        (not endpoint_slug or todo.endpoint.slug == endpoint_slug)
        and (not queue or todo.queue == queue)
        and (not state or todo.state == state)
    )


def board_filters_from(params) -> dict:
    """The board's filters from a query mapping; an unknown state is ignored, not an error."""
    state = params.get("state") or None
    return {
        "endpoint_slug": (params.get("endpoint") or "").strip() or None,
        "queue": (params.get("queue") or "").strip() or None,
        "state": state if state in State.values else None,
    }


# The states a backlog gauge reports. Done todos are kept forever as audit, so counting them
# would make every scrape as slow as the history is long; completions are a counter instead.
BACKLOG_STATES = (State.PENDING, State.CLAIMED, State.FAILED)


def count_backlog_by_queue():
    """``(endpoint slug, queue, state, count)`` for todos in BACKLOG_STATES.

    PostgreSQL: one LATERAL probe per endpoint on ``todo_by_state`` (endpoint, state, queue), an
    index-only range per endpoint and state, so the cost follows the backlog, not the history
    (a plain GROUP BY would read the whole index: no skip scan before PostgreSQL 18).
    SQLite (embedded, small): the plain grouped count.
    """
    from django.db import connection
    from django.db.models import Count

    if connection.vendor != "postgresql":
        return list(
            Todo.objects.filter(state__in=BACKLOG_STATES)
            .values_list("endpoint__slug", "queue", "state").annotate(n=Count("id")).order_by()
        )
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT e.slug, c.queue, c.state, c.n FROM endpoints_endpoint e CROSS JOIN LATERAL ("
            " SELECT t.queue, t.state, COUNT(*) AS n FROM todos_todo t"
            " WHERE t.endpoint_id = e.id AND t.state = ANY(%s) GROUP BY t.queue, t.state) c",
            [list(BACKLOG_STATES)],
        )
        return cursor.fetchall()


def count_todo_events(*, after_id=0, up_to_id=None):
    """``(action, to_state, count)`` over the audit trail, for event ids in
    (``after_id``, ``up_to_id``]: a primary-key range, so counting only what is new is cheap."""
    from django.db.models import Count

    from .models import TodoEvent

    events = TodoEvent.objects.filter(id__gt=after_id)
    if up_to_id is not None:
        events = events.filter(id__lte=up_to_id)
    return list(events.values_list("action", "to_state").annotate(n=Count("id")).order_by())


def count_pruned_events() -> dict:
    """``{(action, to_state): count}`` of the audit events retention has deleted (§14)."""
    from .models import PrunedEventTally

    return {(action, to_state): count for action, to_state, count in
            PrunedEventTally.objects.values_list("action", "to_state", "count")}


def metrics_snapshot():
    """A context in which the scrape's several reads see one state of the database. On
    PostgreSQL a REPEATABLE READ transaction: without it a prune committing between reading the
    pruned tally and counting the events would make a counter dip. SQLite (the embedded default)
    needs none: its sweeps and requests share Django's one sync thread, so a prune never runs
    in the middle of a scrape."""
    import contextlib

    from django.db import connection, transaction

    if connection.vendor != "postgresql" or connection.in_atomic_block:
        return contextlib.nullcontext()  # inside a transaction already: its snapshot rules

    @contextlib.contextmanager
    def snapshot():
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            yield

    return snapshot()


def find_settled_event_id(*, after_id, written_before):
    """The largest event id after ``after_id`` among events written before ``written_before``
    (None if none): a scan of the primary-key range after ``after_id`` only."""
    from django.db.models import Max

    from .models import TodoEvent

    return (
        TodoEvent.objects.filter(id__gt=after_id, at__lt=written_before)
        .aggregate(top=Max("id"))["top"]
    )


def live_todo_holding_key(endpoint, idempotency_key) -> Todo | None:
    """The endpoint's todo that holds ``idempotency_key`` right now (pending, claimed, or failed
    and waiting to retry), if any: the row the partial unique index collapses creates onto."""
    return Todo.objects.filter(LIVE_FOR_IDEMPOTENCY, endpoint=endpoint,
                               idempotency_key=idempotency_key).first()
