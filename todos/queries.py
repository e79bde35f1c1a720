"""Reads on todos used by more than one surface (MCP verbs, operator API, board, commands)."""

import base64
import hashlib
import hmac
import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

from django.db import connection
from django.db.models import Count, Exists, Min, OuterRef, Q, Value
from django.utils import timezone

from switchboard.db import sql as dialect

from . import usage
from .models import (LIVE_FOR_IDEMPOTENCY, LIVE_FOR_THREAD, THREAD_MAX_CHARS, TODO_TOKEN_PREFIX,
                     FollowUp, State, Todo, TodoEvent, Trust)

# The largest todo id: the primary key is a bigint.
MAX_TODO_ID = 2**63 - 1
LIST_LIMIT_DEFAULT = 50
LIST_LIMIT_MAX = 200


def iso_time(value):
    if value is None:
        return None
    if value.tzinfo is None:  # SQLite's raw rows are naive UTC
        value = value.replace(tzinfo=dt_timezone.utc)
    return value.isoformat().replace("+00:00", "Z")


_iso = iso_time


def followup_as_dict(followup: FollowUp) -> dict:
    """The wire shape of a follow-up (docs/reference.md#follow-ups): its id is
    ``"<todo id>.<seq>"``; its title and payload are third-party text, as a todo's are."""
    return {
        "id": f"{followup.todo_id}.{followup.seq}",
        "kind": followup.kind,
        "title": followup.title,
        "actor": followup.actor,
        "trust": followup.trust,
        "payload": followup.payload,
        "at": iso_time(followup.at),
    }


def given_followups(todo: Todo) -> list[FollowUp]:
    """The follow-ups its holder has been given in this lease (``seq`` 1 … ``followups_given``),
    in order; no query for a todo without any."""
    if not todo.followups_given:
        return []
    return list(FollowUp.objects.filter(todo_id=todo.pk, seq__lte=todo.followups_given)
                .order_by("seq"))


def todo_as_dict(todo: Todo, *, holder: str | None = None, followups=None) -> dict:
    """The wire shape of a todo (docs/reference.md#todos). Ids are strings outside the database.
    ``lease_id`` only when ``holder`` (the caller's lease owner name: its MCP session id) holds
    the lease; ``lease_owner`` always as its 8-character hint. ``followups``: its follow-ups
    (``FollowUp`` rows) where the whole todo is answered (claim, claim_next, heartbeat); None
    leaves them out (``"followups": null``; ``followup_count`` says how many there are), as
    listings and the other verbs do, so a page of todos costs no query per todo.

    A done todo shows no lease: its row keeps the completing lease only so a repeated complete
    can be told ``already_done``, and that lease is nobody's business any more."""
    done = todo.state == State.DONE
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
        "priority": todo.priority,
        "not_before": iso_time(todo.not_before),
        "attempts": todo.attempts,
        "max_attempts": todo.max_attempts,
        "lease_id": (todo.lease_id if not done and holder is not None
                     and todo.lease_owner == holder else None),
        "lease_owner": None if done else todo.lease_owner_hint,
        "lease_expires_at": iso_time(todo.lease_expires_at),
        "retry_at": iso_time(todo.retry_at),
        "dead_lettered_at": iso_time(todo.dead_lettered_at),
        "cancelled_at": iso_time(todo.cancelled_at),
        "result": todo.result,
        "last_error": todo.last_error,
        "created_at": iso_time(todo.created_at),
        "updated_at": iso_time(todo.updated_at),
        "usage": usage.todo_usage(todo),
        "traceparent": todo.traceparent,
        "thread": todo.thread,
        "followup_count": todo.followup_count,
        "followups": (None if followups is None
                      else [followup_as_dict(followup) for followup in followups]),
        "cancel_requested": todo.cancel_requested_at is not None,
    }


# Without a state filter, list_todos lists the live todos in this order: what can be claimed
# first, then what is being worked on, then what waits to retry (dead letters and done todos
# only when asked for by state).
LIVE_LISTING = (
    (State.PENDING, Q()),
    (State.CLAIMED, Q()),
    (State.FAILED, Q(dead_lettered_at__isnull=True)),
)


def _cursor_filters_tag(queue, state, scheduled=None, thread=None) -> str:
    # A cursor only continues the listing it came from: same queue, state, scheduled and
    # thread filters.
    filters = [queue, state] if scheduled is None else [queue, state, scheduled]
    if thread is not None:
        filters.append({"thread": thread})
    return hashlib.sha256(json.dumps(filters).encode()).hexdigest()[:8]


