"""The outbox of write-backs (docs/write-back.md#the-outbox): what switchboard writes back to a
todo's source, and the worker that sends it.

A todo transition writes an outbox entry in its own statement (``todos.models.OutboxEntry``),
so an entry exists exactly when its transition committed. After the commit, the transition's
announcement wakes the worker (``on_todo_change``): a Celery task in production, the embedded
scheduler's sweep otherwise; the same sweep runs every few seconds for anything a lost wake-up
left behind (a crash between commit and send). The worker:

1. takes entries into ``WriteBack`` rows in one transaction (``absorb_outbox_entries``): one
   ``ack`` per todo and one living ``status`` (and, where the source has them, one ``check``
   run), whose ``wanted`` counts the changes asked for, and one ``followup`` ack per follow-up
   folded into the todo;
2. claims one due row at a time with a guarded statement (``claim_due_write_back``): never a
   todo's status or check before its ack, never two sends of one todo at once, nothing of a
   connection the source asked to wait (a rate limit's ``Retry-After``: ``hold_connection``);
3. sends it with no transaction open (a source that hangs holds no lock), rendering the status
   from the todo as it is at that moment, so changes that arrived meanwhile collapse into the
   one edit; and records the answer with a guarded statement fenced by the attempt it claimed
   (``finish_write_back``). Retryable failures wait (the source's ``Retry-After`` or rate-limit
   reset, else a doubling backoff) for up to ``RETRY_FOR``, then the row is ``abandoned``; any
   other refusal is ``failed`` with the source's message. The same statement's transaction
   counts the outcome (and an ack's latency) for /metrics (``WriteBackTally``).

None of this runs inside a transition: a source that is down costs the worker time, never a
transition or an ingest.
"""

import json
import logging
import threading
import time
from datetime import timedelta

from celery.exceptions import CeleryError
from django.conf import settings
from django.db import connection as db, transaction
from django.db.models import Case, F, Q, Value, When
from django.utils import timezone
from kombu.exceptions import KombuError

from switchboard import schedule, tracing
from switchboard.db import sql as dialect
from switchboard.db import statements as db_statements
from todos import transitions as todo_transitions
from todos.models import SILENT_TO_SOURCE, FollowUp, Todo, WriteBack as WriteBackLevel

from . import connections, outbound, senders, status_text
from .models import Connection, WriteBack, WriteBackAction, WriteBackState, WriteBackTally

log = logging.getLogger("switchboard.write_back")

# The sweep's entry in switchboard/schedule.py, which a wake-up names.
SWEEP_NAME = "send-write-backs"
# Entries taken per transaction: enough for a burst of transitions, short enough that the
# transaction holding their rows stays brief.
ABSORB_BATCH = 500
# Sends per sweep run: each may wait up to the request timeout on a source that hangs, so a
# run stays within a few minutes at worst while a healthy source clears hundreds a minute.
SEND_BATCH = 50
# How long a claimed send is its worker's: past it, a worker that died mid-send has its row
# sent again (the status then looks for its marker first, so it is not posted twice).
SEND_LEASE = timedelta(seconds=60)
RETRY_FOR = timedelta(hours=24)
FIRST_BACKOFF = timedelta(seconds=5)
MAX_BACKOFF = timedelta(minutes=10)
# An agent's progress lines edit the status at most this often; the latest line wins.
PROGRESS_EDIT_INTERVAL = timedelta(seconds=10)
# What of a source's refusal a write-back keeps as its last error.
MAX_ERROR_CHARS = 500
# The ack latency histogram's buckets, in seconds (docs/operating.md#metrics): the goal is
# under a second after the delivery's 202, the promise within 5 s.
ACK_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# Each bucket as the tally and /metrics name it ("le"), the last one unbounded.
ACK_SECONDS_LABELS = tuple(f"{bound:g}" for bound in ACK_SECONDS_BUCKETS) + ("+Inf",)


