"""Long-poll ``claim_next`` (docs/reference.md#long-poll): where a waiting claim waits.

A waiting claim holds no database connection and no thread: it is a coroutine parked on an
``asyncio.Event`` in this process's ``WaitRoom`` until a todo it could claim may be ready, and
only then runs one claim (one thread hop, one pooled connection, returned at once).

How the room learns that a todo is ready: every committed todo change of every process (web,
Celery, the embedded sweeps) already goes to the board's channel-layer group
(``groups.BOARD_GROUP``, batched per ``publish.BOARD_BATCH_WINDOW``), and a change that leaves
a todo ``pending`` is exactly "ready" (create, release, retry promotion, requeue, lease lapse).
So the room follows that group with one channel per process — the publishers pay nothing extra
for long polls, and a todo created on any process wakes a waiter on any other. Each ready
change wakes ONE waiter of that endpoint whose queues cover the todo (the oldest), not the whole
pool: a thundering herd of claims for one todo would cost a claim per waiter. A woken waiter
that finds nothing (another worker was faster) waits again; a ready change that finds every
covering waiter busy with a claim (which may have read the queue just before the todo
committed) is kept for the first of them that is idle again.

Wake-ups are lossy (Redis down, a dropped batch), so the room also re-checks: every
``RECHECK_SECONDS`` it wakes the waiter of each (endpoint, queues) that tried longest ago, and
when a re-check claims something it wakes the next one at once (more may have been missed). A
lost wake-up therefore costs at most ``RECHECK_SECONDS`` of latency, never a todo.

A waiter whose last claim a concurrency cap held back (``at_capacity``) waits for a slot: a
claim of its endpoint that settles (done, failed, cancelled; a release or a lapsed lease is a
ready change anyway) wakes the oldest such waiter, whatever queue it claims from, since an
endpoint's cap spans its queues. Waiters that are not at capacity never see those changes, so
an uncapped endpoint's completes wake nobody.

The gap between a waiter's first (empty) claim and its joining the room: a todo made ready in
between is announced before the waiter listens. The room remembers when it last saw each
endpoint's ready change, and a waiter whose request started before that (or before the room
was following the group at all) is woken at once.
"""

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field

from channels.layers import get_channel_layer

from channels_push.bus import group_reader, groups
from todos import transitions

log = logging.getLogger("switchboard.longpoll")

# The re-check period: the worst-case latency a lost wake-up costs (at most 5 s:
# docs/reference.md#long-poll). Each (endpoint, queues) pair of waiters costs at most one claim
# per period, however many wait.
RECHECK_SECONDS = 5.0
# Why a waiter was woken when no ready change named a todo for it.
RECHECK = "recheck"
# States a claimed todo settles into: each may free a slot under a concurrency cap.
SETTLED_STATES = frozenset({"done", "failed", "cancelled"})
# Bound on remembered unserved changes per endpoint (a memory bound: past it the re-check serves).
UNSERVED_MAX = 1000


@dataclass(eq=False)
class Waiter:
    """One waiting claim: its endpoint, the queues it claims from (None: every queue of the
    endpoint) and whether it skips unverified todos. While woken, ``woken_for`` is the todo id
    whose change woke it (in ``woken_queue``, ``woken_unverified``), or ``RECHECK``."""

    endpoint_id: int
    queues: frozenset | None
    verified_only: bool = False
    at_capacity: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)
    woken_for: str | None = None
    woken_queue: str | None = None
    woken_unverified: bool = False
    last_attempt_at: float = 0.0
    session_id: str | None = None
    credential_id: int | None = None

    @property
    def key(self):
        return self.endpoint_id, self.queues, self.verified_only

    @property
    def idle(self) -> bool:
        return not self.event.is_set()

    def covers(self, queue: str, unverified: bool = False) -> bool:
        # A verified-only waiter could not claim an unverified todo: waking it would spend the
        # wake-up that another waiter of the endpoint could use.
        if unverified and self.verified_only:
            return False
        return self.queues is None or queue in self.queues

    def wake(self, reason: str, queue: str | None = None, unverified: bool = False) -> None:
        self.woken_for, self.woken_queue, self.woken_unverified = reason, queue, unverified
        self.event.set()

    def rearm(self, now: float) -> None:
        """Back to waiting after a claim attempt made at ``now``."""
        self.woken_for = self.woken_queue = None
        self.woken_unverified = False
        self.last_attempt_at = now
        self.event.clear()


