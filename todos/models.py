"""The todo, its lifecycle table and its audit trail (docs/reference.md#todo-states)."""

from datetime import timedelta

from django.db import models
from django.db.models import Q


class State(models.TextChoices):
    AWAITING_APPROVAL = "awaiting_approval"
    PENDING = "pending"
    CLAIMED = "claimed"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


# The states an operator may cancel a todo from: every state but the terminal ones. A claimed
# todo's cancel is an override of the agent's lease (its next fenced call is lease_lost).
CANCELLABLE_STATES = (State.AWAITING_APPROVAL, State.PENDING, State.FAILED, State.CLAIMED)
# Long enough for every state name (awaiting_approval is 17 characters).
STATE_MAX_CHARS = 32


class Trust(models.TextChoices):
    SIGNED = "signed"
    OPERATOR = "operator"
    UNVERIFIED = "unverified"


# Live: not ended (a failed todo is live until it is a dead letter, LIVE_FOR_IDEMPOTENCY).
LIVE_STATES = (State.AWAITING_APPROVAL, State.PENDING, State.CLAIMED, State.FAILED)

# The legal edges, written down once, as (event action, from state, to state). The test
# todos/tests/test_state_table.py drives every transition function and checks that the events
# they record are exactly these edges: none missing, none extra.
EDGES = frozenset({
    ("create", None, State.PENDING),
    ("claim", State.PENDING, State.CLAIMED),
    ("heartbeat", State.CLAIMED, State.CLAIMED),
    # The agent's progress line for the source's living status (post_update).
    ("progress", State.CLAIMED, State.CLAIMED),
    ("complete", State.CLAIMED, State.DONE),
    ("fail", State.CLAIMED, State.FAILED),
    ("dead_letter", State.CLAIMED, State.FAILED),  # fail with attempts spent
    ("release", State.CLAIMED, State.PENDING),
    ("lease_lapsed", State.CLAIMED, State.PENDING),
    ("lease_lapsed", State.CLAIMED, State.FAILED),  # the last attempt's lease lapsed
    ("retry", State.FAILED, State.PENDING),
    ("requeue", State.FAILED, State.PENDING),
    # unverified -> operator trust, also while awaiting approval (approving keeps trust).
    ("promote", State.PENDING, State.PENDING),
    ("promote", State.AWAITING_APPROVAL, State.AWAITING_APPROVAL),
    # Work control (docs/work-control.md): an operator changes the order of a waiting todo
    # (awaiting approval too: its order is set before the yes), and a scheduled todo becomes
    # ready (its time came, or an operator ran it now).
    ("prioritize", State.AWAITING_APPROVAL, State.AWAITING_APPROVAL),
    ("prioritize", State.PENDING, State.PENDING),
    ("prioritize", State.FAILED, State.FAILED),
    ("due", State.PENDING, State.PENDING),
    ("run_now", State.PENDING, State.PENDING),
    # The approval gate: a gated todo is created awaiting approval; approve makes it pending
    # (ready, rung), reject cancels it, and so does the approval-timeout sweep (as "cancel").
    ("create", None, State.AWAITING_APPROVAL),
    ("approve", State.AWAITING_APPROVAL, State.PENDING),
    ("reject", State.AWAITING_APPROVAL, State.CANCELLED),
    *(("cancel", state, State.CANCELLED) for state in CANCELLABLE_STATES),
    # Threads (docs/work-control.md#threads): a delivery folded into a live todo, and a held
    # todo's holder asked to stop (the source closed its thread, or an operator asked).
    *(("followup", state, state) for state in LIVE_STATES),
    ("cancel_request", State.CLAIMED, State.CLAIMED),
})

# docs/work-control.md "Priority": higher is claimed first; the range keeps a priority a small
# integer an operator can reason about (and a SMALLINT column).
PRIORITY_MIN = -100
PRIORITY_MAX = 100
PRIORITY_DEFAULT = 0
# docs/work-control.md "Scheduled todos": how far ahead a todo may be scheduled, and how far in
# the past a given ``not_before`` may lie (clock skew between a script and the server) before
# it is refused as a mistake rather than run at once.
MAX_SCHEDULE_AHEAD = timedelta(days=30)
NOT_BEFORE_PAST_TOLERANCE = timedelta(minutes=1)

# Idempotency keys collapse while a todo is live: pending, claimed, failed and waiting to
# retry, or awaiting approval (a redelivery of a gated todo must not ask twice). Done,
# cancelled and dead-lettered todos free their key (docs/reference.md#idempotency).
LIVE_FOR_IDEMPOTENCY = Q(state__in=[State.PENDING, State.CLAIMED, State.AWAITING_APPROVAL]) | Q(
    state=State.FAILED, dead_lettered_at__isnull=True
)