# -- after commit: wake the worker ---------------------------------------------------------------

# A process enqueues the send task at most once per this long: commits that come meanwhile
# share the next task, which sends everything due (a burst of transitions is one task, not one
# each), at the cost of this much latency (the board's batch window, for the same reason).
ENQUEUE_COALESCE_SECONDS = 0.05


def on_todo_change(todo, change: dict) -> None:
    """The bus listener (``ingest.apps``): after a transition of a todo whose source hears of
    it committed, wake the sender. Nothing for the others, which is nearly every todo."""
    level, action = getattr(todo, "write_back", WriteBackLevel.OFF), change["action"]
    if (level == WriteBackLevel.STATUS and action not in SILENT_TO_SOURCE) or (
            level == WriteBackLevel.ACK and action in ("create", WriteBackAction.FOLLOWUP)):
        dispatch_send()


def dispatch_send() -> None:
    """Have the outbox sent soon: the embedded scheduler's sweep woken at once, or (with a
    database server, where Celery runs the sweeps) the send task enqueued. Never waits on
    Redis: the enqueue happens on a thread of its own (``_task_kicker``), and commits that
    come while one is under way share the next."""
    if settings.EMBEDDED:
        schedule.wake(SWEEP_NAME)
    else:
        _task_kicker.kick()


class _TaskKicker:
    """Enqueues ``tasks.send_write_backs`` from one daemon thread per process, so a transition's
    after-commit callback only sets an event (the bus's own sends are handed off the same way,
    channels_push/bus/publish.py). An enqueue that fails is logged: the periodic sweep sends
    what it would have, a few seconds later."""

    def __init__(self):
        self._wanted = threading.Event()
        self._lock = threading.Lock()
        self._thread = None

    def kick(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="switchboard-write-back-kicker")
                self._thread.start()
        self._wanted.set()

    def _run(self) -> None:
        from . import tasks

        while True:
            self._wanted.wait()
            self._wanted.clear()
            try:
                tasks.send_write_backs.apply_async(retry=False)
            except (CeleryError, KombuError, OSError):
                log.warning("could not enqueue the write-back task; the sweep will send it")
            time.sleep(ENQUEUE_COALESCE_SECONDS)


_task_kicker = _TaskKicker()


# -- 1. entries into write-backs ----------------------------------------------------------------

_TABLE = WriteBack._meta.db_table
_CONNECTIONS = Connection._meta.db_table
_INSERT_COLUMNS = ("todo_id, connection_id, action, followup_seq, target, target_label, state,"
                   " wanted, sent, attempts, next_attempt_at, last_error, external_id, created_at")
# Due now, or when its connection's hold ends (hold_connection): a row made during a hold
# waits with the others rather than being walked past by every claim until then.
_DUE_FROM = (f"COALESCE((SELECT c.held_until FROM {_CONNECTIONS} c"
             " WHERE c.id = %(connection_id)s AND c.held_until > %(now)s), %(now)s)")
_INSERT_VALUES = (f"%(todo_id)s, %(connection_id)s, %(action)s, %(seq)s, {dialect.jsonb('target')},"
                  f" %(label)s, 'pending', %(wanted)s, 0, 0, {_DUE_FROM}, '', '', %(now)s")
# A change to a status already sent (or given up on after a long outage) makes it due again,
# with a fresh retry budget; one waiting or being sent just counts the change; one the source
# refused (failed) stays so until an operator retries it.
_REARM = f"{_TABLE}.state IN ('sent', 'abandoned')"
_UPSERT_STATUS_SQL = (
    f"INSERT INTO {_TABLE} ({_INSERT_COLUMNS}) VALUES ({_INSERT_VALUES})"
    " ON CONFLICT (todo_id, action, followup_seq) DO UPDATE SET"
    f" wanted = {_TABLE}.wanted + EXCLUDED.wanted,"
    f" state = CASE WHEN {_REARM} THEN 'pending' ELSE {_TABLE}.state END,"
    f" next_attempt_at = CASE WHEN {_REARM} THEN EXCLUDED.next_attempt_at"
    f" ELSE {_TABLE}.next_attempt_at END,"
    f" attempts = CASE WHEN {_REARM} THEN 0 ELSE {_TABLE}.attempts END,"
    f" failing_since = CASE WHEN {_REARM} THEN NULL ELSE {_TABLE}.failing_since END"
)
_INSERT_ACK_SQL = (f"INSERT INTO {_TABLE} ({_INSERT_COLUMNS}) VALUES ({_INSERT_VALUES})"
                   " ON CONFLICT (todo_id, action, followup_seq) DO NOTHING")