def _encode_cursor(group: int, todo: Todo, tag: str) -> str:
    raw = json.dumps([group, todo.created_at.isoformat(), todo.pk, tag], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _decode_cursor(cursor: str, tag: str):
    """``(group, created_at, id)`` from a cursor this function's twin made; ValueError for
    anything else (forged, truncated, or from a listing with other filters)."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        group, created_at, todo_id, cursor_tag = json.loads(raw)
        created = datetime.fromisoformat(created_at)
    except (ValueError, TypeError, UnicodeDecodeError):
        raise ValueError("cursor is not one a listing returned") from None
    if cursor_tag != tag:
        raise ValueError("cursor belongs to a listing with other queue/state filters")
    if not (isinstance(group, int) and isinstance(todo_id, int)) or created.tzinfo is None:
        raise ValueError("cursor is not one a listing returned")
    return group, created, todo_id


def list_todos(caller, *, queue=None, state=None, limit=LIST_LIMIT_DEFAULT, cursor=None,
               scheduled=None, thread=None):
    """One page of the caller's visible todos with full payloads: ``(todos, next_cursor)``,
    ``next_cursor`` None on the last page.

    Without ``state``: the live todos, pending, then claimed, then failed waiting to retry,
    each oldest first (LIVE_LISTING); with ``state``: that state, oldest first. Keyset pages
    (``created_at, id`` after the cursor's), so a page costs the same however deep it is; a
    todo that changes state between pages may be listed twice or not at all, as in any live
    listing. Raises ValueError for a cursor this listing did not return. A queue outside the
    caller's scope yields nothing here (the MCP verb refuses it first). ``scheduled``: True
    lists only scheduled todos (pending, ``not_before`` set), False leaves them out (what is
    ready or under way), None both. ``thread``: only that thread's todos (index
    todo_by_thread).

    Never a gated todo (docs/work-control.md#approval): none awaiting approval, whatever the
    filter (``state="awaiting_approval"`` lists nothing; the MCP verb refuses that state), and
    no cancelled todo that never left the gate (rejected, timed out, or cancelled unapproved):
    no agent reads the text of a todo no operator said yes to."""
    todos = Todo.objects.filter(endpoint=caller.endpoint).exclude(state=State.AWAITING_APPROVAL)
    if state == State.CANCELLED:
        todos = todos.exclude(Exists(TodoEvent.objects.filter(
            todo_id=OuterRef("pk"), from_state=State.AWAITING_APPROVAL,
            to_state=State.CANCELLED)))
    if caller.hides_unverified:
        todos = todos.exclude(trust=Trust.UNVERIFIED)
    if caller.queues is not None:
        todos = todos.filter(queue__in=caller.queues)
    if queue is not None:
        todos = todos.filter(queue=queue)
    if scheduled is not None:
        # Only pending todos are ever scheduled (a claim clears not_before).
        todos = todos.filter(not_before__isnull=not scheduled)
    if thread is not None:
        todos = todos.filter(thread=thread)
    groups = LIVE_LISTING if state is None else ((state, Q()),)
    tag = _cursor_filters_tag(queue, state, scheduled, thread)
    start, after = 0, None
    if cursor is not None:
        start, created, after_id = _decode_cursor(cursor, tag)
        if not 0 <= start < len(groups):
            raise ValueError("cursor is not one a listing returned")
        after = Q(created_at__gt=created) | Q(created_at=created, id__gt=after_id)
    page = []  # (group, todo); one row past the limit tells whether there is more
    for group in range(start, len(groups)):
        group_state, extra = groups[group]
        rows = todos.filter(extra, state=group_state)
        if group == start and after is not None:
            rows = rows.filter(after)
        page += [(group, row) for row in rows.order_by("created_at", "id")[: limit + 1 - len(page)]]
        if len(page) > limit:
            break
    next_cursor = _encode_cursor(*page[limit - 1], tag) if len(page) > limit else None
    rows = [row for _, row in page[:limit]]
    for row in rows:
        row.endpoint = caller.endpoint
    return rows, next_cursor


def operator_todos(*, endpoint=None, queue=None, state=None, thread=None, limit: int):
    """The latest todos, newest first, for ``manage.py todos`` (whoever runs a command runs the
    server, so every endpoint's): of one endpoint, queue, state or thread (index
    todo_by_thread, with the endpoint) when given."""
    todos = Todo.objects.select_related("endpoint")
    if endpoint is not None:
        todos = todos.filter(endpoint=endpoint)
    if queue is not None:
        todos = todos.filter(queue=queue)
    if state is not None:
        todos = todos.filter(state=state)
    if thread is not None:
        todos = todos.filter(thread=thread)
    return list(todos.order_by("-created_at", "-id")[:limit])


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


# The board's state tabs beyond the states themselves: the two kinds of failed todo, and
# scheduled (pending, not yet claimable) when todos can be scheduled. Each is a state plus a
# condition, as a query and as a test of a row already read (the stream's rows).
def _board_sub_states() -> dict:
    subs = {
        "retrying": (State.FAILED, lambda: Q(dead_lettered_at__isnull=True),
                     lambda todo: todo.dead_lettered_at is None),
        "dead": (State.FAILED, lambda: Q(dead_lettered_at__isnull=False),
                 lambda todo: todo.dead_lettered_at is not None),
    }
    if has_scheduled_todos():
        subs["scheduled"] = (
            State.PENDING, lambda: Q(**{f"{SCHEDULED_FIELD}__isnull": False}),
            lambda todo: getattr(todo, SCHEDULED_FIELD) is not None)
    return subs


def board_state_choices() -> list[str]:
    """What the board's ``state`` filter accepts: every state, and the sub-states."""
    return [*State.values, *_board_sub_states()]


def _search_q(search: str) -> Q:
    """By id (``42`` or ``#42``), else by title, kind or thread key (case-insensitive
    substring)."""
    text = search.strip()
    number = text[1:] if text.startswith("#") else text
    found = Q(title__icontains=text) | Q(kind__icontains=text) | Q(thread__icontains=text)
    if number.isdigit() and len(number) <= 18:
        found |= Q(pk=int(number))
    return found


def _search_matches(todo, search: str) -> bool:
    text = search.strip()
    number = text[1:] if text.startswith("#") else text
    if number.isdigit() and len(number) <= 18 and todo.pk == int(number):
        return True
    return any(text.lower() in (value or "").lower()
               for value in (todo.title, todo.kind, todo.thread))


def board_todos(endpoints, *, limit=BOARD_LIMIT, **filters):
    """The newest todos of ``endpoints`` (a queryset the caller may see), filtered; ``before``
    (a todo id) pages past the newest ``limit``: the ones older than it. A search by title or
    kind is a substring scan (no text index): bounded by ``limit`` rows found, newest first."""
    return list(with_board_version(filter_board_todos(endpoints, **filters)).order_by("-id")[:limit])


def filter_board_todos(endpoints, *, endpoint_slug=None, queue=None, state=None, search=None,
                       before=None, thread=None):
    """The todos of ``endpoints`` that the board's filters select (a queryset); ``thread``:
    exactly that thread key's (index todo_by_thread)."""
    todos = Todo.objects.filter(endpoint__in=endpoints).select_related("endpoint")
    if thread:
        todos = todos.filter(thread=thread)
    if endpoint_slug:
        todos = todos.filter(endpoint__slug=endpoint_slug)
    if queue:
        todos = todos.filter(queue=queue)
    if state:
        sub = _board_sub_states().get(state)
        todos = todos.filter(state=sub[0]).filter(sub[1]()) if sub else todos.filter(state=state)
    if search:
        todos = todos.filter(_search_q(search))
    if before:
        todos = todos.filter(pk__lt=before)
    return todos


def count_awaiting_approval(endpoints) -> int:
    """How many todos of ``endpoints`` wait for an operator's approval (index
    todo_awaiting_approval, one probe per endpoint): the board's banner."""
    return Todo.objects.filter(endpoint__in=endpoints, state=State.AWAITING_APPROVAL).count()


def matches_board_filters(todo, *, endpoint_slug=None, queue=None, state=None, search=None,
                          before=None, thread=None) -> bool:
    """``board_todos``'s filters, on a row already read (the stream's)."""
    if state:
        sub = _board_sub_states().get(state)
        if sub and not (todo.state == sub[0] and sub[2](todo)):
            return False
        if not sub and todo.state != state:
            return False
    return (
        (not endpoint_slug or todo.endpoint.slug == endpoint_slug)
        and (not queue or todo.queue == queue)
        and (not search or _search_matches(todo, search))
        and (not before or todo.pk < before)
        and (not thread or todo.thread == thread)
    )


class BadFilter(ValueError):
    """A board filter no row could match because the database cannot even compare it (a NUL
    character): the message names the filter."""


MAX_SEARCH_CHARS = 200


def board_filters_from(params) -> dict:
    """The board's filters from a query mapping; an unknown state or a malformed ``before`` is
    ignored, not an error. Raises BadFilter for a value with a NUL (PostgreSQL refuses it in
    a query)."""
    state = params.get("state") or None
    before = (params.get("before") or "").strip()
    filters = {
        "endpoint_slug": (params.get("endpoint") or "").strip() or None,
        "queue": (params.get("queue") or "").strip() or None,
        "state": state if state in board_state_choices() else None,
        "search": (params.get("q") or "").strip()[:MAX_SEARCH_CHARS] or None,
        "before": int(before) if before.isdigit() and len(before) <= 18 else None,
        "thread": (params.get("thread") or "").strip()[:THREAD_MAX_CHARS] or None,
    }
    for name, key in (("endpoint", "endpoint_slug"), ("queue", "queue"), ("q", "search"),
                      ("thread", "thread")):
        if filters[key] and "\x00" in filters[key]:
            raise BadFilter(f"the {name} filter contains a NUL character")
    return filters


# The states a backlog gauge reports. Done todos are kept forever as audit, so counting them
# would make every scrape as slow as the history is long; completions are a counter instead.
BACKLOG_STATES = (State.AWAITING_APPROVAL, State.PENDING, State.CLAIMED, State.FAILED)


def count_backlog_by_queue():
    """``(endpoint slug, queue, state, count)`` for todos in BACKLOG_STATES.

    PostgreSQL: one LATERAL probe per endpoint on ``todo_by_state`` (endpoint, state, queue), an
    index-only range per endpoint and state, so the cost follows the backlog, not the history
    (a plain GROUP BY would read the whole index: no skip scan before PostgreSQL 18).
    SQLite (embedded, small): the plain grouped count.
    """
    from django.db import connection
    from django.db.models import Count

    if not dialect.is_postgres():
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


def count_scheduled_by_queue():
    """``(endpoint slug, queue, count)`` of scheduled todos (pending, ``not_before`` set): a
    read of the partial index todo_scheduled_due, so it costs what is scheduled, never the
    history."""
    from django.db.models import Count

    return list(Todo.objects.filter(state=State.PENDING, not_before__isnull=False)
                .values_list("endpoint__slug", "queue").annotate(n=Count("id")).order_by())


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
    """``{(action, to_state): count}`` of the audit events retention has deleted."""
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

    if not dialect.is_postgres() or connection.in_atomic_block:
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


def live_todo_holding_thread(endpoint, thread_live_key) -> Todo | None:
    """The endpoint's todo live for ``thread_live_key`` right now (``LIVE_FOR_THREAD``), if
    any: the row the partial unique index todo_live_thread collapses a thread's creates onto."""
    return Todo.objects.filter(LIVE_FOR_THREAD, endpoint=endpoint,
                               thread_live_key=thread_live_key).first()


def has_followup_of_delivery(todo_id, *, webhook_id, delivery_id: str, body_sha256: str) -> bool:
    """Whether ``todo_id`` already has a follow-up from that webhook's delivery (by its
    delivery id, else its body's digest): a redelivery of a follow-up is a duplicate."""
    same = ({"delivery_event__delivery_id": delivery_id} if delivery_id
            else {"delivery_event__body_sha256": body_sha256})
    return FollowUp.objects.filter(todo_id=todo_id, delivery_event__webhook_id=webhook_id,
                                   **same).exists()


def endpoint_queue_counts(endpoint, *, now=None) -> list[dict]:
    """Per queue of ``endpoint``, the glance's counts (``glance_columns``: pending, claimed,
    retrying, dead, done_24h …) and ``oldest_pending_seconds``: the queue-stats shape scripts
    read. One implementation with the board's header (``board_glance``)."""
    now = now or timezone.now()
    queues = board_glance([endpoint.pk], now=now)[endpoint.pk]["queues"]
    rows = []
    for queue in sorted(queues):
        counts = queues[queue]
        oldest = counts.get("oldest_pending_at")
        rows.append({
            "queue": queue, **{column: counts.get(column, 0) for column in glance_columns()},
            "oldest_pending_seconds": (
                max(0, int((now - datetime.fromisoformat(oldest.replace("Z", "+00:00")))
                           .total_seconds())) if oldest else None),
        })
    return rows


# -- the board's glance: counts per endpoint and queue, and throughput ---------------------------
#
# Generic over the lifecycle (``State`` and the edges): states no edge leaves are counted over
# the last day from the throughput tallies, the others from the todos themselves.

MEASURE_CREATED = "created"
CHART_MINUTE = timedelta(minutes=1)
CHART_HOUR = timedelta(hours=1)
CHART_MINUTES = 60  # the per-minute chart: the last hour
CHART_HOURS = 24  # the per-hour chart (and the "… 24 h" counts): the last day
# Pending todos with a ``not_before`` are scheduled: pending, not yet claimable (the due
# sweep clears it when the time comes, so "claimable" is exactly ``not_before IS NULL``).
SCHEDULED_FIELD = "not_before"


def terminal_states() -> list[str]:
    """The states no edge leaves (a todo there is history), in ``State`` order."""
    from .models import EDGES

    leaving = {from_state for _, from_state, to_state in EDGES
               if from_state is not None and from_state != to_state}
    return [state for state in State.values if state not in leaving]


def open_states() -> list[str]:
    terminal = terminal_states()
    return [state for state in State.values if state not in terminal]


def has_scheduled_todos() -> bool:
    return any(field.name == SCHEDULED_FIELD for field in Todo._meta.get_fields())


def glance_columns() -> list[str]:
    """The count columns of the glance, in the board's order: the live states (``failed``
    split into ``retrying`` and ``dead``, ``pending`` into ``pending`` and ``scheduled`` when
    todos can be scheduled), then ``<state>_24h`` for each terminal state."""
    columns = []
    for state in open_states():
        if state == State.FAILED:
            columns += ["retrying", "dead"]
        elif state == State.PENDING and has_scheduled_todos():
            columns += ["pending", "scheduled"]
        else:
            columns.append(state)
    return columns + [f"{state}_24h" for state in terminal_states()]


def count_open_todos(endpoint_ids, *, now) -> dict:
    """``{(endpoint id, queue): {column: n, "oldest_pending_at": datetime or None}}`` for the
    live states, in one grouped statement over ``todo_by_state`` (endpoint, state, queue): its
    cost follows the backlog of these endpoints, never the done history."""
    from django.db.models import Min

    ready = Q()
    extra = {}
    if has_scheduled_todos():
        extra["scheduled"] = Count("id", filter=Q(**{f"{SCHEDULED_FIELD}__isnull": False}))
        ready = Q(**{f"{SCHEDULED_FIELD}__isnull": True})
    rows = (Todo.objects.filter(endpoint_id__in=list(endpoint_ids), state__in=open_states())
            .values("endpoint_id", "queue", "state")
            .annotate(n=Count("id"), dead=Count("id", filter=Q(dead_lettered_at__isnull=False)),
                      oldest=Min("created_at", filter=ready), **extra)
            .order_by())
    counts = {}
    for row in rows:
        queue = counts.setdefault((row["endpoint_id"], row["queue"]), {})
        state, n = row["state"], row["n"]
        if state == State.FAILED:
            queue["dead"] = row["dead"]
            queue["retrying"] = n - row["dead"]
        elif state == State.PENDING:
            queue["scheduled"] = row.get("scheduled", 0)
            queue["pending"] = n - queue["scheduled"]
            queue["oldest_pending_at"] = row["oldest"] if queue["pending"] else None
        else:
            queue[state] = n
    return counts


def _measure(from_state, to_state):
    """What an event counts as in the tallies: a creation, entering a state, or nothing (a
    heartbeat, a promote: no state change)."""
    if from_state is None:
        return MEASURE_CREATED
    return to_state if from_state != to_state else None


def count_throughput_events(*, after_id, up_to_id=None, endpoint_ids=None) -> list:
    """``(endpoint id, queue, minute, measure, n)`` over the audit events with ids in
    (``after_id``, ``up_to_id``]: a primary-key range, each event's todo joined by its key."""
    from datetime import timezone as dt_timezone

    from django.db.models.functions import Trunc

    from .models import TodoEvent

    events = TodoEvent.objects.filter(id__gt=after_id)
    if up_to_id is not None:
        events = events.filter(id__lte=up_to_id)
    if endpoint_ids is not None:
        events = events.filter(todo__endpoint_id__in=list(endpoint_ids))
    rows = (events.values_list("todo__endpoint_id", "todo__queue",
                               Trunc("at", "minute", tzinfo=dt_timezone.utc),
                               "from_state", "to_state")
            .annotate(n=Count("id")).order_by())
    tallies = {}
    for endpoint_id, queue, minute, from_state, to_state, n in rows:
        measure = _measure(from_state, to_state)
        if measure is not None and endpoint_id is not None:
            key = (endpoint_id, queue, minute, measure)
            tallies[key] = tallies.get(key, 0) + n
    return [(*key, n) for key, n in tallies.items()]


def _hour_of(moment):
    return moment.replace(minute=0, second=0, microsecond=0)


def throughput(endpoint_ids, *, now) -> dict:
    """``{(endpoint id, queue, span seconds, bucket start, measure): n}`` for the last hour by
    minute and the last day by hour: the folded tallies plus the events the fold has not
    reached yet, read in one snapshot so an event is counted exactly once (a fold that commits
    in between moves both the tallies and the fold row). Three queries."""
    from .models import ThroughputFold, ThroughputTally

    endpoint_ids = list(endpoint_ids)
    first_minute = now.replace(second=0, microsecond=0) - (CHART_MINUTES - 1) * CHART_MINUTE
    first_hour = _hour_of(now) - (CHART_HOURS - 1) * CHART_HOUR
    counts = {}
    with metrics_snapshot():
        through = (ThroughputFold.objects.filter(pk=1)
                   .values_list("through_event_id", flat=True).first() or 0)
        tallies = (ThroughputTally.objects.filter(endpoint_id__in=endpoint_ids)
                   .filter(Q(span_seconds=60, bucket_start__gte=first_minute)
                           | Q(span_seconds=3600, bucket_start__gte=first_hour))
                   .values_list("endpoint_id", "queue", "span_seconds", "bucket_start",
                                "measure", "count"))
        for endpoint_id, queue, span, start, measure, n in tallies:
            key = (endpoint_id, queue, span, start, measure)
            counts[key] = counts.get(key, 0) + n
        for endpoint_id, queue, minute, measure, n in count_throughput_events(
                after_id=through, endpoint_ids=endpoint_ids):
            for span, start, first in ((60, minute, first_minute),
                                       (3600, _hour_of(minute), first_hour)):
                if start >= first:
                    key = (endpoint_id, queue, span, start, measure)
                    counts[key] = counts.get(key, 0) + n
    return counts


def board_glance(endpoint_ids, *, now=None) -> dict:
    """What the board's header shows of these endpoints, JSON-ready, in four queries whatever
    their number: ``{endpoint id: {"queues": {queue: {column: n, "oldest_pending_at": iso}},
    "series": {"minute"|"hour": {measure: {bucket start (unix s): n}}}}}``. Columns as
    ``glance_columns``; ``<state>_24h`` sums the last day's hour buckets (the current hour and
    the 23 before it)."""
    now = now or timezone.now()
    endpoint_ids = list(endpoint_ids)
    glance = {endpoint_id: {"queues": {}, "series": {"minute": {}, "hour": {}}}
              for endpoint_id in endpoint_ids}
    terminal = set(terminal_states())
    for (endpoint_id, queue), counts in count_open_todos(endpoint_ids, now=now).items():
        oldest = counts.pop("oldest_pending_at", None)
        glance[endpoint_id]["queues"][queue] = {**counts, "oldest_pending_at": iso_time(oldest)}
    for (endpoint_id, queue, span, start, measure), n in throughput(endpoint_ids,
                                                                     now=now).items():
        entry = glance[endpoint_id]
        series = entry["series"]["minute" if span == 60 else "hour"].setdefault(measure, {})
        stamp = int(start.timestamp())
        series[stamp] = series.get(stamp, 0) + n
        if span == 3600 and measure in terminal:
            counts = entry["queues"].setdefault(queue, {"oldest_pending_at": None})
            counts[f"{measure}_24h"] = counts.get(f"{measure}_24h", 0) + n
    return glance


# -- queue stats for machines (docs/work-control.md#stats) ---------------------------------------

STATS_COUNTS = ("pending", "scheduled", "awaiting_approval", "claimed", "retrying", "dead",
                "done_24h", "cancelled_24h")


def endpoint_queue_stats(endpoint, *, now) -> list[dict]:
    """Per queue of ``endpoint``, exactly the stats keys (STATS_COUNTS and
    ``oldest_pending_seconds``), zero for a state the lifecycle does not have yet, and every
    queue of an explicit scope listed even when empty. The counts are the glance's
    (``endpoint_queue_counts``): one implementation with the board's header."""
    rows = {row["queue"]: row for row in endpoint_queue_counts(endpoint, now=now)}
    queues = set(rows) | (set() if endpoint.all_queues else set(endpoint.scope))
    return [{"queue": queue, **{name: rows.get(queue, {}).get(name, 0) for name in STATS_COUNTS},
             "oldest_pending_seconds": rows.get(queue, {}).get("oldest_pending_seconds")}
            for queue in sorted(queues)]


# -- who may be rung (the doorbell's sender gate) -------------------------------------------------

# The trust modes that may ring, as a literal: the partial index todo_doorbell_due spells it,
# and with a parameter the planner could not match the index's predicate.
RING_TRUST_SQL = "('signed', 'operator')"


def ring_eligible_sql(alias: str) -> str:
    """SQL over the todo row ``alias``: it may ring now — pending and not scheduled (a
    scheduled todo is rung when it comes due), trusted, and attributed to a human through its
    delivery event."""
    return (
        f"{alias}.state = 'pending' AND {alias}.not_before IS NULL"
        f" AND {alias}.trust IN {RING_TRUST_SQL} AND EXISTS ("
        f"SELECT 1 FROM ingest_deliveryevent d WHERE d.id = {alias}.delivery_event_id "
        "AND d.attributed_to_id IS NOT NULL)"
    )


def may_ring(todo_id) -> bool:
    """Whether todo ``todo_id`` may ring now (``ring_eligible_sql``)."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT 1 FROM todos_todo t WHERE t.id = %s AND {ring_eligible_sql('t')}",
                       [todo_id])
        return cursor.fetchone() is not None


def parse_todo_id(value) -> int | None:
    """The todo id ``value`` names (as a client gave it: ASCII decimal text or an int), or None
    when it names none. ``int()`` alone would also take " 4", "٤" or "²"."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.isascii() and value.isdigit() and len(value) < 20:
        number = int(value)
    else:
        return None
    return number if 0 < number <= MAX_TODO_ID else None


def visible_to(caller, *, queue: str, trust: str, lease_owner: str | None,
               claiming: bool = False) -> bool:
    """Whether ``caller`` may see a todo of its endpoint in ``queue``: in its scope, and not an
    unverified one hidden from it (``accept_unverified`` off) — for every verb, not only claim,
    since a fenced verb's "lease_lost … is pending" would tell it exists. Its holder (a claim
    from before the setting changed) still sees its own lease, unless ``claiming``."""
    hidden = (caller.hides_unverified and trust == Trust.UNVERIFIED
              and (claiming or lease_owner != caller.actor))
    return caller.covers(queue) and not hidden


def find_traced_todo(caller, todo_id) -> dict | None:
    """What a tool call's span names of todo ``todo_id`` (an id as an agent gave it): its
    ``id``, ``traceparent``, ``queue`` and ``attempts``; None unless it is a todo ``caller`` may
    see (``visible_to``), so no text of the agent's and nothing of another's todo is named."""
    number = parse_todo_id(todo_id)
    if number is None:
        return None
    row = (Todo.objects.filter(pk=number, endpoint_id=caller.endpoint.pk)
           .values("traceparent", "queue", "attempts", "trust", "lease_owner").first())
    if row is None or not visible_to(caller, queue=row["queue"], trust=row["trust"],
                                     lease_owner=row["lease_owner"]):
        return None
    return {"id": str(number), "traceparent": row["traceparent"], "queue": row["queue"],
            "attempts": row["attempts"]}


# -- a todo's end, for what dies with it ----------------------------------------------------------


def find_todo_state(todo_id) -> str | None:
    """Todo ``todo_id``'s state now; None when it is gone."""
    return Todo.objects.filter(pk=todo_id).values_list("state", flat=True).first()


def no_todo_points_at_sql(delivery_event: str) -> str:
    """SQL over ingest's delivery event row ``delivery_event``: no todo points at it any more
    (its todos were pruned, or it created none), for the delivery events' retention prune.
    Served by the todo's own delivery_event_id index."""
    return (f"NOT EXISTS (SELECT 1 FROM todos_todo t"
            f" WHERE t.delivery_event_id = {delivery_event}.id)")


def todo_gone_sql(todo_id: str) -> str:
    """SQL over another app's column ``todo_id``: that todo is no more (the retention prune
    took it), for the prune of what referred to it (ingest's write-backs). Served by the
    todo's primary key."""
    return f"NOT EXISTS (SELECT 1 FROM todos_todo t WHERE t.id = {todo_id})"


def _ending_events():
    """The events that finish a todo: done, cancelled (cancel, reject), dead-lettered (a failure
    with no attempt left, or the last attempt's lease lapsing)."""
    from .models import TodoEvent

    return TodoEvent.objects.filter(
        Q(to_state__in=(State.DONE, State.CANCELLED)) | Q(action="dead_letter")
        | Q(action="lease_lapsed", to_state=State.FAILED))


def has_ended(todo_id) -> bool:
    """Whether todo ``todo_id`` was ever finished — done, cancelled or dead-lettered — even if
    an operator has re-queued the dead letter since. Read from its events, which live as long
    as the todo does."""
    return _ending_events().filter(todo_id=todo_id).exists()


def ended(todo_ref) -> Exists:
    """``has_ended`` as a filter over ``todo_ref`` (an ``OuterRef`` to a todo id): for another
    app's rows that die with their todo."""
    return Exists(_ending_events().filter(todo_id=todo_ref))


# -- todo tokens (docs/security.md#the-todo-token) ---------------------------------------------


def todo_token_live_sql(token: str, todo: str, *, now_param: str) -> str:
    """SQL over a todo token row ``token`` and its todo's row ``todo``: the token still gives
    its rights, that is, its todo is claimed under the very lease it was issued for and that
    lease has not lapsed. The one spelling of "a todo token dies with its lease"."""
    return (f"({todo}.id = {token}.todo_id AND {todo}.endpoint_id = {token}.endpoint_id"
            f" AND {todo}.state = 'claimed' AND {todo}.lease_id = {token}.lease_id"
            f" AND {todo}.lease_expires_at > %({now_param})s AND {token}.revoked_at IS NULL)")


@dataclass(frozen=True)
class TodoGrant:
    """What a todo token lets its bearer act on: one todo, under one lease, as that lease's
    holder (``lease_owner``: the session that claimed it)."""

    token_id: int
    todo_id: int
    lease_id: str
    lease_owner: str


def find_endpoint_for_todo_token(slug: str, token: str, *, now=None, join_sql: str = "",
                                 join_columns=None, join_params=None):
    """The active endpoint ``slug`` (of an active owner) whose todo ``token`` names, while that
    token still gives its rights (``todo_token_live_sql``), else None. ``endpoint.todo_grant``
    is the ``TodoGrant``; ``endpoint.credential_id`` is None. ``join_sql`` and friends: as
    ``endpoints.queries.find_endpoint_for_credential`` (aliases ``e``, ``k`` the token, ``t``
    the todo). Looked up by digest, compared again in constant time."""
    from endpoints import queries as endpoint_queries
    from endpoints.models import Endpoint, hash_credential
    from switchboard.db import statements

    if not token or not token.startswith(TODO_TOKEN_PREFIX):
        return None
    now = now or timezone.now()
    select, names, _, _ = statements.model_columns(Endpoint, "e")
    extra = dict(join_columns or {})
    joins, _ = endpoint_queries.credential_rights_sql("k", "e", "u")
    params = {**(join_params or {}), "slug": slug, "digest": hash_credential(token),
              "now": connection.ops.adapt_datetimefield_value(now)}
    columns = "".join(f", {expression}" for expression in extra.values())
    sql = (f"SELECT {select}, k.digest, k.id, t.id, t.lease_id, t.lease_owner{columns}"
           f" FROM todos_todotoken k{joins} JOIN todos_todo t ON t.id = k.todo_id{join_sql}"
           f" WHERE k.digest = %(digest)s AND e.slug = %(slug)s"
           f" AND {todo_token_live_sql('k', 't', now_param='now')} LIMIT 1")
    row = next(iter(statements.fetch_all(sql, params)), None)
    width = len(names)
    if row is None or not hmac.compare_digest(row[width], params["digest"]):
        return None
    endpoint = statements.instance_from_fetched(Endpoint, "e", row[:width])
    endpoint.credential_id = None
    endpoint.todo_grant = TodoGrant(token_id=row[width + 1], todo_id=row[width + 2],
                                    lease_id=row[width + 3], lease_owner=row[width + 4])
    for attribute, value in zip(extra, row[width + 5:]):
        setattr(endpoint, attribute, value)
    return endpoint


def todo_tokens_of(todo_id) -> list:
    """The todo tokens issued for ``todo_id``, oldest first, for its page (never the token)."""
    from .models import TodoToken

    return list(TodoToken.objects.filter(todo_id=todo_id).order_by("issued_at", "id")
                .values("id", "lease_id", "issued_at", "revoked_at"))