class WaitRoom:
    """This process's waiting claims, woken by ready changes and by the re-check. Lives on one
    event loop (the server's); everything here runs on that loop, so no locks."""

    def __init__(self, loop, *, recheck_seconds: float | None = None, follow: bool = True):
        self.loop = loop
        self.recheck_seconds = RECHECK_SECONDS if recheck_seconds is None else recheck_seconds
        # False: no background tasks (unit tests drive on_changes and recheck by hand).
        self.follow = follow
        self.waiters: dict[int, list[Waiter]] = {}
        # Queues of ready changes that found every covering waiter busy with a claim attempt
        # (which may have read the queue before the todo committed): served as soon as one of
        # them is idle again, instead of at the next re-check.
        self.unserved: dict[int, list[tuple[str, bool]]] = {}
        # Loop time of the last ready change seen per endpoint (for the join gap; one float
        # per endpoint that ever had a ready todo, a bound as small as the endpoint table).
        self.last_ready_at: dict[int, float] = {}
        # Loop time since which the room has followed the group without interruption, or None.
        self.following_since: float | None = None
        self._tasks = []
        # Waiters per MCP session and per credential (the caps of ``over_cap``).
        self.per_session: Counter = Counter()
        self.per_credential: Counter = Counter()

    # -- waiters --------------------------------------------------------------------------------

    def over_cap(self, session_id: str | None, credential_id: int | None) -> str | None:
        """Why one more waiting claim of this session and credential is refused (the caps
        SWITCHBOARD_MAX_LONG_POLLS_PER_SESSION and _PER_CREDENTIAL, per process), or None."""
        from django.conf import settings

        per_session = settings.SWITCHBOARD_MAX_LONG_POLLS_PER_SESSION
        per_credential = settings.SWITCHBOARD_MAX_LONG_POLLS_PER_CREDENTIAL
        if session_id is not None and self.per_session[session_id] >= per_session:
            return (f"this session already has {per_session} claim_next calls waiting, the "
                    "most it may; wait for one of them to answer before starting another")
        if credential_id is not None and self.per_credential[credential_id] >= per_credential:
            return (f"this credential already has {per_credential} claim_next calls waiting "
                    "across its sessions, the most it may; wait for one of them to answer")
        return None

    def add(self, endpoint_id: int, queues, *, started_at: float,
            verified_only: bool = False, at_capacity: bool = False,
            session_id: str | None = None, credential_id: int | None = None) -> Waiter:
        """Register a waiting claim whose request (and first, empty claim) started at
        ``started_at`` (loop time). Woken at once when a ready change for its endpoint may have
        been missed in between. The caller checked ``over_cap`` first."""
        self._start()
        waiter = Waiter(endpoint_id, frozenset(queues) if queues is not None else None,
                        verified_only=verified_only, at_capacity=at_capacity,
                        last_attempt_at=started_at, session_id=session_id,
                        credential_id=credential_id)
        self.waiters.setdefault(endpoint_id, []).append(waiter)
        self._count(waiter, 1)
        # Not following yet: joining wakes every kind of waiter (``recheck_all``) anyway.
        if self.following_since is not None and (
                self.following_since > started_at
                or self.last_ready_at.get(endpoint_id, float("-inf")) >= started_at):
            waiter.wake(RECHECK)
        return waiter

    def remove(self, waiter: Waiter) -> None:
        """The waiter is done (answered, timed out, or its client left). A wake-up it had not
        acted on passes to another waiter."""
        waiters = self.waiters.get(waiter.endpoint_id, [])
        if waiter not in waiters:
            return
        waiters.remove(waiter)
        self._count(waiter, -1)
        if not waiters:
            self.waiters.pop(waiter.endpoint_id, None)
            self.unserved.pop(waiter.endpoint_id, None)
            return
        if waiter.woken_for == RECHECK:
            self._wake_first(waiter.endpoint_id, lambda other: other.key == waiter.key, RECHECK)
        elif waiter.woken_for is not None:
            self._offer(waiter.endpoint_id, waiter.woken_queue, waiter.woken_for,
                        waiter.woken_unverified)

    def _count(self, waiter: Waiter, step: int) -> None:
        for counter, key in ((self.per_session, waiter.session_id),
                             (self.per_credential, waiter.credential_id)):
            if key is not None:
                counter[key] += step
                if counter[key] <= 0:
                    del counter[key]

    def attempted(self, waiter: Waiter, *, claimed: bool, at_capacity: bool = False) -> None:
        """A woken waiter's claim attempt is done; ``claimed``: it has its answer and leaves;
        ``at_capacity``: a cap held it back, so it waits for a settling claim.
        After a re-check that found work, the next waiter of the same kind is woken: the lost
        wake-ups may have been for more than one todo."""
        reason = waiter.woken_for
        waiter.rearm(self.loop.time())
        waiter.at_capacity = at_capacity
        if claimed:
            self.remove(waiter)
            if reason == RECHECK:
                self._wake_first(waiter.endpoint_id, lambda other: other.key == waiter.key,
                                 RECHECK)
        for queue, unverified in self.unserved.pop(waiter.endpoint_id, []):
            self._offer(waiter.endpoint_id, queue, "unserved", unverified)

    # -- wake-ups -------------------------------------------------------------------------------

    def _wake_first(self, endpoint_id: int, matches, reason: str, queue=None,
                    unverified: bool = False) -> bool:
        for waiter in self.waiters.get(endpoint_id, ()):
            if waiter.idle and matches(waiter):
                waiter.wake(reason, queue, unverified)
                return True
        return False

    def _offer(self, endpoint_id: int, queue: str, reason: str, unverified: bool = False) -> None:
        """Wake the oldest idle waiter of ``endpoint_id`` covering ``queue`` (and, for an
        unverified todo, not verified-only); when every covering waiter is busy, keep the queue
        for the first of them that is idle again."""
        def covering(waiter):
            return waiter.covers(queue, unverified)

        if self._wake_first(endpoint_id, covering, reason, queue, unverified):
            return
        if any(covering(waiter) for waiter in self.waiters.get(endpoint_id, ())):
            unserved = self.unserved.setdefault(endpoint_id, [])
            if len(unserved) < UNSERVED_MAX:
                unserved.append((queue, unverified))

    def on_changes(self, changes) -> None:
        """Board changes arrived: each that left a todo ready (pending, not scheduled) wakes
        one idle waiter of its endpoint whose queues cover it."""
        now = self.loop.time()
        for change in changes:
            if change.get("state") in SETTLED_STATES:
                endpoint_id = change.get("endpoint_id")
                self._wake_first(endpoint_id, lambda waiter: waiter.at_capacity,
                                 str(change.get("todo_id")))
                continue
            # A scheduled todo is pending but not ready: it wakes nobody until the due sweep
            # (or an operator's run now) announces it again without ``scheduled``.
            if change.get("state") != "pending" or change.get("scheduled"):
                continue
            endpoint_id = change.get("endpoint_id")
            self.last_ready_at[endpoint_id] = now
            if endpoint_id in self.waiters:
                self._offer(endpoint_id, change.get("queue"), str(change.get("todo_id")),
                            change.get("trust") == "unverified")

    def recheck(self) -> None:
        """Wake, per (endpoint, queues), the idle waiter that tried longest ago, if that was at
        least a re-check period ago."""
        due = self.loop.time() - self.recheck_seconds
        oldest = {}
        for waiters in self.waiters.values():
            for waiter in waiters:
                if not waiter.idle or waiter.last_attempt_at > due:
                    continue
                best = oldest.get(waiter.key)
                if best is None or waiter.last_attempt_at < best.last_attempt_at:
                    oldest[waiter.key] = waiter
        for waiter in oldest.values():
            waiter.wake(RECHECK)

    def recheck_all(self) -> None:
        """Wake one idle waiter per (endpoint, queues) now, whenever it last tried."""
        seen = set()
        for waiters in self.waiters.values():
            for waiter in waiters:
                if waiter.key not in seen and waiter.idle:
                    seen.add(waiter.key)
                    waiter.wake(RECHECK)

    # -- background tasks -----------------------------------------------------------------------

    def _start(self) -> None:
        if self._tasks or not self.follow:
            return
        self._tasks = [self.loop.create_task(self._follow()), self.loop.create_task(self._tick())]

    async def _tick(self):
        while True:
            await asyncio.sleep(self.recheck_seconds)
            self.recheck()

    async def _follow(self):
        """Follow the board group for as long as the process lives (one channel; a process
        that served one long poll is likely to serve the next), rejoining after a loss
        (``group_reader.follow_groups``, the streams' own loop)."""
        layer = get_channel_layer()
        if layer is None:
            return

        async def joined():
            self.following_since = self.loop.time()
            # Changes may have been missed while not following: check now.
            self.recheck_all()

        async def lost():
            # Not following: waiters are served by the re-check until the room is back in.
            self.following_since = None

        async def on_message(message) -> bool:
            if message.get("type") == groups.BOARD_CHANGES_TYPE:
                self.on_changes(message.get("changes") or ())
            return False

        await group_reader.follow_groups(layer, [groups.BOARD_GROUP], {"channel": None},
                                         on_message, {"long_poll": "room"}, on_join=joined,
                                         on_leave=lost)