# A follow-up's news for a status already made: counted as a change, never a status of its
# own before the todo's first transition (which makes it).
_BUMP_STATUS_SQL = (
    f"UPDATE {_TABLE} SET wanted = wanted + %(wanted)s,"
    f" state = CASE WHEN {_REARM} THEN 'pending' ELSE state END,"
    f" next_attempt_at = CASE WHEN {_REARM} THEN {_DUE_FROM} ELSE next_attempt_at END,"
    f" attempts = CASE WHEN {_REARM} THEN 0 ELSE attempts END,"
    f" failing_since = CASE WHEN {_REARM} THEN NULL ELSE failing_since END"
    " WHERE todo_id = %(todo_id)s AND action IN ('status', 'check')"
)


def absorb_outbox_entries(*, now, limit: int = ABSORB_BATCH) -> int:
    """Take up to ``limit`` outbox entries into write-backs, in one transaction: a ``create``
    makes the todo's ``ack``, every later change counts toward its ``status`` and, where the
    client writes one for this connection and target (a GitHub App on a pull request), its
    ``check`` run. A ``followup`` makes the ack of each follow-up not acked yet (``_absorb_
    followups``) and counts toward a status already made. A todo whose webhook has no
    connection now, or whose delivery has nothing to write back on (a push), is dropped.
    Returns how many entries were taken."""
    with transaction.atomic():
        entries = todo_transitions.take_outbox_entries(limit=limit)
        if not entries:
            return 0
        changes, transitions_seen, followed = {}, set(), {}
        for todo_id, action in entries:
            counts = changes.setdefault(todo_id, {WriteBackAction.ACK: 0,
                                                  WriteBackAction.STATUS: 0})
            if action == WriteBackAction.FOLLOWUP:
                followed[todo_id] = followed.get(todo_id, 0) + 1
                continue
            counts[WriteBackAction.ACK if action == "create" else WriteBackAction.STATUS] += 1
            if action != "progress":
                transitions_seen.add(todo_id)
        todos = (Todo.objects.filter(pk__in=changes)
                 .select_related("delivery_event__webhook__connection")
                 .only("id", "kind", "payload", "write_back", "delivery_event__webhook__source",
                       "delivery_event__webhook__connection__id",
                       "delivery_event__webhook__connection__kind"))
        with db.cursor() as cursor:
            for todo in todos:
                webhook = todo.delivery_event.webhook if todo.delivery_event else None
                client = _client_of(webhook)
                found = client.find_target(todo.kind, todo.payload) if client else None
                if found is None:
                    continue
                target, label = found
                if client.wants_check_run and client.wants_check_run(webhook.connection, target):
                    changes[todo.pk][WriteBackAction.CHECK] = changes[todo.pk][
                        WriteBackAction.STATUS]
                for action, count in changes[todo.pk].items():
                    if count:
                        cursor.execute(
                            _INSERT_ACK_SQL if action == WriteBackAction.ACK
                            else _UPSERT_STATUS_SQL,
                            {"todo_id": todo.pk, "connection_id": webhook.connection.pk,
                             "action": action, "seq": 0, "target": json.dumps(target),
                             "label": label[:300], "wanted": count, "now": dialect.db_time(now)})
                if changes[todo.pk][WriteBackAction.STATUS] and todo.pk not in transitions_seen:
                    _space_progress_edits(todo.pk)
                if todo.pk in followed:
                    _absorb_followups(cursor, todo, client, webhook.connection, target,
                                      followed[todo.pk], now=now)
    return len(entries)