# A todo being stopped takes no follow-ups: a reopened thread gets a new todo.
LIVE_FOR_THREAD = LIVE_FOR_IDEMPOTENCY & Q(cancel_requested_at__isnull=True)
THREAD_MAX_CHARS = 300


class WriteBack(models.TextChoices):
    """What a todo's source hears of it (docs/write-back.md#what-is-written-back), fixed when it
    is created from its route: nothing, only that it was taken in (``ack``), or also one living
    status kept up to date at every later transition (``status``)."""

    OFF = "off"
    ACK = "ack"
    STATUS = "status"


# The longest progress line an agent may post (the living status shows it whole).
MAX_PROGRESS_CHARS = 2000

# Transitions that change nothing a source shows (a heartbeat only extends the lease): they
# write no outbox entry and wake no write-back.
SILENT_TO_SOURCE = frozenset({"heartbeat"})


# How much of a lease owner (an MCP session id, or an operator's username) anyone but its holder
# sees: agents in the wire shape, operators on the board (docs/security.md).
LEASE_OWNER_HINT_CHARS = 8


class Todo(models.Model):
    # No index of its own: todo_by_state leads with endpoint_id and serves every lookup by
    # endpoint (PROTECT's check included), and each index is one more insert per transition.
    endpoint = models.ForeignKey("endpoints.Endpoint", on_delete=models.PROTECT, related_name="todos",
                                 db_index=False)
    queue = models.CharField(max_length=64)
    state = models.CharField(max_length=STATE_MAX_CHARS, choices=State.choices,
                             default=State.PENDING)
    title = models.CharField(max_length=500)
    kind = models.CharField(max_length=200, blank=True, default="")
    source = models.CharField(max_length=64, blank=True, default="")
    payload = models.JSONField(default=dict, blank=True)
    idempotency_key = models.CharField(max_length=300, null=True, blank=True)
    delivery_event = models.ForeignKey(
        "ingest.DeliveryEvent", null=True, blank=True, on_delete=models.PROTECT, related_name="todos"
    )
    # Copied from the delivery event at create; changed only by an operator's promote
    # (unverified -> operator). The doorbell gate and every board row need it, and a join on
    # each would cost more than the 10 bytes.
    trust = models.CharField(max_length=16, choices=Trust.choices, default=Trust.UNVERIFIED)
    attempts = models.PositiveIntegerField(default=0)
    max_attempts = models.PositiveIntegerField(default=5)
    lease_id = models.CharField(max_length=64, null=True, blank=True)
    lease_owner = models.CharField(max_length=200, null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    # The length the lease was granted (claim's ttl, or the last heartbeat's): a heartbeat
    # without a ttl extends by it, so it never shortens a lease the agent asked to be long.
    lease_ttl = models.DurationField(null=True, blank=True)
    retry_at = models.DateTimeField(null=True, blank=True)
    dead_lettered_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True)
    last_error = models.TextField(null=True, blank=True)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    ring_attempts = models.PositiveSmallIntegerField(default=0)
    last_ringed_at = models.DateTimeField(null=True, blank=True)
    # Higher first among claimable todos (then oldest): docs/work-control.md "Priority".
    # db_default too: rows written by SQL that names no priority (bulk loads, other tools)
    # get the default rather than a NOT NULL error.
    priority = models.SmallIntegerField(default=PRIORITY_DEFAULT, db_default=PRIORITY_DEFAULT)
    # Set while scheduled; the due sweep clears it, so "ready" is ``state = 'pending' AND
    # not_before IS NULL`` everywhere and the claim indexes leave scheduled todos out.
    not_before = models.DateTimeField(null=True, blank=True)
    # What its transitions write to the outbox (``OutboxEntry``); db_default as for priority.
    write_back = models.CharField(max_length=8, choices=WriteBack.choices, default=WriteBack.OFF,
                                  db_default=WriteBack.OFF)
    # The holder's latest words for the living status (post_update); a new claim clears it.
    progress = models.TextField(null=True, blank=True)
    # The W3C traceparent of the delivery that made it (docs/operating.md#traces): every later
    # span about the todo is a child of it; None when its arrival carried no trace.
    traceparent = models.CharField(max_length=55, null=True, blank=True)
    # Usage the agent reported with complete and fail, summed over the attempts
    # (docs/reference.md#usage-and-budgets); each attempt's own report is in its event. Money
    # in millionths of a dollar, so sums are exact on both backends. db_default: the create
    # statements name no usage column.
    usage_reports = models.PositiveIntegerField(default=0, db_default=0)
    usage_input_tokens = models.BigIntegerField(default=0, db_default=0)
    usage_output_tokens = models.BigIntegerField(default=0, db_default=0)
    usage_cost_microusd = models.BigIntegerField(default=0, db_default=0)
    usage_turns = models.BigIntegerField(default=0, db_default=0)
    usage_model = models.CharField(max_length=100, blank=True, default="", db_default="")
    # An attempt that takes the todo's cost past this dead-letters it instead of retrying.
    # Empty: the endpoint's max_cost_usd, if it has one.
    max_cost_usd = models.DecimalField(max_digits=12, decimal_places=6, null=True, blank=True)
    # Threads (docs/work-control.md#threads). thread_live_key (``<webhook id>:<thread>``) only
    # when the route coalesces: todo_live_thread makes one live todo per thread exact.
    thread = models.CharField(max_length=THREAD_MAX_CHARS, null=True, blank=True)
    thread_live_key = models.CharField(max_length=THREAD_MAX_CHARS + 24, null=True, blank=True)
    # FollowUp.seq runs 1..followup_count; followups_given: how many this lease's holder has.
    followup_count = models.PositiveIntegerField(default=0, db_default=0)
    followups_given = models.PositiveIntegerField(default=0, db_default=0)
    # The source or an operator asked the holder to stop; a lapse then cancels, never retries.
    cancel_requested_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            # claim_next over a list of queues: one ordered probe per queue. Partial on ready
            # todos, so the claim cost does not grow with history; priority DESC to serve
            # "highest priority, then oldest" forwards.
            models.Index(
                fields=["endpoint", "queue", "-priority", "created_at", "id"],
                condition=Q(state="pending", not_before__isnull=True),
                name="todo_claim_by_queue",
            ),
            # claim_next when the endpoint's scope is "*": one ordered scan of the endpoint's
            # ready todos, no queue filter to defeat the index order.
            models.Index(
                fields=["endpoint", "-priority", "created_at", "id"],
                condition=Q(state="pending", not_before__isnull=True),
                name="todo_claim_any_queue",
            ),
            # release_due_scheduled (the due sweep): scheduled todos by the time they are due.
            models.Index(
                fields=["not_before"],
                condition=Q(state="pending", not_before__isnull=False),
                name="todo_scheduled_due",
            ),
            # expire_lapsed_leases (the reaper): claimed todos by lease expiry.
            models.Index(
                fields=["lease_expires_at"], condition=Q(state="claimed"), name="todo_reaper"
            ),
            # promote_due_retries: failed todos that will retry (dead letters have no retry_at).
            models.Index(
                fields=["retry_at"],
                condition=Q(state="failed", retry_at__isnull=False),
                name="todo_retry_promoter",
            ),
            # sweeps.prune_settled_todos (the retention prune): done todos past retention, oldest
            # first. Partial, so it costs one index insert at complete and nothing for live todos.
            models.Index(fields=["updated_at"], condition=Q(state="done"), name="todo_prune_done"),
            # The same sweep for cancelled todos (kept as long as done ones), by cancelled_at.
            models.Index(fields=["cancelled_at"], condition=Q(state="cancelled"),
                         name="todo_prune_cancelled"),
            # cancel_stale_approvals: todos awaiting approval, oldest first.
            models.Index(fields=["endpoint", "created_at"], condition=Q(state="awaiting_approval"),
                         name="todo_awaiting_approval"),
            # sweeps.prune_settled_todos for dead letters, when SWITCHBOARD_RETAIN_DEAD_DAYS is set.
            models.Index(
                fields=["dead_lettered_at"],
                condition=Q(state="failed", dead_lettered_at__isnull=False),
                name="todo_prune_dead",
            ),
            # Board and list_todos: an endpoint's todos by state, newest first.
            models.Index(fields=["endpoint", "state", "queue"], name="todo_by_state"),
            # A thread's todos; partial, so todos without one cost no index insert.
            models.Index(fields=["endpoint", "thread"], condition=Q(thread__isnull=False),
                         name="todo_by_thread"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(priority__gte=PRIORITY_MIN, priority__lte=PRIORITY_MAX),
                name="todo_priority_range",
            ),
            # Concurrent creates with one key collapse here: the loser's INSERT conflicts and
            # create_todo returns the winner's row.
            models.UniqueConstraint(
                fields=["endpoint", "idempotency_key"],
                condition=Q(idempotency_key__isnull=False) & LIVE_FOR_IDEMPOTENCY,
                name="todo_live_idempotency_key",
            ),
            # Concurrent deliveries on one coalescing thread collapse here.
            models.UniqueConstraint(
                fields=["endpoint", "thread_live_key"],
                condition=Q(thread_live_key__isnull=False) & LIVE_FOR_THREAD,
                name="todo_live_thread",
            ),
        ]

    def __str__(self):
        return f"#{self.pk} {self.title}"

    @property
    def lease_owner_hint(self) -> str | None:
        """The lease owner as others may see it: its first LEASE_OWNER_HINT_CHARS
        characters. A session id is a bearer-like handle for its session (with the credential
        it ends it), so the whole id never leaves its own session; the hint still tells
        workers and operators apart."""
        return self.lease_owner[:LEASE_OWNER_HINT_CHARS] if self.lease_owner else self.lease_owner

    @property
    def is_dead_letter(self) -> bool:
        return self.state == State.FAILED and self.dead_lettered_at is not None


