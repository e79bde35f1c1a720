"""The doorbell's bounded periodic work: the heartbeat that re-rings due todos and the
presence-boundary digests. Celery beat (production) and the embedded scheduler (``manage.py
serve``) call these same functions; each does one batch and is safe when two runs overlap
(every row is re-guarded by its UPDATE)."""

from datetime import timedelta

from django.db.models import Q
from django.utils import timezone

from channels_push.bus import publish
from channels_push.sessions import queries
from endpoints import transitions as endpoint_transitions
from endpoints.models import Endpoint, Presence
from todos import ring_budget
from todos import usage

from . import doorbells

# -- the doorbell heartbeat (docs/reference.md#doorbells) ------------------------------------------

# Every ring a todo gets, five in all (MAX_RING_ATTEMPTS), as the wait before each, indexed by
# ring_attempts and counted from last_ringed_at (a sweep ring or a digest), else from creation.
# The first is the publisher's, when the todo becomes ready; the sweep rings the other four.
RING_SCHEDULE = (
    timedelta(0),  # 1: on creation (or hand-over)
    timedelta(minutes=5),  # 2
    timedelta(minutes=20),  # 3
    timedelta(hours=1),  # 4
    timedelta(hours=6),  # 5: the last; never rung again
)
# Rings per sweep: a wake-up nudge, not a delivery path; an agent
# that is awake drains by pull, so more rings would only add noise to its session.
RINGS_PER_SWEEP = 3


def find_ring_receivers(*, now) -> dict:
    """Endpoints that can receive a ring now, as ``{endpoint_id: when its sessions were last
    rung}`` (``queries.attached_endpoints``): active, effectively ``in`` (a clocked-out
    endpoint keeps its whole ring budget: docs/reference.md#presence), with at least one
    attached session (an open stream, or a request within the attach window:
    ``queries.attached_sql``) — with or without an open stream: the doorbell falls back to a
    streamless session, and a push dropped at the transport still counts. Paused queues are
    left out by the sweep's statement. Presence needs the schedule's time-zone math, so it is
    evaluated here, over the few endpoints that have a live session."""
    attached = queries.attached_endpoints(now)
    # Over a daily budget: held like a pause, the ring budget untouched.
    return {endpoint.pk: attached[endpoint.pk]
            for endpoint in usage.with_spend_today(Endpoint.objects.filter(pk__in=list(attached)),
                                                   now)
            if endpoint.presence_at(now) == Presence.IN
            and not usage.spend_today(endpoint)["over_budget"]}


def ring_due_todos(*, now=None) -> int:
    """One heartbeat sweep: ring at most RINGS_PER_SWEEP due todos, round-robin across the
    endpoints that can receive them, charging each its ring in the statement that selects it.
    Safe when two sweeps overlap (the statement re-checks each row). Returns how many rang."""
    now = now or timezone.now()
    if not publish.can_reach_streams():
        # In-memory layer outside the server: a ring would be charged and reach nobody.
        return 0
    rung = ring_budget.record_sweep_rings(
        receivers=find_ring_receivers(now=now), schedule=RING_SCHEDULE,
        limit=RINGS_PER_SWEEP, now=now)
    doorbells.ring_on_commit(rung)
    return len(rung)


# -- presence boundaries (docs/reference.md#presence) ----------------------------------------------

# A boundary older than this when first seen is history, not news: a sweep that was down for
# longer does not wake agents with a stale "your shift started" (the heartbeat still rings).
BOUNDARY_LOOKBACK = timedelta(minutes=15)
DIGEST_REASON_FOR_CHANGE = {"shift": "shift_start", "override_end": "override_end"}


def announce_presence_boundaries(*, now=None) -> int:
    """Detect shift starts and override ends since the last sweep and send a digest to each
    endpoint whose effective presence turned ``in`` there. Each boundary is claimed by one
    guarded UPDATE (endpoint.presence_boundary_at moves forward only), so when sweeps overlap
    exactly one announces it. Returns how many digests were sent (one per endpoint)."""
    now = now or timezone.now()
    sent = 0
    candidates = Endpoint.objects.filter(active=True).filter(
        ~Q(shift_timezone="") | Q(presence_override_until__isnull=False))
    for endpoint in candidates:
        since = now - BOUNDARY_LOOKBACK
        if endpoint.presence_boundary_at and endpoint.presence_boundary_at > since:
            since = endpoint.presence_boundary_at
        changes = endpoint.presence_changes(since, now)
        if not changes:
            continue
        boundary, change = changes[-1]  # only the latest boundary is news
        if not endpoint_transitions.record_presence_boundary(endpoint.pk, boundary):
            continue  # an overlapping sweep announced it
        turned_in = (endpoint.presence_at(boundary) == Presence.IN
                     and endpoint.presence_at(boundary - timedelta(microseconds=1)) == Presence.OUT)
        if turned_in and endpoint.presence_at(now) == Presence.IN:
            sent += bool(doorbells.send_digest(endpoint, DIGEST_REASON_FOR_CHANGE[change], now=now))
    return sent


# -- the budget's day turn (docs/reference.md#usage-and-budgets) -----------------------------------


def announce_budget_day_turns(*, now=None) -> int:
    """At the first sweep of a UTC day, send one digest (reason ``budget``) to each endpoint
    that was over a daily budget on the last day seen (or yesterday) and is under it now: its
    held work may be claimed again. Each day is claimed by one guarded UPDATE
    (``endpoint.budget_day_seen`` moves forward only), so overlapping sweeps announce it once.
    Returns how many digests were sent."""
    now = now or timezone.now()
    today = usage.spend_day(now)
    sent = 0
    candidates = Endpoint.objects.filter(active=True).filter(
        Q(budget_usd_per_day__isnull=False) | Q(budget_tokens_per_day__isnull=False)).filter(
        Q(budget_day_seen__isnull=True) | Q(budget_day_seen__lt=today))
    for endpoint in candidates:
        days = {today - timedelta(days=1)}
        if endpoint.budget_day_seen is not None:
            days.add(endpoint.budget_day_seen)
        if not endpoint_transitions.record_budget_day(endpoint.pk, today):
            continue  # an overlapping sweep took this day
        was_over = any(usage.is_over(endpoint, usage.spent_on([endpoint.pk], day)
                                     .get(endpoint.pk, (0, 0))) for day in days)
        if was_over and not usage.over_budget(endpoint, now):
            sent += bool(doorbells.send_digest(endpoint, "budget", now=now))
    return sent