_room: WaitRoom | None = None


def room() -> WaitRoom:
    """The wait room of the running event loop (daphne's one loop; a test's loops each get
    their own, since asyncio objects cannot cross loops)."""
    global _room
    loop = asyncio.get_running_loop()
    if _room is None or _room.loop is not loop:
        _room = WaitRoom(loop)
    return _room


@dataclass(frozen=True)
class LongPoll:
    """An empty claim_next that asked to wait: how long, and for which queues (None: every
    queue of the endpoint) a ready todo should wake it."""

    endpoint_id: int
    wait_seconds: float
    queues: tuple | None
    verified_only: bool = False
    # The last claim was held back by a cap: a claim that settles may free its slot.
    at_capacity: bool = False
    # Who waits (the long-poll caps count per session and per credential).
    session_id: str | None = None
    credential_id: int | None = None


def long_poll_of(endpoint, params: dict | None, result: dict, *,
                 session_id: str | None = None) -> LongPoll | None:
    """Whether the answer to tools/call ``params`` (``result``, as on the wire) should wait
    instead of going out now: a claim_next that found nothing and was given wait_seconds > 0.
    ``endpoint.credential_id`` is the credential the request presented."""
    params = params or {}
    arguments = params.get("arguments") or {}
    wait_seconds = arguments.get("wait_seconds") or 0
    if (params.get("name") != "claim_next" or result.get("isError") or wait_seconds <= 0
            or not (result.get("structuredContent") or {}).get("empty")):
        return None
    queues = arguments.get("queues")
    if queues is None and not endpoint.all_queues:
        queues = endpoint.scope
    return LongPoll(endpoint_id=endpoint.pk, wait_seconds=float(wait_seconds),
                    queues=tuple(sorted(set(queues))) if queues is not None else None,
                    verified_only=bool(arguments.get("verified_only")
                                       or not endpoint.accept_unverified),
                    at_capacity=bool(result["structuredContent"].get("at_capacity")),
                    session_id=session_id,
                    credential_id=getattr(endpoint, "credential_id", None))


def release_undelivered_claim(endpoint, session_id: str, envelope: dict) -> str | None:
    """A long poll claimed a todo for a client that left before the answer could be sent:
    give the todo back at once (refunding the attempt, fenced by the lease just granted)
    instead of letting it sit under a lease nobody holds. Returns the todo id released."""
    todo = ((envelope.get("result") or {}).get("structuredContent") or {}).get("todo") or {}
    if not todo.get("lease_id"):
        return None
    try:
        transitions.release_todo(transitions.Caller.agent(endpoint, session_id), todo["id"],
                                 lease_id=todo["lease_id"])
    except transitions.Refusal:
        return None  # the lease is gone already (lapsed, overridden): nothing to give back
    return todo["id"]