# Target fields that say where a reaction goes no more than the rest do: two targets equal
# without them are one object.
_NOT_THE_OBJECT = ("head_sha", "installation")


def _same_object(one: dict, other: dict) -> bool:
    return ({key: value for key, value in one.items() if key not in _NOT_THE_OBJECT}
            == {key: value for key, value in other.items() if key not in _NOT_THE_OBJECT})


def _absorb_followups(cursor, todo, client, connection, todo_target, entries: int, *, now):
    """The ``followup`` ack of each of ``todo``'s follow-ups that has none yet (the comment,
    note, message or prompt it came from, as the client's ``find_target`` reads the
    follow-up's own payload), and ``entries`` changes for its status and check run, if made.
    A follow-up about the todo's own object (an edit of the issue, a push to the pull request,
    a review, which GitHub gives no reactions) gets none: that object has the todo's ack."""
    done = WriteBack.objects.filter(todo_id=todo.pk, action=WriteBackAction.FOLLOWUP)
    last = max(done.values_list("followup_seq", flat=True), default=0)
    for followup in (FollowUp.objects.filter(todo_id=todo.pk, seq__gt=last).order_by("seq")
                     .only("seq", "kind", "payload")):
        found = client.find_target(followup.kind, followup.payload)
        if found is None or _same_object(found[0], todo_target):
            continue
        cursor.execute(_INSERT_ACK_SQL, {
            "todo_id": todo.pk, "connection_id": connection.pk,
            "action": WriteBackAction.FOLLOWUP, "seq": followup.seq,
            "target": json.dumps(found[0]), "label": found[1][:300], "wanted": 1,
            "now": dialect.db_time(now)})
    if todo.write_back == WriteBackLevel.STATUS:
        cursor.execute(_BUMP_STATUS_SQL, {"todo_id": todo.pk, "connection_id": connection.pk,
                                          "wanted": entries, "now": dialect.db_time(now)})


def _space_progress_edits(todo_id) -> None:
    """Only progress lines changed: the status (and check run) is not edited again before
    PROGRESS_EDIT_INTERVAL after its last send (whatever line is latest then is shown)."""
    spaced = F("sent_at") + PROGRESS_EDIT_INTERVAL
    WriteBack.objects.filter(todo_id=todo_id,
                             action__in=[WriteBackAction.STATUS, WriteBackAction.CHECK],
                             state=WriteBackState.PENDING, sent_at__isnull=False,
                             next_attempt_at__lt=spaced).update(next_attempt_at=spaced)


def _client_of(webhook):
    if webhook is None or webhook.connection is None:
        return None
    return senders.get_sender(webhook.source).write_back


# -- 2. claiming one due write-back -------------------------------------------------------------

# The oldest due row, unless its todo has a send under way or (for a status or check) an ack
# still to go, or its connection is held (the source asked it to wait: hold_connection). The
# hold is looked up by the connection's primary key for the rows the due index yields.
_DUE_PICK = (
    f"SELECT w.id FROM {_TABLE} w WHERE w.state = 'pending' AND w.next_attempt_at <= %(now)s"
    f" AND NOT EXISTS (SELECT 1 FROM {_TABLE} o WHERE o.todo_id = w.todo_id AND o.id <> w.id"
    " AND (o.state = 'sending' OR (o.state = 'pending' AND o.action = 'ack'"
    " AND w.action <> 'ack')))"
    f" AND NOT EXISTS (SELECT 1 FROM {_CONNECTIONS} c WHERE c.id = w.connection_id"
    " AND c.held_until > %(now)s)"
    " ORDER BY w.next_attempt_at, w.id LIMIT 1"
)