class TodoEvent(models.Model):
    """One row per transition: the audit trail the board and admin show."""

    # No index of its own ("todoevent_history" leads with todo_id) and no database constraint
    # (docs/decisions/todo-events-without-a-foreign-key.md).
    todo = models.ForeignKey(Todo, on_delete=models.CASCADE, related_name="events", db_index=False,
                             db_constraint=False)
    action = models.CharField(max_length=32)
    from_state = models.CharField(max_length=STATE_MAX_CHARS, null=True, blank=True)
    to_state = models.CharField(max_length=STATE_MAX_CHARS)
    actor = models.CharField(max_length=200)
    at = models.DateTimeField()
    detail = models.JSONField(default=dict, blank=True)

    class Meta:
        indexes = [models.Index(fields=["todo", "at"], name="todoevent_history")]

    def __str__(self):
        # No actor: admin prints this above each history row, and an agent's actor is its
        # whole session id (a handle of the session; the inline shows its label instead).
        return f"{self.action} {self.from_state}->{self.to_state}"


class FollowUp(models.Model):
    """A delivery folded into its thread's live todo (docs/work-control.md#threads)."""

    todo = models.ForeignKey(Todo, on_delete=models.CASCADE, related_name="followups",
                             db_index=False, db_constraint=False)
    seq = models.PositiveIntegerField()
    delivery_event = models.ForeignKey("ingest.DeliveryEvent", null=True, blank=True,
                                       on_delete=models.DO_NOTHING, db_constraint=False,
                                       related_name="+")
    kind = models.CharField(max_length=200, blank=True, default="")
    title = models.CharField(max_length=500)
    actor = models.CharField(max_length=200, blank=True, default="")
    trust = models.CharField(max_length=16, choices=Trust.choices, default=Trust.UNVERIFIED)
    payload = models.JSONField(default=dict, blank=True)
    at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["todo", "seq"], name="followup_seq")]

    def __str__(self):
        return f"#{self.todo_id}.{self.seq} {self.title}"


