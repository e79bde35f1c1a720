"""Every write that moves a todo through its lifecycle (docs/reference.md#todo-states).

Each transition is ONE guarded statement (``UPDATE … WHERE id = … AND state = … RETURNING``)
plus its todo event row, in one transaction:

* PostgreSQL: the event is written by a data-modifying CTE in the same statement: no more
  than the bare UPDATE costs, where UPDATE and INSERT as two round trips cut claim throughput
  steeply (bench/queue.py measures claim throughput).
* SQLite (embedded default): SQLite has no data-modifying CTEs, so the UPDATE … RETURNING and
  the event INSERT run as two statements inside one IMMEDIATE transaction; SQLite's single
  writer makes that equally atomic.

No transition reads, checks in Python, then writes. When a guard does not match, the statement
changed nothing; only then do we read the row once to say *why* (``Refusal.code``), and that read
never feeds a write.

Times are computed in Python from one clock read per operation and passed as parameters (no SQL
date arithmetic), so both backends share the SQL and tests drive the clock with ``now=``.
"""

import json
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import IntegrityError, connection, models, transaction
from django.utils import timezone

from channels_push.bus import publish
from channels_push.sessions import transitions as session_transitions
from endpoints.models import hash_credential
from switchboard import json_input, tracing
from switchboard.db import sql as dialect
from switchboard.db.sql import is_postgres as _is_postgres

from . import queries, statements, usage
from .models import (LIVE_FOR_IDEMPOTENCY, MAX_PROGRESS_CHARS, MAX_SCHEDULE_AHEAD,
                     NOT_BEFORE_PAST_TOLERANCE, PRIORITY_DEFAULT, PRIORITY_MAX, PRIORITY_MIN,
                     SILENT_TO_SOURCE, TODO_TOKEN_PREFIX, FollowUp, State, Todo, Trust,
                     WriteBack)

# A todo's title is folded to one line and cut to its column's width.
MAX_TITLE_CHARS = Todo._meta.get_field("title").max_length
MIN_LEASE = timedelta(seconds=1)
MAX_LEASE = timedelta(hours=24)
FIRST_RETRY_BACKOFF = timedelta(seconds=30)
MAX_RETRY_BACKOFF = timedelta(minutes=15)
# attempts >= this many all share the capped backoff (30 s * 2**5 = 960 s > 900 s).
_BACKOFF_STEPS = 6