def claim_due_sql() -> str:
    """The claim's one statement (its plan is pinned in ingest/tests/test_plans.py)."""
    return (f"UPDATE {_TABLE} SET state = 'sending', sending_until = %(until)s,"
            f" attempts = attempts + 1 WHERE id = ({_DUE_PICK}{dialect.skip_locked()})"
            " AND state = 'pending' RETURNING id")


def claim_due_write_back(*, now) -> WriteBack | None:
    """pending and due (its connection not held) -> sending, for ``SEND_LEASE``, counting an
    attempt: the row returned, or None when nothing is due. Overlapping workers skip each
    other's rows (PostgreSQL) or queue behind the one writer (SQLite); the UPDATE re-checks
    the state, so a row is claimed once."""
    params = {"now": dialect.db_time(now), "until": dialect.db_time(now + SEND_LEASE)}
    rows = db_statements.fetch_all(claim_due_sql(), params)
    if not rows:
        return None
    return WriteBack.objects.select_related("connection").get(pk=rows[0][0])


def return_stalled_sends(*, now) -> int:
    """sending past its lease -> pending, due now: its worker died or hung mid-send. Returns
    how many."""
    return WriteBack.objects.filter(state=WriteBackState.SENDING, sending_until__lte=now).update(
        state=WriteBackState.PENDING, next_attempt_at=now, sending_until=None)


# -- 3. sending and recording the answer --------------------------------------------------------


def send_write_back(row: WriteBack, *, now) -> str:
    """Send the claimed ``row`` and record the answer; returns its new state. With traces on
    the send is a span in its todo's trace (docs/operating.md#traces)."""
    todo = (Todo.objects.select_related("endpoint").filter(pk=row.todo_id).first())
    if not tracing.enabled():
        return _send_write_back(row, todo, now=now)
    with tracing.span(
            f"write_back {row.action}", kind="client",
            parent=todo.traceparent if todo is not None else None,
            **{"switchboard.todo_id": str(row.todo_id),
               "switchboard.endpoint": todo.endpoint.slug if todo is not None else None,
               "switchboard.queue": todo.queue if todo is not None else None,
               "switchboard.write_back.action": row.action,
               "switchboard.write_back.attempt": row.attempts,
               "switchboard.connection.kind": row.connection.kind}) as span:
        state = _send_write_back(row, todo, now=now)
        span.set(**{"switchboard.write_back.state": state})
    return state


def _send_write_back(row: WriteBack, todo, *, now) -> str:
    client = senders.get_sender(senders.CONNECTION_SOURCE[row.connection.kind]).write_back
    send = None if client is None else {WriteBackAction.STATUS: client.status,
                                        WriteBackAction.CHECK: client.check_run}.get(row.action)
    acks = (WriteBackAction.ACK, WriteBackAction.FOLLOWUP)
    if todo is None or client is None or (row.action not in acks and send is None):
        return finish_write_back(row, now=now, error=outbound.SourceError(
            "the todo is gone (pruned)" if todo is None else "the source writes nothing back"))
    started = time.monotonic()
    try:
        if row.action == WriteBackAction.ACK:
            external_id = client.ack(row.connection, {**row.target, "todo_id": row.todo_id}, now)
        elif row.action == WriteBackAction.FOLLOWUP:
            external_id = client.ack(row.connection, {**row.target, "todo_id": row.todo_id,
                                                      "followup": row.followup_seq}, now)
        else:
            # The first send has nothing to look for; a later one without an id may follow a
            # worker that died after the source took it, since the row was made.
            update = status_text.status_update(
                todo, now=now, markup=status_text.MARKUPS[client.markup],
                max_chars=client.max_status_chars)
            external_id = send(
                row.connection, row.target, update, row.external_id, now,
                look_since=row.created_at if row.attempts > 1 and not row.external_id else None)
    except outbound.SourceError as failed:
        if failed.credentials_refused:
            connections.record_connection_error(row.connection, failed.message, now=now)
        return finish_write_back(row, now=now, error=failed)
    # An ack's latency runs from the todo's creation (the delivery's 202) to the source's
    # answer: ``now`` is when the send began, so the request's own time is added.
    accepted_after = (now + timedelta(seconds=time.monotonic() - started) - todo.created_at
                      if row.action == WriteBackAction.ACK else None)
    return finish_write_back(row, now=now, external_id=external_id,
                             accepted_after=accepted_after)