class OutboxEntry(models.Model):
    """A transition the todo's source is to hear of (docs/write-back.md#the-outbox): written
    by the transition's own statement when the todo's ``write_back`` asks for it (its
    ``create`` when ``ack`` or ``status``, every later transition but a heartbeat when
    ``status``), so it exists exactly when the transition committed. Ingest's write-back
    worker takes entries (``transitions.take_outbox_entries``, which deletes them) into its
    own record of what to send; the table holds only entries not yet taken."""

    # No constraint, as for events: the entry outlives nothing (it is taken within seconds).
    todo = models.ForeignKey(Todo, on_delete=models.DO_NOTHING, related_name="+",
                             db_index=False, db_constraint=False)
    action = models.CharField(max_length=32)
    at = models.DateTimeField()

    def __str__(self):
        return f"#{self.todo_id} {self.action}"


class PrunedEventTally(models.Model):
    """Audit events that retention deleted, counted by (action, to_state).

    /metrics counts transitions from the audit trail; the prune sweep folds every event it deletes
    into this table in the same statement, so the counters never go down when history is pruned
    (docs/operating.md#retention). The sum of ``count`` grows with every fold: a scrape that sees it
    change recounts the remaining events instead of trusting its cached running total, which still
    holds the rows that were just folded in here.
    """

    action = models.CharField(max_length=32)
    to_state = models.CharField(max_length=STATE_MAX_CHARS)
    count = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["action", "to_state"], name="pruned_event_tally_key"),
        ]

    def __str__(self):
        return f"{self.action}->{self.to_state}: {self.count}"