class Refusal(Exception):
    """A transition that did not apply, with a machine-readable code
    (docs/reference.md#refusal-codes): ``not_found``, ``not_in_scope``, ``not_claimable``,
    ``lease_lost``, ``already_done``, ``paused``, ``scheduled``, ``at_capacity``,
    ``over_budget``, ``awaiting_approval``, ``invalid_argument``, ``write_back_off``."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message
        # Members the answer adds to ``{"code", "message"}`` (``usage_recorded``).
        self.data = {}


@dataclass(frozen=True)
class Caller:
    """Who is acting: the endpoint whose todos they may touch, the queues they may see (None =
    all of the endpoint's queues) and the name recorded as lease owner and event actor."""

    endpoint: object
    actor: str
    queues: tuple | None = None
    # An agent of an endpoint that refuses unverified todos (``accept_unverified`` off): they
    # are invisible to its claims and lists, exactly like a todo outside its scope.
    hides_unverified: bool = False
    is_operator: bool = False

    @classmethod
    def agent(cls, endpoint, session_id: str) -> "Caller":
        queues = None if endpoint.all_queues else tuple(endpoint.scope)
        return cls(endpoint=endpoint, actor=session_id, queues=queues,
                   hides_unverified=refuses_unverified(endpoint))

    @classmethod
    def operator(cls, endpoint, username: str) -> "Caller":
        # The endpoint's owner (or a superuser) sees every queue of it.
        return cls(endpoint=endpoint, actor=username, queues=None, is_operator=True)

    def covers(self, queue: str) -> bool:
        return self.queues is None or queue in self.queues


@dataclass(frozen=True)
class HeldLease:
    """The lease an operator override acts on, as the operator saw it (board or admin). The
    override is fenced by both values, so it acts on exactly that lease or on nothing, and the
    event can name the lease it overrode without reading the row first."""

    lease_id: str
    owner: str

    @classmethod
    def of(cls, todo) -> "HeldLease":
        return cls(lease_id=todo.lease_id or "", owner=todo.lease_owner or "")

    def as_detail(self) -> dict:
        return statements.lease_hint(self.lease_id, self.owner)


# The operator's verbs as the console and admin name them once done.
ACTION_DONE = {
    "claim": "claimed", "complete": "completed", "fail": "failed", "extend": "extended the lease of",
    "release": "released", "retry": "re-queued", "promote": "promoted (now trust operator)",
    "priority": "set the priority of", "run_now": "made ready now",
    "approve": "approved", "reject": "rejected", "cancel": "cancelled",
}
OVERRIDABLE = frozenset({"complete", "fail", "extend", "release"})


def agent_lease_to_override(todo, username: str, action: str) -> HeldLease | None:
    """The lease an operator's action overrides: an agent's (anyone's but theirs) claim, or
    None when the operator acts on their own lease or on no lease."""
    if action in OVERRIDABLE and todo.state == State.CLAIMED and todo.lease_owner != username:
        return HeldLease.of(todo)
    return None


# -- what every verb checks and says ------------------------------------------------------------


def _one(rows):
    return rows[0] if rows else None


def _lease_ttl(caller: Caller, lease_ttl_seconds) -> timedelta:
    if lease_ttl_seconds is None:
        return caller.endpoint.effective_lease
    if isinstance(lease_ttl_seconds, bool) or not isinstance(lease_ttl_seconds, (int, float)):
        raise Refusal("invalid_argument", "lease_ttl_seconds must be a number of seconds")
    # Range-check the number before building a timedelta: NaN fails every comparison (so it is
    # refused here) and a huge value would overflow timedelta.
    if not MIN_LEASE.total_seconds() <= lease_ttl_seconds <= MAX_LEASE.total_seconds():
        raise Refusal("invalid_argument", "lease_ttl_seconds must be between 1 and 86400")
    return timedelta(seconds=lease_ttl_seconds)


def _check_storable(**values) -> None:
    # Text or numbers no database can store (NUL, a lone surrogate, NaN, too deep): refused
    # naming the field, by the one walk every surface uses (switchboard/json_input.py).
    problem = json_input.find_unstorable(values)
    if problem is not None:
        raise Refusal("invalid_argument", problem)


def _todo_id(todo_id) -> int:
    value = queries.parse_todo_id(todo_id)
    if value is None:
        shown = todo_id if type(todo_id) is int else str(todo_id)[:40]
        raise Refusal("not_found", f"no todo {shown!r}")
    return value


def _explain_refusal(caller: Caller, todo_id: int, lease_id=None, *, claiming=False, now=None,
                     completing=False, overriding=None) -> Refusal:
    """After a guard missed: read the row once and say why. Invisible looks like missing."""
    todo = Todo.objects.filter(pk=todo_id, endpoint_id=caller.endpoint.pk).first()
    if todo is None or not queries.visible_to(caller, queue=todo.queue, trust=todo.trust,
                                              lease_owner=todo.lease_owner, claiming=claiming):
        return Refusal("not_found", f"no todo {todo_id}")
    if claiming and todo.state == State.AWAITING_APPROVAL:
        return Refusal("awaiting_approval", f"todo {todo_id} waits for its operator's approval; "
                                            "it cannot be claimed until it is approved")
    if claiming and todo.state == "pending" and caller.endpoint.is_paused(todo.queue):
        return Refusal("paused", f"queue {todo.queue} of this endpoint is paused by its operator")
    if (claiming and todo.state == "pending" and todo.not_before is not None
            and (now is None or todo.not_before > now)):
        return Refusal("scheduled", f"todo {todo_id} is scheduled: not before "
                                    f"{queries.iso_time(todo.not_before)}; claim it then")
    if (claiming and todo.state == "pending" and caller.endpoint.has_budget
            and usage.over_budget(caller.endpoint, now or timezone.now())):
        return over_budget_refusal()
    if claiming and todo.state == "pending" and caller.endpoint.has_claim_caps:
        # Pending, visible and not paused: the capacity guard is what held it back.
        return Refusal("at_capacity", f"this endpoint (or queue {todo.queue}) has as many todos "
                                      "claimed as its cap allows; claim again when one settles")
    if claiming:
        return Refusal("not_claimable", f"todo {todo_id} is {todo.state}, not pending")
    if overriding is not None:
        return Refusal("lease_lost", f"todo {todo_id} is {todo.state} and the agent's lease "
                                     "you acted on has ended or changed; nothing was changed")
    held = todo.lease_id == lease_id if lease_id else todo.lease_owner == caller.actor
    holder = "you" if caller.is_operator else ("this lease" if lease_id else "this session")
    if held and todo.state == State.DONE and completing:
        # The same lease already completed it: a retry after a lost answer, not a conflict.
        return Refusal("already_done", f"todo {todo_id} is already done: {holder} completed it "
                                       "and the result was recorded; nothing more to do")
    if held and todo.state == State.CLAIMED and now is not None and todo.lease_expires_at <= now:
        whose = "your lease" if lease_id or caller.is_operator else "the lease this session held"
        return Refusal("lease_lost", f"{whose} on todo {todo_id} lapsed at "
                                     f"{todo.lease_expires_at.isoformat()}; the todo goes back to "
                                     "the queue: stop working on it")
    if todo.state == State.CANCELLED:
        # Its operator, its source (a closed thread) or its holder's own cancel ended it.
        return Refusal("lease_lost", f"todo {todo_id} was cancelled: stop working on it; "
                                     "nothing was changed")
    if todo.state == State.PENDING:
        return Refusal("lease_lost", f"todo {todo_id} is pending and not held by {holder}; "
                                     "claim it again to work on it")
    return Refusal("lease_lost", f"todo {todo_id} is {todo.state} and not held by {holder}")


def over_budget_refusal() -> Refusal:
    return Refusal("over_budget", "this endpoint has spent its daily budget (UTC day); work "
                                  "waits until the day turns or its operator raises the budget")


def _announce(todos, action: str):
    for todo in todos:
        publish.publish_on_commit(todo, action)


# -- create --------------------------------------------------------------------------------------


def create_todo_params(*, endpoint, queue: str, title: str, actor: str, payload=None,
                       kind: str = "", source: str = "", idempotency_key: str | None = None,
                       delivery_event_id=None, trust: str = Trust.UNVERIFIED, now,
                       payload_storable: bool = False, priority: int = PRIORITY_DEFAULT,
                       not_before=None, requires_approval: bool = False,
                       write_back: str = WriteBack.OFF, max_cost_usd=None, thread=None,
                       thread_live_key=None) -> dict:
    """The parameters of a create statement (``create_todo``, ``statements.create_todo_ctes``): the title
    folded to one line of at most ``MAX_TITLE_CHARS``. Refuses ``invalid_argument`` for a value no
    database can store; ``payload_storable`` says the caller already knows the payload is
    (ingest: ``json_input.is_plainly_storable`` of the text it was parsed from).
    ``priority`` (``check_priority``) and ``not_before`` (``resolve_not_before``: a future
    time, or None for ready at once) are the work-control settings it starts with;
    ``requires_approval``: the todo is created ``awaiting_approval`` instead of ``pending``;
    ``write_back``: what its source hears of it (``WriteBack``; ingest decides, from the
    route); ``thread`` its thread key, ``thread_live_key`` set only when the todo takes its
    thread's follow-ups (docs/work-control.md#threads)."""
    title = " ".join(str(title).split())[:MAX_TITLE_CHARS] or "(untitled)"
    check_priority(priority)
    _check_storable(title=title, kind=kind or "", queue=queue,
                    **({} if payload_storable else {"payload": payload}))
    return {
        "endpoint_id": endpoint.pk,
        "queue": queue,
        "state": State.AWAITING_APPROVAL if requires_approval else State.PENDING,
        "title": title,
        "kind": kind or "",
        "source": source or "",
        "payload": json.dumps(payload if payload is not None else {}),
        "key": idempotency_key,
        "delivery_event_id": delivery_event_id,
        "trust": trust,
        "max_attempts": endpoint.max_attempts,
        "priority": priority,
        "not_before": dialect.db_time(not_before),
        # Its own cost limit (docs/reference.md#usage-and-budgets); None: the endpoint's.
        "max_cost_usd": max_cost_usd,
        "now": dialect.db_time(now),
        "actor": actor,
        "detail": json.dumps({"delivery_event": delivery_event_id}),
        "write_back": WriteBack(write_back),
        "traceparent": tracing.work_traceparent(),
        "thread": thread,
        "thread_live_key": thread_live_key,
    }


def announce_created(todo: Todo, endpoint) -> None:
    """A created todo, announced once its transaction commits (doorbell, board). One awaiting
    approval reaches the board; the doorbell and long polls act only on pending todos, so it
    rings nobody until ``approve_todo`` announces it ready."""
    todo.endpoint = endpoint
    publish.publish_on_commit(todo, "create")


def create_todo(*, endpoint, queue: str, title: str, actor: str, payload=None, kind: str = "",
                source: str = "", idempotency_key: str | None = None, delivery_event=None,
                trust: str = Trust.UNVERIFIED, now=None,
                payload_storable: bool = False, priority: int = PRIORITY_DEFAULT,
                not_before=None, requires_approval: bool = False,
                write_back: str = WriteBack.OFF, max_cost_usd=None, thread=None,
                thread_live_key=None) -> tuple[Todo, bool]:
    """Create a pending todo (``awaiting_approval`` with ``requires_approval``: not claimable,
    never rung until approved), or return the live todo that already holds ``idempotency_key``.
    ``payload_storable``: the caller has checked the payload (``create_todo_params``).

    Returns ``(todo, created)``. Concurrent creates with one key collapse on the partial unique
    index ``todo_live_idempotency_key``: the loser's INSERT … ON CONFLICT DO NOTHING waits for the
    winner to commit, inserts nothing, and we return the winner's row. Only ``create`` is
    announced; a duplicate announces nothing.

    With ``thread_live_key``, a live todo holding that thread (index ``todo_live_thread``)
    makes the create insert nothing in the same way: ``ThreadHeld`` is raised naming it (the
    key is checked first: a redelivery is a duplicate, not a follow-up). ``thread``: the key
    shown (docs/work-control.md#threads).
    """
    now = now or timezone.now()
    params = create_todo_params(
        endpoint=endpoint, queue=queue, title=title, actor=actor, payload=payload, kind=kind,
        source=source, idempotency_key=idempotency_key, trust=trust, now=now,
        delivery_event_id=getattr(delivery_event, "pk", delivery_event),
        payload_storable=payload_storable, priority=priority, not_before=not_before,
        requires_approval=requires_approval, write_back=write_back, max_cost_usd=max_cost_usd,
        thread=thread, thread_live_key=thread_live_key)
    # A duplicate whose holder finishes between our conflict and our read frees the key; the
    # next INSERT then succeeds. Three rounds is more than that race can need.
    for _ in range(3):
        if _is_postgres():
            created = _one(statements.fetch_todos(
                f"WITH {statements.create_todo_ctes(writes_back=write_back != WriteBack.OFF)}"
                " SELECT * FROM t", params))
        else:
            with transaction.atomic():
                created = _one(statements.fetch_todos(statements.insert_todo_sql(), params))
                if created is not None:
                    params["todo_id"] = created.pk
                    with connection.cursor() as cursor:
                        cursor.execute(statements.insert_create_event_sql(), params)
                        if created.write_back != WriteBack.OFF:
                            cursor.execute(statements.insert_create_outbox_sql(), params)
        if created is not None:
            announce_created(created, endpoint)
            return created, True
        existing = queries.live_todo_holding_key(endpoint, idempotency_key)
        if existing is not None:
            existing.endpoint = endpoint
            return existing, False
        holder = thread_live_key and queries.live_todo_holding_thread(endpoint, thread_live_key)
        if holder:
            holder.endpoint = endpoint
            raise ThreadHeld(holder)
    raise RuntimeError(f"idempotency key {idempotency_key!r} kept conflicting")


class ThreadHeld(Exception):
    """``create_todo`` made nothing: ``todo`` is live for the thread it was to start."""

    def __init__(self, todo: Todo):
        super().__init__(f"todo {todo.pk} holds the thread")
        self.todo = todo


# -- agent (and operator) verbs -----------------------------------------------------------------


def claim_todo(caller: Caller, todo_id, *, lease_ttl_seconds=None, now=None) -> Todo:
    """pending -> claimed for ``todo_id`` under a fresh lease; counts one attempt.

    Refuses ``not_found`` (missing or invisible to the caller), ``not_claimable`` (not pending),
    ``paused`` (its queue is paused), ``scheduled`` (its ``not_before`` has not come),
    ``at_capacity`` (the endpoint or the queue has as many todos claimed as its cap allows),
    ``over_budget`` (the endpoint's spend today is at or over a daily budget),
    ``invalid_argument`` (lease ttl outside 1 s … 24 h). A scheduled todo whose time has come
    is claimable at once, before the due sweep has cleared its ``not_before``.
    """
    now = now or timezone.now()
    ttl = _lease_ttl(caller, lease_ttl_seconds)
    todo_id = _todo_id(todo_id)
    params = {"todo_id": todo_id}
    where = statements.by_id(statements.visible_guard(caller, params) + " AND state = 'pending'"
                   + " AND (not_before IS NULL OR not_before <= %(now)s)"
                   + statements.trust_filter(caller.hides_unverified)
                   + statements.unpaused_where(caller.endpoint, params)
                   + usage.budget_guard_sql(caller.endpoint, params, now)
                   + statements.claim_cap_guard(caller.endpoint, params, lock_row_first=True))
    todo = _one(statements.apply_transition(
        set_sql=statements.lease_set(params, caller, ttl, now), where_sql=where, params=params,
        action_sql="'claim'", from_state_sql="'pending'", actor=caller.actor, now=now,
        endpoint=caller.endpoint,
    ))
    if todo is None:
        raise _explain_refusal(caller, todo_id, claiming=True, now=now)
    _announce([todo], "claim")
    return todo


# -- concurrency caps (docs/work-control.md#caps; the guard: statements.claim_cap_guard) ---------


def held_back_by_cap(caller: Caller, wanted, hide_unverified: bool) -> bool:
    """After an empty claim_next: whether a cap is what left it empty — the endpoint is at its
    cap with a todo it could claim pending, or such a todo waits in a queue at its own cap
    (the pick skipped those queues, so what it missed elsewhere was a race, and the caller
    retries). A read for the answer's sake only; the claim statement's guard enforces caps."""
    endpoint = caller.endpoint
    claimed = dict(Todo.objects.filter(endpoint_id=endpoint.pk, state=State.CLAIMED)
                   .values_list("queue").annotate(n=models.Count("id")).values_list("queue", "n"))
    if endpoint.max_claimed is not None and sum(claimed.values()) >= endpoint.max_claimed:
        return _claimable_exists(caller, wanted, hide_unverified)
    full = [queue for queue, cap in (endpoint.queue_limits or {}).items()
            if claimed.get(queue, 0) >= cap and (wanted is None or queue in wanted)
            and not endpoint.is_paused(queue)]
    return bool(full) and _claimable_exists(caller, full, hide_unverified)


def claim_next_todo(caller: Caller, *, queues=None, lease_ttl_seconds=None, verified_only=False,
                    now=None) -> Todo | None:
    """Atomically claim the ready todo with the highest priority, then the oldest, in the
    caller's granted queues (or the given subset of them); None when there is none. Concurrent callers each get a different todo.
    ``verified_only``: skip ``unverified`` todos (as an endpoint that refuses them always does),
    so a worker that runs commands claims only what an authenticated sender handed over.

    PostgreSQL: the candidate is held by the claim's own lock inside the same statement
    (``statements.claim_candidate_sql``), so a competing worker skips it instead of waiting,
    while a todo that only a digest or a ring holds for a moment is still handed out in its
    turn. With a list of queues, each queue is probed on its own (LATERAL … LIMIT 1 on
    ``todo_claim_by_queue``) and the best head wins: ``queue = ANY(…) ORDER BY created_at``
    cannot use the index order, so it sorts the matching rows instead. SQLite: the same
    statement without the lock clause; its single writer serializes claims. Refuses
    ``not_in_scope`` when ``queues`` names a queue outside the caller's grant, and ``at_capacity``
    when only a cap keeps it from claiming (``held_back_by_cap``), ``over_budget`` when the
    endpoint's spend today is at or over a budget (the MCP tool answers both as an empty
    result, not an error).
    """
    now = now or timezone.now()
    ttl = _lease_ttl(caller, lease_ttl_seconds)
    if queues is not None:
        if isinstance(queues, str) or not all(isinstance(q, str) for q in queues) or not queues:
            raise Refusal("invalid_argument", "queues must be a non-empty list of queue names")
        outside = sorted(q for q in set(queues) if not caller.covers(q))
        if outside:
            raise Refusal("not_in_scope", f"queues outside this endpoint's scope: {outside}")
        wanted = sorted(set(queues))
    else:
        wanted = None if caller.queues is None else sorted(caller.queues)
    # Pause: paused queues are skipped; with every wanted queue paused there is nothing.
    wanted = caller.endpoint.unpaused(wanted)
    if wanted == [] or caller.endpoint.paused_all:
        return None
    params = {"endpoint_id": caller.endpoint.pk}
    hide_unverified = caller.hides_unverified or bool(verified_only)
    pick = statements.claim_candidate_sql(params, wanted, hide_unverified=hide_unverified,
                               endpoint=caller.endpoint)
    for pause_seconds in (*CLAIM_PAUSES_WHILE_LOCKED_SECONDS, None):
        todo = _one(statements.apply_transition(
            set_sql=statements.lease_set(params, caller, ttl, now),
            where_sql=f"id = ({pick}) AND {statements.READY_SQL.format(t='')}"
                      + usage.budget_guard_sql(caller.endpoint, params, now)
                      + statements.claim_cap_guard(caller.endpoint, params), params=params,
            action_sql="'claim'", from_state_sql="'pending'", actor=caller.actor, now=now,
            endpoint=caller.endpoint,
        ))
        if todo is not None:
            _announce([todo], "claim")
            return todo
        # A budget or a cap holding it back is an answer, not a lock to wait out: no retry.
        claimable = None
        if caller.endpoint.has_budget:
            if _is_postgres() and pause_seconds is not None:
                # One statement for both questions: a miss under contention is common.
                claimable, over = _claimable_or_over_budget(caller, wanted, hide_unverified, now)
            else:
                over = usage.over_budget(caller.endpoint, now)
            if over:
                raise over_budget_refusal()
        if caller.endpoint.has_claim_caps and held_back_by_cap(caller, wanted, hide_unverified):
            raise Refusal("at_capacity", "as many todos are claimed as this endpoint's caps "
                                         "allow; claim again when one settles")
        if pause_seconds is None or not _is_postgres() or not (
                claimable if claimable is not None
                else _claimable_exists(caller, wanted, hide_unverified)):
            if pause_seconds is None and caller.endpoint.has_claim_caps:
                # Every try lost to concurrent claims filling the cap as fast as it freed.
                raise Refusal("at_capacity", "this endpoint's caps are taken by concurrent "
                                             "claims; claim again when one settles")
            return None
        time.sleep(pause_seconds)
    return None


# The pick passes over rows other claims hold (one may stay pending, its guard refused), and a
# claim by id or an operator may take the picked row first: so an empty claim looks once more
# without locks and, while a claimable row exists, retries after a short pause.
CLAIM_PAUSES_WHILE_LOCKED_SECONDS = (0.002, 0.005, 0.01, 0.02, 0.04)


def _claimable(caller: Caller, wanted, hide_unverified: bool):
    todos = Todo.objects.filter(endpoint_id=caller.endpoint.pk, state=State.PENDING,
                                not_before__isnull=True)
    if wanted is not None:
        todos = todos.filter(queue__in=wanted)
    elif caller.endpoint.paused_queues:
        todos = todos.exclude(queue__in=caller.endpoint.paused_queues)
    if hide_unverified:
        todos = todos.exclude(trust=Trust.UNVERIFIED)
    return todos


def _claimable_exists(caller: Caller, wanted, hide_unverified: bool) -> bool:
    return _claimable(caller, wanted, hide_unverified).exists()


def _claimable_or_over_budget(caller: Caller, wanted, hide_unverified: bool, now) -> tuple:
    """``(claimable todo exists, endpoint over its budget)`` in one statement (PostgreSQL)."""
    claimable_sql, claimable_params = (_claimable(caller, wanted, hide_unverified)
                                       .values("id")[:1].query.sql_with_params())
    params = {}
    over_sql = usage.over_budget_sql(caller.endpoint, params, now)
    names = [f"c{position}" for position in range(len(claimable_params))]
    params.update(zip(names, claimable_params))
    claimable_sql = claimable_sql % tuple(f"%({name})s" for name in names)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT EXISTS ({claimable_sql}), {over_sql}", params)
        return cursor.fetchone()


def _fenced(caller: Caller, todo_id, lease_id, *, set_sql, params, action_sql, action, now,
            detail=None, overriding=None, guard_sql="", report=None,
            detail_sql_over_t: str = "", prior_column: str = "") -> Todo:
    todo_id = _todo_id(todo_id)
    params["todo_id"] = todo_id
    where = statements.by_id(statements.visible_guard(caller, params) + " AND "
                   + statements.lease_fence(params, caller, lease_id, overriding) + guard_sql)
    if overriding is not None:
        if not caller.is_operator:
            raise ValueError("only an operator overrides another holder's lease")
        detail = {**(detail or {}), "override": True, "overridden_lease": overriding.as_detail()}
    if report is not None:
        # The attempt's usage: summed on the todo, kept in its event, added to the day's spend.
        detail = {**(detail or {}), "usage": usage.as_detail(report)}
        params.update(usage.usage_params(report, now))
        set_sql += ", " + usage.usage_set_sql(report)
    todo = _one(statements.apply_transition(
        set_sql=set_sql, where_sql=where, params=params, action_sql=action_sql,
        from_state_sql="'claimed'", actor=caller.actor, now=now, detail=detail,
        endpoint=caller.endpoint, tells_source=action not in SILENT_TO_SOURCE,
        detail_sql_over_t=detail_sql_over_t, prior_column=prior_column,
        also=lambda source: usage.spend_upsert_sql(report, source),
    ))
    if todo is None and guard_sql:
        # The fence held but the extra guard did not: say what the guard is about.
        without_guard = _one(statements.fetch_todos(
            f"SELECT {statements.returning()} FROM todos_todo WHERE "
            + statements.by_id(statements.visible_guard(caller, params) + " AND "
                               + statements.lease_fence(params, caller, lease_id, overriding)),
            {**params, "now": dialect.db_time(now)}))
        if without_guard is not None:
            raise Refusal("write_back_off", f"todo {todo_id}'s source hears no status from "
                                            "switchboard (its route writes no status back): "
                                            "there is nowhere to post an update")
    if todo is None:
        refusal = _explain_refusal(caller, todo_id, lease_id, now=now,
                                   completing=action == "complete", overriding=overriding)
        if report is not None:
            refusal.data["usage_recorded"] = (
                lease_id is not None and overriding is None
                and _add_usage_to_settled_attempt(caller, todo_id, lease_id, report, now))
        raise refusal
    _announce([todo], "cancel" if todo.state == State.CANCELLED else action)
    return todo


def post_update_todo(caller: Caller, todo_id, *, text, lease_id=None, now=None) -> Todo:
    """The holder's progress line for the todo's living status at its source
    (docs/write-back.md#the-living-status): stored on the todo (the latest wins; a new claim
    clears it), with a ``progress`` event and an outbox entry, so the status is edited. Fenced
    like heartbeat. Refuses ``invalid_argument`` (``text`` not a string of 1 to
    MAX_PROGRESS_CHARS characters), ``write_back_off`` (the todo's route writes no status),
    and what a fenced verb refuses."""
    now = now or timezone.now()
    if not isinstance(text, str) or not text.strip() or len(text) > MAX_PROGRESS_CHARS:
        raise Refusal("invalid_argument", f"text must be 1 to {MAX_PROGRESS_CHARS} characters")
    _check_storable(text=text)
    return _fenced(caller, todo_id, lease_id, set_sql="progress = %(progress)s",
                   params={"progress": text}, action_sql="'progress'", action="progress",
                   now=now, guard_sql=" AND write_back = 'status'")


def _add_usage_to_settled_attempt(caller: Caller, todo_id: int, lease_id, report: dict,
                                  now) -> bool:
    """A ``complete`` or ``fail`` repeated by the lease that settled the todo, carrying usage
    (the runner's report of a run whose agent settled the todo itself): the usage goes to that
    attempt's settle event, the todo's sums and the day's spend, once. True when it was
    recorded; False when the row no longer names this lease as the one that settled it (the
    todo went back to the queue since, or was never settled by it) or the attempt already
    has a report. Nothing else changes, and ``max_cost_usd`` is not checked: the attempt is
    over. The event's guard decides: of two repeats racing, the second finds usage there.

    The row keeps the settling lease until the todo goes back to the queue (a done todo for
    good, a failed one until its retry or requeue), which is what ties the lease to the
    attempt: an event names a lease only by a hint, nothing an agent could present."""
    params = {"todo_id": todo_id, "lease_id": str(lease_id)}
    settled_by_lease = (f"id = %(todo_id)s AND {statements.visible_guard(caller, params)}"
                        " AND state IN ('done', 'failed') AND lease_id = %(lease_id)s")
    event_sql, todo_sql = usage.settled_usage_sql(params, settled_by_lease, report, now)
    if _is_postgres():
        spend = usage.spend_upsert_sql(report, "t")
        sql = (f"WITH e AS ({event_sql}), t AS ({todo_sql} AND id IN (SELECT todo_id FROM e)"
               " RETURNING id, endpoint_id)"
               + (f", s AS ({spend})" if spend else "") + " SELECT count(*) FROM t")
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchone()[0] == 1
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(event_sql, params)
        if cursor.fetchone() is None:
            return False
        cursor.execute(todo_sql, params)
        spend = usage.spend_upsert_sql(report, "todos_todo t WHERE t.id = %(todo_id)s")
        if spend:
            cursor.execute(spend, params)
    return True


# An override that ends the lease (complete, fail) takes the row out of the agent's hands: the
# lease it saw is cleared and the operator is recorded as the last holder, so the agent's retry
# is lease_lost (not already_done: the agent did not complete it).
_TAKE_OVER_SQL = ", lease_id = NULL, lease_owner = %(actor)s"


def heartbeat_todo(caller: Caller, todo_id, *, lease_id=None, lease_ttl_seconds=None, now=None,
                   overriding: HeldLease | None = None) -> Todo:
    """Extend the caller's lease. Fenced: refuses ``lease_lost`` unless the todo is claimed by
    this lease (``lease_id``) or, without one, by this caller, and that lease has not lapsed.

    With ``lease_ttl_seconds`` the lease expires at ``now + ttl`` and that ttl becomes the
    lease's length; without, it expires at ``now +`` the lease's own stored length (the ttl it
    was granted), so a heartbeat never shortens a lease the caller did not ask to shorten.
    ``overriding``: an operator extends an agent's lease (the agent keeps it).

    The same statement hands over the follow-ups (docs/work-control.md#threads) the lease has
    not been given yet: ``followups_given`` moves to ``followup_count``, and the returned row's
    ``prior_followups_given`` says where it stood, so the new ones are ``seq`` in
    (prior, followups_given]. The row is locked while the prior value is read, so two
    heartbeats of one lease never hand over the same follow-up.
    """
    now = now or timezone.now()
    if lease_ttl_seconds is None:
        params = {"default_ttl": dialect.db_duration(caller.endpoint.effective_lease)}
        # COALESCE: leases granted before the length was stored extend by the default.
        set_sql = "lease_expires_at = " + dialect.plus_duration(
            "now", "COALESCE(lease_ttl, %(default_ttl)s)")
    else:
        ttl = _lease_ttl(caller, lease_ttl_seconds)
        params = {"expires": dialect.db_time(now + ttl), "ttl": dialect.db_duration(ttl)}
        set_sql = "lease_expires_at = %(expires)s, lease_ttl = %(ttl)s"
    if overriding is None:
        # An operator's extension is not the holder hearing its follow-ups.
        set_sql += ", followups_given = followup_count"
    return _fenced(caller, todo_id, lease_id, set_sql=set_sql, params=params,
                   action_sql="'heartbeat'", action="heartbeat", now=now, overriding=overriding,
                   prior_column="followups_given" if overriding is None else "")


def cancel_held_todo(caller: Caller, todo_id, *, lease_id=None, reason=None, now=None) -> Todo:
    """The holder ends its own todo (the agent verb ``cancel``, docs/work-control.md#threads):
    claimed -> cancelled, ``cancelled_at = now``, the lease cleared, one ``cancel`` event with
    the optional ``reason`` and whether a cancel had been requested. Fenced like complete, so
    a cancel racing a complete (or the reaper) has one winner; it applies whether or not a
    cancel was requested. Refuses ``invalid_argument`` (a reason that is not a short string)
    and what a fenced verb refuses (``lease_lost``)."""
    now = now or timezone.now()
    detail = _reason_detail(reason)
    params = {}
    return _fenced(caller, todo_id, lease_id, set_sql=_CANCELLED_SET_SQL, params=params,
                   action_sql="'cancel'", action="cancel", now=now, detail=detail,
                   detail_sql_over_t=_requested_detail(params))


def _usage_report(usage_reported):
    try:
        return usage.validate_usage(usage_reported)
    except usage.UsageError as bad:
        raise Refusal("invalid_argument", str(bad)) from None


def complete_todo(caller: Caller, todo_id, *, lease_id=None, result=None, now=None,
                  overriding: HeldLease | None = None, usage_reported=None) -> Todo:
    """claimed -> done (terminal), storing ``result``. Fenced like heartbeat. The row keeps the
    completing lease, so the same lease completing again is told ``already_done`` (a retry
    after a lost answer), anyone else ``lease_lost``. Refuses ``invalid_argument`` for a result
    no database can store (NaN, NUL, …) or a usage report out of range
    (``usage.validate_usage``); ``usage_reported`` is added to the todo's and the day's sums."""
    now = now or timezone.now()
    report = _usage_report(usage_reported)
    _check_storable(result=result)
    params = {"result": json.dumps(result) if result is not None else None}
    set_sql = f"state = 'done', result = {dialect.jsonb('result')}, lease_expires_at = NULL"
    if overriding is not None:
        set_sql += _TAKE_OVER_SQL
    return _fenced(caller, todo_id, lease_id, params=params, action_sql="'complete'",
                   action="complete", set_sql=set_sql, now=now, overriding=overriding,
                   report=report)


def _retry_at_by_attempts(now) -> tuple[str, dict]:
    """A CASE over ``attempts`` giving now + 30 s * 2**(attempts-1), capped at 15 min."""
    params, branches = {}, []
    for attempt in range(1, _BACKOFF_STEPS):
        backoff = min(FIRST_RETRY_BACKOFF * 2 ** (attempt - 1), MAX_RETRY_BACKOFF)
        params[f"retry_{attempt}"] = dialect.db_time(now + backoff)
        branches.append(f"WHEN attempts <= {attempt} THEN %(retry_{attempt})s")
    params["retry_cap"] = dialect.db_time(now + MAX_RETRY_BACKOFF)
    return "CASE " + " ".join(branches) + " ELSE %(retry_cap)s END", params


def fail_todo(caller: Caller, todo_id, *, lease_id=None, error=None, result=None, now=None,
              overriding: HeldLease | None = None, usage_reported=None) -> Todo:
    """claimed -> failed. With attempts left, ``retry_at = now + backoff`` (30 s doubling, cap
    15 min); with attempts spent, or when this attempt's reported cost takes the todo past its
    ``max_cost_usd`` (else its endpoint's), a dead letter (``retry_at`` null,
    ``dead_lettered_at`` set; the event's detail says ``reason: max_cost_usd`` for the
    latter). Fenced like heartbeat."""
    now = now or timezone.now()
    if error is not None and not isinstance(error, str):
        raise Refusal("invalid_argument", "error must be a string")
    report = _usage_report(usage_reported)
    _check_storable(error=error, result=result)
    retry_case, params = _retry_at_by_attempts(now)
    params.update(error=error, result=json.dumps(result) if result is not None else None)
    spent = "attempts >= max_attempts"
    over_cost_sql = ""
    if report is not None:
        # In SET the columns hold the old row: the attempt's cost is added to compare.
        spent += " OR " + usage.over_max_cost_sql(caller.endpoint, params,
                                                  after=" + %(usage_cost)s")
        # The event says why, read from the updated row (its sums now include the attempt).
        params.update(over_cost_reason=json.dumps({"reason": "max_cost_usd"}), no_reason="{}")
        over_cost_sql = (f"CASE WHEN t.dead_lettered_at IS NOT NULL AND "
                         f"{usage.over_max_cost_sql(caller.endpoint, params)} "
                         f"THEN {dialect.jsonb('over_cost_reason')} "
                         f"ELSE {dialect.jsonb('no_reason')} END")
    set_sql = (
        f"state = 'failed', last_error = %(error)s, result = COALESCE({dialect.jsonb('result')}, result), "
        f"lease_expires_at = NULL, "
        f"dead_lettered_at = CASE WHEN {spent} THEN %(now)s ELSE NULL END, "
        f"retry_at = CASE WHEN {spent} THEN NULL ELSE {retry_case} END"
    )
    if overriding is not None:
        set_sql += _TAKE_OVER_SQL
    return _fenced(
        caller, todo_id, lease_id, set_sql=set_sql, params=params, action="fail", now=now,
        action_sql="CASE WHEN t.dead_lettered_at IS NULL THEN 'fail' ELSE 'dead_letter' END",
        detail={"error": error} if error else None, overriding=overriding, report=report,
        detail_sql_over_t=over_cost_sql,
    )


def release_todo(caller: Caller, todo_id, *, lease_id=None, now=None,
                 overriding: HeldLease | None = None) -> Todo:
    """claimed -> pending at once, refunding the attempt the claim counted; or, when a cancel
    was requested, claimed -> cancelled (``cancelled_at = now``, a ``cancel`` event with reason
    ``cancel_requested``), in the same guarded statement. Fenced; with ``overriding``, an
    operator frees an agent's (possibly stuck) lease."""
    now = now or timezone.now()
    # A todo asked to stop is not handed to the next agent (docs/work-control.md#threads).
    stop = "cancel_requested_at IS NOT NULL"
    set_sql = (
        f"state = CASE WHEN {stop} THEN 'cancelled' ELSE 'pending' END, "
        f"cancelled_at = CASE WHEN {stop} THEN %(now)s ELSE cancelled_at END, "
        "lease_id = NULL, lease_owner = NULL, lease_expires_at = NULL, "
        "lease_ttl = NULL, attempts = CASE WHEN attempts > 0 THEN attempts - 1 ELSE 0 END"
    )
    params = {"stopped_detail": json.dumps({"reason": "cancel_requested"}), "no_detail": "{}"}
    return _fenced(caller, todo_id, lease_id, set_sql=set_sql, params=params, now=now,
                   action_sql="CASE WHEN t.state = 'cancelled' THEN 'cancel' ELSE 'release' END",
                   action="release", overriding=overriding,
                   detail_sql_over_t=("CASE WHEN t.state = 'cancelled' THEN "
                                      f"{dialect.jsonb('stopped_detail')} "
                                      f"ELSE {dialect.jsonb('no_detail')} END"))


# -- humans --------------------------------------------------------------------------------------


def requeue_todo(caller: Caller, todo_id, *, now=None) -> Todo:
    """failed (waiting or dead) -> pending with a fresh attempt budget ("retry now").

    Refuses ``not_found``, ``not_claimable`` (not failed) and ``conflict`` when a dead letter's
    idempotency key has since been taken by a newer live todo.
    """
    now = now or timezone.now()
    todo_id = _todo_id(todo_id)
    params = {"todo_id": todo_id}
    where = statements.by_id(statements.visible_guard(caller, params) + " AND state = 'failed'")
    try:
        with transaction.atomic():
            todo = _one(statements.apply_transition(
                set_sql="state = 'pending', attempts = 0, retry_at = NULL, dead_lettered_at = NULL, "
                        "lease_id = NULL, lease_owner = NULL, lease_expires_at = NULL, "
                        "lease_ttl = NULL, ring_attempts = 0, last_ringed_at = NULL",
                where_sql=where, params=params, action_sql="'requeue'", from_state_sql="'failed'",
                actor=caller.actor, now=now, endpoint=caller.endpoint,
            ))
    except IntegrityError:
        raise Refusal("conflict", f"todo {todo_id}'s idempotency key is held by a newer live todo") from None
    if todo is None:
        todo_row = Todo.objects.filter(pk=todo_id, endpoint_id=caller.endpoint.pk).first()
        if todo_row is None or not caller.covers(todo_row.queue):
            raise Refusal("not_found", f"no todo {todo_id}")
        raise Refusal("not_claimable", f"todo {todo_id} is {todo_row.state}, not failed")
    _announce([todo], "requeue")
    return todo


def promote_todo(caller: Caller, todo_id, *, now=None) -> Todo:
    """The operator vouches for an unverified todo (docs/reference.md#trust): pending or
    awaiting approval and ``unverified`` -> trust ``operator``, in the same state, with a fresh
    ring budget, recorded as a ``promote`` event naming the operator (the actor). Announced as
    ready, so a pending one rings like a new todo and an endpoint that refuses unverified todos
    now hands it out; one awaiting approval stays gated (the doorbell rings only pending todos)
    until approved, which never changes trust itself.

    Refuses ``not_found`` (missing or invisible) and ``not_claimable`` (not pending or awaiting
    approval, or not unverified). Only operator surfaces (board, admin, API, command) call it.
    """
    return _operator_transition(
        caller, todo_id,
        guard="state IN ('awaiting_approval', 'pending') AND trust = 'unverified'",
        set_sql="trust = 'operator', ring_attempts = 0, last_ringed_at = NULL",
        action="promote", from_state_sql="t.state", detail={"from_trust": Trust.UNVERIFIED},
        now=now, wanted="only a pending or awaiting-approval unverified todo can be promoted")


def _operator_transition(caller: Caller, todo_id, *, guard: str, set_sql: str, action: str,
                         now, params=None, detail=None, from_state_sql: str = "'pending'",
                         wanted: str) -> Todo:
    """An operator's guarded change of the one todo ``todo_id`` (promote, priority, run now):
    the statement, its ``action`` event, the announcement. When ``guard`` (SQL over the row)
    does not hold: ``_wrong_state``'s refusal, ``wanted`` saying which todos it takes."""
    now = now or timezone.now()
    todo_id = _todo_id(todo_id)
    params = {**(params or {}), "todo_id": todo_id}
    todo = _one(statements.apply_transition(
        set_sql=set_sql, where_sql=statements.by_id(statements.visible_guard(caller, params) + f" AND {guard}"),
        params=params, action_sql=f"'{action}'", from_state_sql=from_state_sql,
        actor=caller.actor, now=now, detail=detail, endpoint=caller.endpoint,
    ))
    if todo is None:
        raise _wrong_state(caller, todo_id, wanted)
    _announce([todo], action)
    return todo


# -- work control: priority and scheduled todos (docs/work-control.md) ---------------------------


def check_priority(value, *, field: str = "priority") -> int:
    """``value`` as a priority, or ``invalid_argument`` naming ``field``: an integer (not a
    bool, not 1.0) from PRIORITY_MIN to PRIORITY_MAX."""
    if (isinstance(value, bool) or not isinstance(value, int)
            or not PRIORITY_MIN <= value <= PRIORITY_MAX):
        raise Refusal("invalid_argument", f"{field} must be an integer from {PRIORITY_MIN} to "
                                          f"{PRIORITY_MAX}, got {str(value)[:40]!r}")
    return value


def resolve_not_before(*, not_before=None, delay_seconds=None, now):
    """When a new todo becomes ready, from a hand-over's ``not_before`` (ISO-8601 text with a
    time zone, or an aware datetime) or ``delay_seconds`` (0 … 30 days): the time, or None for
    at once. Refuses ``invalid_argument`` naming the field: both given, not a time or a number,
    more than MAX_SCHEDULE_AHEAD ahead, or a ``not_before`` more than
    NOT_BEFORE_PAST_TOLERANCE in the past (a mistake, not "run at once"). A time already come
    is None: the todo is ready at once, like any new one."""
    if not_before is not None and delay_seconds is not None:
        raise Refusal("invalid_argument", "not_before, delay_seconds: give one of them, not both")
    if delay_seconds is not None:
        limit = MAX_SCHEDULE_AHEAD.total_seconds()
        if (isinstance(delay_seconds, bool) or not isinstance(delay_seconds, (int, float))
                or not 0 <= delay_seconds <= limit):
            raise Refusal("invalid_argument", f"delay_seconds must be a number of seconds from 0 "
                                              f"to {int(limit)}")
        return now + timedelta(seconds=delay_seconds) if delay_seconds > 0 else None
    if not_before is None:
        return None
    when = not_before
    if isinstance(not_before, str):
        try:
            when = datetime.fromisoformat(not_before)
        except ValueError:
            when = None
    if not isinstance(when, datetime) or when.tzinfo is None:
        raise Refusal("invalid_argument",
                      "not_before must be an ISO-8601 time with a time zone, "
                      "such as YYYY-MM-DDTHH:MM:SSZ")
    if when < now - NOT_BEFORE_PAST_TOLERANCE:
        raise Refusal("invalid_argument", "not_before is in the past (more than a minute ago)")
    if when > now + MAX_SCHEDULE_AHEAD:
        raise Refusal("invalid_argument", f"not_before is more than "
                                          f"{MAX_SCHEDULE_AHEAD.days} days ahead")
    return when if when > now else None


def set_priority_todo(caller: Caller, todo_id, priority, *, now=None) -> Todo:
    """An operator changes the priority of a todo that waits: awaiting approval, pending
    (scheduled or not) or failed (waiting to retry, or dead, for when it is requeued). One
    ``prioritize`` event,
    its detail the new priority. Refuses ``invalid_argument`` (``check_priority``), ``not_found``
    and ``not_claimable`` (claimed or done: nothing waits to be ordered)."""
    check_priority(priority)
    return _operator_transition(
        caller, todo_id, guard="state IN ('awaiting_approval', 'pending', 'failed')",
        set_sql="priority = %(priority)s", params={"priority": priority}, action="prioritize",
        from_state_sql="t.state", detail={"priority": priority}, now=now,
        wanted="only a waiting todo's priority can change (awaiting approval, pending or "
               "failed)")


# A todo that becomes ready after waiting for its time starts with a fresh ring budget and no
# ring on record, as a new todo does: its doorbell and the heartbeat's backoff count from now.
_BECOMES_READY_SQL = "not_before = NULL, ring_attempts = 0, last_ringed_at = NULL"


def run_now_todo(caller: Caller, todo_id, *, now=None) -> Todo:
    """An operator runs a scheduled todo now: pending with ``not_before`` -> ready (cleared),
    announced as ready (doorbell, long-poll wake-up). One ``run_now`` event naming the
    operator. Refuses ``not_found`` and ``not_claimable`` (not a scheduled pending todo)."""
    return _operator_transition(
        caller, todo_id, guard="state = 'pending' AND not_before IS NOT NULL",
        set_sql=_BECOMES_READY_SQL, action="run_now", now=now,
        wanted="only a scheduled pending todo can run now")


# -- work control: cancel and the approval gate --------------------------------------------------


MAX_REASON_CHARS = 500


def _reason_detail(reason) -> dict:
    if reason is None:
        return {}
    if not isinstance(reason, str):
        raise Refusal("invalid_argument", "reason must be a string")
    reason = " ".join(reason.split())
    if len(reason) > MAX_REASON_CHARS:
        raise Refusal("invalid_argument", f"reason must be at most {MAX_REASON_CHARS} characters")
    _check_storable(reason=reason)
    return {"reason": reason} if reason else {}


def _operator_only(caller: Caller, verb: str) -> None:
    if not caller.is_operator:
        raise Refusal("verb_not_allowed", f"{verb} is for the endpoint's operator")


def _wrong_state(caller: Caller, todo_id: int, wanted: str) -> Refusal:
    """After an operator verb's guard missed: ``not_found`` for a todo the caller cannot see,
    else ``not_claimable`` naming the todo, its state and trust (promote turns on trust, not
    state) and which todos the verb takes (``wanted``): the operator API's 409."""
    todo = Todo.objects.filter(pk=todo_id, endpoint_id=caller.endpoint.pk).only(
        "state", "queue", "trust").first()
    if todo is None or not caller.covers(todo.queue):
        return Refusal("not_found", f"no todo {todo_id}")
    return Refusal("not_claimable",
                   f"todo {todo_id} is {todo.state}; {wanted} (its trust: {todo.trust})")


def _requested_detail(params: dict) -> str:
    """The holder's cancel's event detail over the updated row ``t``: that its holder ended it
    (the living status names no session id) and whether a cancel was requested."""
    params.update(requested_detail=json.dumps({"by_holder": True, "cancel_requested": True}),
                  no_detail=json.dumps({"by_holder": True}))
    return (f"CASE WHEN t.cancel_requested_at IS NOT NULL THEN {dialect.jsonb('requested_detail')}"
            f" ELSE {dialect.jsonb('no_detail')} END")


_CANCELLED_SET_SQL = (
    "state = 'cancelled', cancelled_at = %(now)s, lease_id = NULL, lease_owner = NULL, "
    "lease_expires_at = NULL, lease_ttl = NULL, retry_at = NULL"
)


def cancel_todo(caller: Caller, todo_id, *, reason=None, now=None) -> Todo:
    """awaiting_approval, pending, failed (waiting or dead) or claimed -> cancelled (terminal),
    ``cancelled_at = now``, the operator and the optional ``reason`` in its ``cancel`` event.

    Cancelling a claimed todo overrides the agent's lease (the event says ``override`` and
    names the lease): the lease is cleared in the same statement, so the agent's next fenced
    call is ``lease_lost``, and a complete racing the cancel either commits first (the cancel
    then finds it done) or finds it cancelled; one of them wins. The todo's operator secrets
    are deleted in the statement, and its idempotency key is free (cancelled is not live).

    Refuses ``not_found`` (missing or not the operator's), ``not_claimable`` (already done
    or cancelled), ``invalid_argument`` (a reason that is not a short string),
    ``verb_not_allowed`` (not an operator).
    """
    now = now or timezone.now()
    _operator_only(caller, "cancel")
    detail = _reason_detail(reason)
    todo_id = _todo_id(todo_id)
    params = {"todo_id": todo_id}
    where = statements.by_id(statements.visible_guard(caller, params)
                   + " AND state IN ('awaiting_approval', 'pending', 'failed', 'claimed')")
    todo = _one(statements.apply_transition(
        set_sql=_CANCELLED_SET_SQL, where_sql=where, params=params, action_sql="'cancel'",
        from_state_sql="", actor=caller.actor, now=now, detail=detail, endpoint=caller.endpoint,
        from_prior=True,
    ))
    if todo is None:
        raise _wrong_state(caller, todo_id, "only awaiting_approval, pending, failed or claimed "
                                            "todos can be cancelled")
    _announce([todo], "cancel")
    return todo


def approve_todo(caller: Caller, todo_id, *, now=None) -> Todo:
    """awaiting_approval -> pending, ready exactly as a new todo (announced ``approve``: rung,
    long polls woken), with a fresh ring budget; the ``approve`` event names the approver. The
    todo keeps its trust: the yes lets agents take it, it does not vouch for its sender
    (raising ``unverified`` is ``promote_todo``, a separate operator action).

    Refuses ``not_found``, ``not_claimable`` (not awaiting approval), ``verb_not_allowed``.
    """
    now = now or timezone.now()
    _operator_only(caller, "approve")
    todo_id = _todo_id(todo_id)
    params = {"todo_id": todo_id}
    where = statements.by_id(statements.visible_guard(caller, params)
                             + " AND state = 'awaiting_approval'")
    todo = _one(statements.apply_transition(
        set_sql="state = 'pending', ring_attempts = 0, last_ringed_at = NULL",
        where_sql=where, params=params, action_sql="'approve'",
        from_state_sql="'awaiting_approval'", actor=caller.actor, now=now,
        endpoint=caller.endpoint,
    ))
    if todo is None:
        raise _wrong_state(caller, todo_id, "only a todo awaiting approval can be approved")
    _announce([todo], "approve")
    return todo


def reject_todo(caller: Caller, todo_id, *, reason=None, now=None) -> Todo:
    """awaiting_approval -> cancelled, as ``cancel_todo`` does, recorded as ``reject`` with
    the optional ``reason``. Refuses as ``approve_todo`` does (and a bad ``reason``)."""
    now = now or timezone.now()
    _operator_only(caller, "reject")
    detail = _reason_detail(reason)
    todo_id = _todo_id(todo_id)
    params = {"todo_id": todo_id}
    where = statements.by_id(statements.visible_guard(caller, params) + " AND state = 'awaiting_approval'")
    todo = _one(statements.apply_transition(
        set_sql=_CANCELLED_SET_SQL, where_sql=where, params=params, action_sql="'reject'",
        from_state_sql="'awaiting_approval'", actor=caller.actor, now=now, detail=detail,
        endpoint=caller.endpoint,
    ))
    if todo is None:
        raise _wrong_state(caller, todo_id, "only a todo awaiting approval can be rejected")
    _announce([todo], "reject")
    return todo


# -- threads: follow-ups and stops (docs/work-control.md#threads) --------------------------------


def add_followup(todo_id, *, delivery_event, kind: str, title: str, actor: str, trust: str,
                 payload, now, event_actor: str | None = None,
                 payload_storable: bool = False) -> FollowUp | None:
    """Fold a delivery into the live todo ``todo_id`` as its next follow-up: ONE guarded
    statement counts it (``followup_count + 1``, only while the todo is live for its thread:
    not ended, no stop requested) and inserts the FollowUp with that count as its seq, records
    a ``followup`` event (state unchanged; actor ``event_actor``, else ``actor``) and, when the
    todo's source hears of it (``write_back`` not off), an outbox entry ``followup``.
    Announced ``followup`` after commit: a claimed todo's holder is rung.

    Returns the FollowUp, or None when the todo is no longer live for its thread (ended, or
    asked to stop, since the caller found it): the caller makes a todo instead. Concurrent
    follow-ups of one todo queue on its row lock, so their seqs run 1, 2, 3 … without gaps.
    Refuses ``invalid_argument`` for text no database can store."""
    todo_id = _todo_id(todo_id)
    title = " ".join(str(title).split())[:MAX_TITLE_CHARS] or "(untitled)"
    kind, actor = (kind or "")[:200], (actor or "")[:200]
    _check_storable(title=title, kind=kind, actor=actor,
                    **({} if payload_storable else {"payload": payload}))
    params = {
        "todo_id": todo_id, "delivery_event_id": getattr(delivery_event, "pk", delivery_event),
        "kind": kind, "title": title, "followup_actor": actor, "trust": trust,
        "payload": json.dumps(payload if payload is not None else {}),
    }
    with transaction.atomic():
        todo = _one(statements.apply_transition(
            set_sql="followup_count = followup_count + 1",
            where_sql=f"id = %(todo_id)s AND {statements.LIVE_FOR_THREAD_SQL}", params=params,
            action_sql="'followup'", from_state_sql="t.state", actor=event_actor or actor,
            now=now, detail={"delivery_event": params["delivery_event_id"]},
            also=statements.insert_followup_sql, outbox_where="t.write_back <> 'off'"))
        if todo is None:
            return None
        followup = FollowUp.objects.get(todo_id=todo_id, seq=todo.followup_count)
    followup.todo = todo
    _announce([todo], "followup")
    return followup


def request_cancel(todo_id, *, actor: str, reason=None, now=None, endpoint=None) -> Todo:
    """Ask the holder of a claimed todo to stop: ``cancel_requested_at = now`` (guarded:
    claimed, not yet requested), one ``cancel_request`` event (claimed -> claimed, the
    ``reason`` in its detail), announced ``cancel_requested`` after commit, which rings the
    holder's session. The todo stays claimed: its holder ends it (cancel, or complete when the
    work is done), and a lapse of its lease cancels it. A todo already asked is returned as it
    is (nothing recorded twice). ``endpoint``: only a todo of that endpoint (an operator's).

    Refuses ``not_found``, ``already_done`` (done or cancelled), ``not_claimable`` (no agent
    holds it: cancel it instead), ``invalid_argument`` (a bad ``reason``)."""
    now = now or timezone.now()
    detail = _reason_detail(reason)
    todo_id = _todo_id(todo_id)
    params = {"todo_id": todo_id}
    guard = "state = 'claimed' AND cancel_requested_at IS NULL"
    if endpoint is not None:
        params["endpoint_id"] = endpoint.pk
        guard += " AND endpoint_id = %(endpoint_id)s"
    todo = _one(statements.apply_transition(
        set_sql="cancel_requested_at = %(now)s", where_sql=statements.by_id(guard),
        params=params, action_sql="'cancel_request'", from_state_sql="'claimed'", actor=actor,
        now=now, detail=detail, endpoint=endpoint))
    if todo is not None:
        _announce([todo], "cancel_requested")
        return todo
    todo = Todo.objects.filter(pk=todo_id).first()
    if todo is None or (endpoint is not None and todo.endpoint_id != endpoint.pk):
        raise Refusal("not_found", f"no todo {todo_id}")
    if todo.state == State.CLAIMED and todo.cancel_requested_at is not None:
        return todo
    if todo.state in (State.DONE, State.CANCELLED):
        raise Refusal("already_done", f"todo {todo_id} is already {todo.state}")
    raise Refusal("not_claimable", f"todo {todo_id} is {todo.state}: no agent holds it, "
                                   "so cancel it instead of asking")


def stop_thread(endpoint_id: int, thread: str, *, webhook_id: int, actor: str,
                now=None) -> list[str]:
    """The source ended ``thread``: each live todo of the endpoint on that thread that came
    from a delivery of ``webhook_id`` (whatever its route's follow-up policy) stops. One no
    agent holds is cancelled (a ``cancel`` event, reason ``source_closed``, ``actor`` the
    sender); a held one is asked to stop (``request_cancel``). Each todo is its own guarded
    statement, so one claimed between the lookup and its cancel is asked instead. Returns
    the ids stopped, held ones included; call it inside the delivery's transaction."""
    now = now or timezone.now()
    ids = list(Todo.objects.filter(
        LIVE_FOR_IDEMPOTENCY, endpoint_id=endpoint_id, thread=thread,
        delivery_event__webhook_id=webhook_id).order_by("pk").values_list("pk", flat=True))
    stopped = []
    for todo_id in ids:
        params = {"todo_id": todo_id}
        cancelled = _one(statements.apply_transition(
            set_sql=_CANCELLED_SET_SQL,
            where_sql=f"id = %(todo_id)s AND {statements.UNHELD_LIVE_SQL}", params=params,
            action_sql="'cancel'", from_state_sql="", actor=actor, now=now,
            detail={"reason": SOURCE_CLOSED}, from_prior=True))
        if cancelled is not None:
            _announce([cancelled], "cancel")
            stopped.append(str(todo_id))
            continue
        try:
            request_cancel(todo_id, actor=actor, reason=SOURCE_CLOSED, now=now)
        except Refusal:
            continue  # it ended meanwhile
        stopped.append(str(todo_id))
    return stopped


# The cancel reason of a todo its source stopped (the issue or pull request closed).
SOURCE_CLOSED = "source_closed"


# -- sweeps' transitions (called by todos/sweeps.py; their batches: todos.statements) ----------


def release_due_scheduled(*, now, limit: int) -> list[Todo]:
    """Scheduled todos whose ``not_before <= now`` become ready: ``not_before`` cleared, one
    ``due`` event each, announced as ready exactly like a new todo (doorbell, long-poll
    wake-up). At most ``limit`` rows, skipping rows another sweep (or an operator's run now)
    holds; the UPDATE re-checks the guard, so a row is released once."""
    todos = statements.apply_transition(
        set_sql=_BECOMES_READY_SQL,
        where_sql=(f"id IN ({statements.due_scheduled_sql()}) AND state = 'pending'"
                   " AND not_before <= %(now)s"),
        params={"limit": limit}, action_sql="'due'", from_state_sql="'pending'",
        actor="scheduler", now=now,
    )
    _announce(todos, "due")
    return todos


def return_lapsed_leases(*, now, limit: int) -> list[Todo]:
    """claimed with ``lease_expires_at <= now`` -> pending, or -> failed as a dead letter when its
    attempts are spent, or -> cancelled (a ``cancel`` event, reason ``cancel_requested``,
    never retried) when a cancel was requested. At most ``limit`` rows; rows another sweep
    holds are skipped, so two overlapping reapers split the work instead of waiting on each
    other."""
    # A todo asked to stop (docs/work-control.md#threads) is cancelled instead: its source is
    # closed, or its operator wants it ended, so no one should take it up again.
    stop = "cancel_requested_at IS NOT NULL"
    spent = f"NOT ({stop}) AND attempts >= max_attempts"
    params = {"limit": limit, "stopped_detail": json.dumps({"reason": "cancel_requested"}),
              "no_detail": "{}"}
    todos = statements.apply_transition(
        set_sql=(
            f"state = CASE WHEN {stop} THEN 'cancelled' WHEN {spent} THEN 'failed'"
            " ELSE 'pending' END, "
            f"cancelled_at = CASE WHEN {stop} THEN %(now)s ELSE cancelled_at END, "
            f"dead_lettered_at = CASE WHEN {spent} THEN %(now)s ELSE NULL END, "
            "last_error = CASE WHEN " + spent + " THEN 'lease lapsed on the last attempt' "
            "ELSE last_error END, lease_id = NULL, lease_owner = NULL, lease_expires_at = NULL, "
            "lease_ttl = NULL, retry_at = NULL"
        ),
        where_sql=f"id IN ({statements.lapsed_leases_sql()}) AND state = 'claimed' AND lease_expires_at <= %(now)s",
        params=params,
        action_sql="CASE WHEN t.state = 'cancelled' THEN 'cancel' ELSE 'lease_lapsed' END",
        from_state_sql="'claimed'", actor="reaper", now=now,
        detail_sql_over_t=("CASE WHEN t.state = 'cancelled' THEN "
                           f"{dialect.jsonb('stopped_detail')} ELSE {dialect.jsonb('no_detail')}"
                           " END"),
    )
    for todo in todos:
        publish.publish_on_commit(todo, "cancel" if todo.state == State.CANCELLED
                                  else "lease_lapsed")
    return todos


def cancel_stale_approvals(*, now, limit: int) -> list[Todo]:
    """awaiting_approval for longer than the endpoint's ``approval_timeout_seconds`` ->
    cancelled, as ``cancel_todo`` does, each with a ``cancel`` event of actor
    ``approval-timeout`` and reason ``approval_timeout``. At most ``limit`` rows, skipping rows
    another sweep (or an operator's approve) holds; the outer guard re-checks the state."""
    todos = statements.apply_transition(
        set_sql=_CANCELLED_SET_SQL,
        where_sql=f"id IN ({statements.stale_approvals_sql()}) AND state = 'awaiting_approval'",
        params={"limit": limit}, action_sql="'cancel'", from_state_sql="'awaiting_approval'",
        actor="approval-timeout", now=now, detail={"reason": "approval_timeout"},
    )
    _announce(todos, "cancel")
    return todos


def promote_due_retries(*, now, limit: int) -> list[Todo]:
    """failed with ``retry_at <= now`` -> pending (dead letters have no retry_at). At most
    ``limit`` rows, skipping rows another sweep holds."""
    todos = statements.apply_transition(
        set_sql="state = 'pending', retry_at = NULL, lease_id = NULL, lease_owner = NULL",
        where_sql=f"id IN ({statements.due_retries_sql()}) AND state = 'failed' AND retry_at <= %(now)s",
        params={"limit": limit}, action_sql="'retry'", from_state_sql="'failed'",
        actor="retry-promoter", now=now,
    )
    _announce(todos, "retry")
    return todos


# -- the outbox (docs/write-back.md#the-outbox) -------------------------------------------------


def take_outbox_entries(*, limit: int) -> list[tuple]:
    """Delete and return up to ``limit`` outbox entries, oldest first, as ``(todo_id,
    action)``: the caller (ingest's write-back worker) records them in the same transaction, so an
    entry is taken exactly when what it caused is kept. Entries another taker holds are
    skipped (PostgreSQL), so overlapping workers split them."""
    return statements.take_outbox_entries(limit=limit)


def refuses_unverified(endpoint) -> bool:
    """Whether claim_next withholds ``trust: unverified`` todos from this endpoint's agents
    (``accept_unverified`` off): ``Caller.agent`` and the digest's count both ask here."""
    return not endpoint.accept_unverified




# -- todo tokens (docs/security.md#the-todo-token) ---------------------------------------------

# A sweep pass records at most this many ended tokens: far more than leases end in its interval
# on any fleet, and one short statement.
ENDED_TOKENS_BATCH = 500


def issue_todo_token(todo: Todo, *, now=None) -> str:
    """Mint a todo token for ``todo``'s current lease and store its digest. One guarded INSERT
    that copies the lease from the todo row, so a token is never issued for a lease that ended
    in the meantime: then nothing is stored and the answer is "" (the claim's answer says the
    lease is gone on its next call anyway)."""
    now = now or timezone.now()
    token = TODO_TOKEN_PREFIX + secrets.token_urlsafe(32)
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO todos_todotoken (todo_id, endpoint_id, lease_id, digest, issued_at)"
            " SELECT id, endpoint_id, lease_id, %s, %s FROM todos_todo"
            " WHERE id = %s AND state = 'claimed' AND lease_id = %s RETURNING id",
            [hash_credential(token), now, todo.pk, todo.lease_id])
        issued = cursor.fetchone()
    return token if issued else ""


def record_ended_todo_tokens(*, now=None, limit: int = ENDED_TOKENS_BATCH) -> list[int]:
    """Stamp ``revoked_at`` on at most ``limit`` todo tokens whose lease has ended (the token
    already stopped working then: ``queries.todo_token_live_sql`` is checked at every use) and
    end the MCP sessions they opened. Rows another run holds are skipped, so overlapping runs
    split the work. Returns the ids of the tokens it stamped."""
    now = now or timezone.now()
    live = queries.todo_token_live_sql("k2", "t", now_param="now")
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE todos_todotoken SET revoked_at = %(now)s WHERE revoked_at IS NULL AND id IN ("
            " SELECT k2.id FROM todos_todotoken k2 WHERE k2.revoked_at IS NULL"
            f" AND NOT EXISTS (SELECT 1 FROM todos_todo t WHERE {live})"
            f" ORDER BY k2.issued_at LIMIT %(limit)s{dialect.skip_locked('k2')}) RETURNING id",
            {"now": now, "limit": limit})
        ended = [row[0] for row in cursor.fetchall()]
    if ended:
        session_transitions.end_todo_token_sessions(token_ids=ended, now=now)
    return ended