def finish_write_back(row: WriteBack, *, now, external_id: str = "",
                      error: outbound.SourceError | None = None, accepted_after=None) -> str:
    """Record the answer to ``row``'s send, fenced by the attempt it claimed (a row its lease
    outlived was claimed again, and that send records its own answer). Sent: ``sent`` covers
    what was ``wanted`` at the claim, and a change that arrived meanwhile leaves it due again.
    A retryable error waits (``next_attempt``); past ``RETRY_FOR`` of failing it is abandoned;
    any other error fails it. A rate limit that says until when also holds the row's
    connection (``hold_connection``). The outcome (and ``accepted_after``, an ack's latency)
    is counted for /metrics in the same transaction, only when the fence matched. Returns the
    state recorded."""
    fence = WriteBack.objects.filter(pk=row.pk, state=WriteBackState.SENDING,
                                     attempts=row.attempts)
    source = senders.CONNECTION_SOURCE[row.connection.kind]
    if error is None:
        with transaction.atomic():
            # One statement, so a change counted since the claim (``wanted`` grew) leaves it due.
            if fence.update(state=Case(When(wanted__gt=row.wanted,
                                            then=Value(WriteBackState.PENDING)),
                                       default=Value(WriteBackState.SENT)),
                            sent=row.wanted, external_id=external_id or row.external_id,
                            sent_at=now, sending_until=None, failing_since=None, last_error="",
                            next_attempt_at=now):
                count_outcome(source, OUTCOME_SENT, accepted_after=accepted_after)
                connections.record_connection_success(row.connection, now=now)
        return WriteBack.objects.filter(pk=row.pk).values_list("state", flat=True).first()
    failing_since = row.failing_since or now
    message = error.message[:MAX_ERROR_CHARS]
    retry_at = next_attempt(row.attempts, now=now, asked=error.retry_at)
    if not error.retryable:
        state = WriteBackState.FAILED
    elif retry_at > failing_since + RETRY_FOR:
        state = WriteBackState.ABANDONED
    else:
        state = WriteBackState.PENDING
    with transaction.atomic():
        if fence.update(state=state, last_error=message, failing_since=failing_since,
                        next_attempt_at=retry_at if state == WriteBackState.PENDING else None,
                        sending_until=None):
            count_outcome(source, OUTCOMES[state])
    if state == WriteBackState.PENDING and error.retry_at is not None and error.retry_at > now:
        hold_connection(row.connection_id, until=error.retry_at)
    log.info("write-back not sent", extra={"todo_id": row.todo_id, "action": row.action,
                                           "state": state, "error": message})
    return state


def hold_connection(connection_id, *, until) -> bool:
    """The source answered a rate limit saying until when: none of the connection's
    write-backs goes before ``until``, so a rate-limited source is asked once, not once per
    row. Only ever moves the hold later (a guarded statement: overlapping workers that met the
    same limit agree on the latest time), and moves the connection's due rows to it, so
    ``manage.py write_backs`` shows when they go and the claim's scan of the due index does
    not walk them meanwhile (rows taken in during the hold are due at its end too; one taken in
    just before the hold was set is skipped by the claim's check of it). True when the hold
    moved."""
    held = Connection.objects.filter(pk=connection_id).filter(
        Q(held_until__isnull=True) | Q(held_until__lt=until)).update(held_until=until)
    if held:
        WriteBack.objects.filter(connection_id=connection_id, state=WriteBackState.PENDING,
                                 next_attempt_at__lt=until).update(next_attempt_at=until)
    return bool(held)