class ThroughputTally(models.Model):
    """How many todos of an endpoint's queue were created, or entered a state, in one time
    bucket: the board's throughput chart and its "done in 24 h" counts.

    Folded from the audit trail by ``sweeps.fold_throughput`` (never written by a transition:
    a counter row per minute would be one hot row every concurrent complete waits on). Minute
    buckets (``span_seconds`` 60) are kept two hours, hour buckets (3600) 26 hours, so a read
    of the chart is a few dozen rows per queue however busy the day was. ``measure`` is
    ``created`` or the name of the state entered (``done``, ``failed``, ``cancelled`` …):
    whatever states the lifecycle has, nothing here lists them.
    """

    endpoint = models.ForeignKey("endpoints.Endpoint", on_delete=models.CASCADE,
                                 related_name="+", db_index=False)
    queue = models.CharField(max_length=64)
    span_seconds = models.PositiveIntegerField()
    bucket_start = models.DateTimeField()
    measure = models.CharField(max_length=32)
    count = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            # The fold's upsert key; it leads with the endpoint, span and time, which is also
            # how the board reads (its endpoints, one span, the last hour or day).
            models.UniqueConstraint(
                fields=["endpoint", "span_seconds", "bucket_start", "queue", "measure"],
                name="throughput_tally_key"),
        ]
        indexes = [
            # sweeps.fold_throughput's prune of buckets past their keep.
            models.Index(fields=["bucket_start"], name="throughput_prune"),
        ]

    def __str__(self):
        return f"{self.bucket_start:%Y-%m-%d %H:%M} {self.queue} {self.measure}: {self.count}"


class ThroughputFold(models.Model):
    """One row: the audit-trail event id ``sweeps.fold_throughput`` has folded through. Its
    row lock serialises overlapping folds; a read of the tallies reads it in the same
    snapshot, then counts the events after it itself (``queries.throughput``)."""

    through_event_id = models.BigIntegerField(default=0)


class DailySpend(models.Model):
    """What an endpoint's agents reported spending on one UTC day: the budget's measure
    (docs/reference.md#usage-and-budgets). Written by the statement of the complete or fail that
    reported the usage (an upsert on this row), so a claim's budget guard reads a committed
    figure, never one a fold has yet to catch up with. Never pruned (one row per endpoint per
    day): /metrics sums it, so its spend counters never go down when history is pruned."""

    endpoint = models.ForeignKey("endpoints.Endpoint", on_delete=models.CASCADE,
                                 related_name="+", db_index=False)
    day = models.DateField()
    cost_microusd = models.BigIntegerField(default=0)
    tokens = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            # The upsert's key, and the budget guard's one-row probe (endpoint, today).
            models.UniqueConstraint(fields=["endpoint", "day"], name="daily_spend_key"),
        ]

    def __str__(self):
        return (f"{self.endpoint_id} {self.day}: {self.cost_microusd / 1_000_000} USD,"
                f" {self.tokens} tokens")


TODO_TOKEN_PREFIX = "sbt_"


class TodoToken(models.Model):
    """A bearer for one todo under one lease (docs/security.md#the-todo-token), stored as its
    SHA-256 digest only. It is good only while its todo is claimed under ``lease_id``: that is
    checked against the todo row at every use, so whatever ends the lease (settle, release,
    lapse, an operator's override) ends the token with no write of its own. ``revoked_at``
    records for the history when the revocation sweep saw the lease gone."""

    # No database constraint, as the todo's events: the retention prune deletes the tokens in
    # the statement that deletes their todo (todos.sweeps).
    todo = models.ForeignKey(Todo, on_delete=models.DO_NOTHING, related_name="tokens",
                             db_constraint=False)
    endpoint = models.ForeignKey("endpoints.Endpoint", on_delete=models.CASCADE,
                                 related_name="todo_tokens")
    lease_id = models.CharField(max_length=64)
    digest = models.CharField(max_length=64, unique=True)
    issued_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            # ingest.sweeps.revoke_ended_agent_tokens: the tokens not yet recorded as revoked.
            models.Index(fields=["issued_at"], name="todotoken_unrevoked",
                         condition=Q(revoked_at__isnull=True)),
        ]

    def __str__(self):
        return f"todo token of {self.todo_id} ({'revoked' if self.revoked_at else 'live'})"