# -- what /metrics counts (docs/operating.md#metrics) --------------------------------------------

OUTCOME_SENT = "sent"  # the source took it
# A send's outcome by the state it left the row in: "retried" (it goes again), "failed" (the
# source refused it: not retried), "abandoned" (failing for RETRY_FOR: given up).
OUTCOMES = {WriteBackState.PENDING: "retried", WriteBackState.FAILED: "failed",
            WriteBackState.ABANDONED: "abandoned"}
_TALLY = WriteBackTally._meta.db_table
_BUMP_TALLY_SQL = (
    f"INSERT INTO {_TALLY} (source, series, label, count, total_seconds) VALUES {{rows}}"
    " ON CONFLICT (source, series, label) DO UPDATE SET"
    f" count = {_TALLY}.count + EXCLUDED.count,"
    f" total_seconds = {_TALLY}.total_seconds + EXCLUDED.total_seconds"
)


def ack_seconds_bucket(seconds: float) -> str:
    """The histogram bucket an ack's latency falls in: its upper bound, or "+Inf"."""
    return next((label for bound, label in zip(ACK_SECONDS_BUCKETS, ACK_SECONDS_LABELS)
                 if seconds <= bound), ACK_SECONDS_LABELS[-1])


def count_outcome(source: str, outcome: str, *, accepted_after=None) -> None:
    """Add one ``outcome`` of ``source``'s write-backs (and an ack's latency) to the durable
    tally, in one statement; the caller's transaction holds the answer's record."""
    rows = [(source, "outcome", outcome, 0.0)]
    if accepted_after is not None:
        seconds = max(accepted_after.total_seconds(), 0.0)
        rows.append((source, "ack_seconds", ack_seconds_bucket(seconds), seconds))
    values = ", ".join(["(%s, %s, %s, 1, %s)"] * len(rows))
    with db.cursor() as cursor:
        cursor.execute(_BUMP_TALLY_SQL.format(rows=values), [v for row in rows for v in row])


def next_attempt(attempts: int, *, now, asked=None):
    """When a failed send goes again: when the source asked (``Retry-After``, a rate limit's
    reset), else after a backoff doubling from FIRST_BACKOFF per attempt, capped at
    MAX_BACKOFF."""
    if asked is not None and asked > now:
        return asked
    doublings = min(max(attempts - 1, 0), 16)  # 5 s * 2**16 is far past the cap already
    return now + min(FIRST_BACKOFF * 2 ** doublings, MAX_BACKOFF)


def retry_write_back(row: WriteBack, *, now=None) -> bool:
    """An operator's "retry now": a failed or abandoned write-back is due again with a fresh
    retry budget, and the sender is woken once that commits. False when it was neither."""
    now = now or timezone.now()
    retried = bool(WriteBack.objects.filter(
        pk=row.pk, state__in=[WriteBackState.FAILED, WriteBackState.ABANDONED]).update(
        state=WriteBackState.PENDING, next_attempt_at=now, attempts=0, failing_since=None))
    if retried:
        transaction.on_commit(dispatch_send)
    return retried


def send_due_write_backs(*, now=None) -> int:
    """The sweep (switchboard/schedule.py, and every wake-up): stalled sends due again, the
    outbox taken in, then up to SEND_BATCH due write-backs sent. Safe when runs overlap: each
    step claims its rows with a guarded statement. Returns how many sends were made."""
    return_stalled_sends(now=now or timezone.now())
    for _ in range(10):  # bounded: a flood is taken over the next runs
        if absorb_outbox_entries(now=now or timezone.now()) < ABSORB_BATCH:
            break
    sent = 0
    while sent < SEND_BATCH:
        moment = now or timezone.now()
        row = claim_due_write_back(now=moment)
        if row is None:
            break
        send_write_back(row, now=moment)
        sent += 1
    return sent
