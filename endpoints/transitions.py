"""Writes on endpoints and their credentials: vending, rotation, scope, presence
(docs/reference.md#presence), paused work (docs/reference.md#pausing), concurrency caps
(docs/work-control.md#caps) and budgets (docs/reference.md#usage-and-budgets).

Presence and pause are the endpoint's own state: they change here, and a change that makes
waiting work receivable again (presence turned ``in``, work resumed) is announced after commit
through ``channels_push.bus.publish``; the push layer reacts with a digest. Nothing here imports
the doorbell.
"""

import logging
from datetime import timedelta

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from channels_push.bus import publish

from .models import (ALL_QUEUES, Credential, Endpoint, EndpointEvent, Presence, hash_credential,
                     next_shift_boundary, queue_name_validator, validate_budgets,
                     validate_claim_caps, validate_shift_schedule)

log = logging.getLogger("switchboard.endpoints")

DEFAULT_ROTATION_GRACE = timedelta(hours=24)


def _issue_credential(endpoint: Endpoint) -> str:
    credential = Credential.mint()
    Credential.objects.create(
        endpoint=endpoint, digest=hash_credential(credential), hint=credential[:12]
    )
    return credential


@transaction.atomic
def vend_endpoint(*, slug, owner, scope=None, verbs=None, default_lease_seconds=None, max_attempts=5,
                  accept_unverified=True, max_claimed=None):
    """Create an endpoint and its first credential. Returns ``(endpoint, credential)``; the
    plaintext credential exists only in this return value."""
    endpoint = Endpoint(slug=slug, owner=owner, max_attempts=max_attempts,
                        default_lease_seconds=default_lease_seconds,
                        accept_unverified=accept_unverified, max_claimed=max_claimed)
    if scope is not None:
        endpoint.scope = scope
    if verbs is not None:
        endpoint.verbs = verbs
    endpoint.full_clean()
    endpoint.save()
    return endpoint, _issue_credential(endpoint)


@transaction.atomic
def rotate_credential(endpoint: Endpoint, *, grace=DEFAULT_ROTATION_GRACE, now=None) -> str:
    """Mint a new credential; every credential still valid keeps working until ``now + grace``
    (never longer than it already had)."""
    now = now or timezone.now()
    grace_end = now + grace
    live = endpoint.credentials.filter(expires_at__isnull=True)
    live.update(expires_at=grace_end)
    endpoint.credentials.filter(expires_at__gt=grace_end).update(expires_at=grace_end)
    return _issue_credential(endpoint)


def rekey_credential(credential_id: int, credential: str) -> None:
    """Make credential row ``credential_id`` stand for ``credential`` (its digest and hint), for
    a credential derived from its own row, which exists only once the row does: the demo
    seed's, so that re-runs print the same one."""
    Credential.objects.filter(pk=credential_id).update(digest=hash_credential(credential),
                                                       hint=credential[:12])


def set_presence(endpoint: Endpoint, presence: str, *, until=None, now=None) -> tuple[str, str]:
    """Clock ``endpoint`` in or out (docs/reference.md#presence). Returns its effective presence
    ``(before, after)``.

    Without ``until``: the manual state (agent verbs, board, admin actions, ``manage.py clock``
    without --until); on an endpoint with a shift schedule it holds until the next shift
    boundary, after which the schedule rules again. It never touches an operator override:
    an override with an expiry wins until it expires or the operator changes it. With
    ``until``: that operator override, winning over everything until then.

    The row is locked while it is read and written, so two concurrent clock-ins agree on which
    one turned presence in (and only that one announces a digest).
    """
    if presence not in Presence.values:
        raise ValueError(f"presence must be one of {Presence.values}")
    now = now or timezone.now()
    with transaction.atomic():
        row = Endpoint.objects.select_for_update().get(pk=endpoint.pk)
        before = row.presence_at(now)
        if until is not None:
            if until <= now:
                raise ValueError("until must be in the future")
            row.presence_override, row.presence_override_until = presence, until
        else:
            row.presence_state = presence
            row.presence_hold_until = (
                next_shift_boundary(row.shift_schedule, row.shift_timezone, now)
                if row.has_schedule else None)
        row.save(update_fields=["presence_state", "presence_override", "presence_override_until",
                                "presence_hold_until"])
    for name in ("presence_state", "presence_override", "presence_override_until",
                 "presence_hold_until"):
        setattr(endpoint, name, getattr(row, name))
    return before, row.presence_at(now)


def set_shift_schedule(endpoint: Endpoint, *, timezone_name: str, windows: list,
                       now=None) -> tuple[str, str]:
    """Replace ``endpoint``'s shift schedule (validated as the model's clean() does: at most
    SWITCHBOARD_MAX_SHIFT_WINDOWS windows; raises ValidationError, writing nothing). Returns
    its effective presence ``(before, after)``, read under the same row lock; when that turned
    presence in, waiting work arrives as one digest (reason ``operator``) after commit."""
    validate_shift_schedule(windows, timezone_name)
    now = now or timezone.now()
    with transaction.atomic():
        row = Endpoint.objects.select_for_update().get(pk=endpoint.pk)
        before = row.presence_at(now)
        row.shift_timezone, row.shift_schedule = timezone_name, windows
        row.save(update_fields=["shift_timezone", "shift_schedule"])
        endpoint.shift_timezone, endpoint.shift_schedule = timezone_name, windows
        _announce_if_turned_in(endpoint, before, row.presence_at(now), reason="operator", now=now)
    return before, row.presence_at(now)


def record_presence_boundary(endpoint_id: int, boundary) -> bool:
    """Mark ``boundary`` handled for the endpoint; True for exactly one caller per boundary
    (the guarded UPDATE only moves the mark forward), however many sweeps overlap."""
    return Endpoint.objects.filter(pk=endpoint_id).filter(
        Q(presence_boundary_at__isnull=True) | Q(presence_boundary_at__lt=boundary)
    ).update(presence_boundary_at=boundary) == 1


def _announce_if_turned_in(endpoint, before: str, after: str, *, reason: str, now) -> None:
    if before == Presence.OUT and after == Presence.IN:
        publish.publish_endpoint_on_commit(endpoint, "presence_in", reason=reason, now=now)


def clock(endpoint: Endpoint, presence: str, *, reason: str, until=None, now=None) -> str:
    """Clock ``endpoint`` in or out (agent verb: ``reason="clock_in"``; board, admin and
    ``manage.py clock``: ``reason="operator"``). When that turned its effective presence in,
    the push layer sends the digest after commit. Returns the effective presence (an operator
    override still in force wins over a manual clock: see ``presence_report``)."""
    now = now or timezone.now()
    with transaction.atomic():
        before, after = set_presence(endpoint, presence, until=until, now=now)
        _announce_if_turned_in(endpoint, before, after, reason=reason, now=now)
    log.info("endpoint clocked", extra={"endpoint": endpoint.slug, "clocked": presence,
                                        "presence": after,
                                        "by": "agent" if reason == "clock_in" else reason})
    return after


def clear_override(endpoint: Endpoint, *, now=None) -> str:
    """Lift the operator override: the schedule or manual state rules again at once (a digest,
    reason ``operator``, when that turned presence in). Returns the effective presence."""
    now = now or timezone.now()
    with transaction.atomic():
        row = Endpoint.objects.select_for_update().get(pk=endpoint.pk)
        before = row.presence_at(now)
        row.presence_override, row.presence_override_until = "", None
        row.save(update_fields=["presence_override", "presence_override_until"])
        endpoint.presence_override, endpoint.presence_override_until = "", None
        after = row.presence_at(now)
        _announce_if_turned_in(endpoint, before, after, reason="operator", now=now)
    log.info("endpoint override cleared", extra={"endpoint": endpoint.slug, "presence": after})
    return after


def announce_edited_presence(endpoint: Endpoint, before: str, *, now) -> None:
    """An operator edited the override or schedule (admin): announce presence turning in like
    a clock-in by the operator (the boundary sweep only sees boundaries in time)."""
    _announce_if_turned_in(endpoint, before, endpoint.presence_at(now), reason="operator", now=now)


def override_in_force(endpoint: Endpoint, now):
    """The override's end when an operator override governs presence at ``now``, else None."""
    if endpoint.presence_override and endpoint.presence_override_until \
            and now < endpoint.presence_override_until:
        return endpoint.presence_override_until
    return None


def presence_report(endpoint: Endpoint, *, now=None) -> dict:
    """``{"presence", "override_until"}``: the effective presence and, when an operator
    override decides it, until when (ISO-8601 UTC; None without one) — so a clock_in that
    changed nothing says why."""
    now = now or timezone.now()
    until = override_in_force(endpoint, now)
    return {"presence": endpoint.presence_at(now),
            "override_until": until.isoformat().replace("+00:00", "Z") if until else None}


# -- scope ---------------------------------------------------------------------------------------


def set_scope(endpoint: Endpoint, scope: list) -> Endpoint:
    """Change the queues ``endpoint`` may see. Refused (ValidationError naming them) while
    webhook routes target queues outside the new scope (``Endpoint.clean``); the row is locked
    so a concurrent narrowing and route creation are serialized on it."""
    with transaction.atomic():
        row = Endpoint.objects.select_for_update().get(pk=endpoint.pk)
        row.scope = list(scope)
        row.full_clean()
        row.save(update_fields=["scope"])
    endpoint.scope = row.scope
    return endpoint


# -- paused work ---------------------------------------------------------------------------------


def _record(endpoint, action: str, *, queue: str, actor: str, now, detail=None) -> None:
    EndpointEvent.objects.create(endpoint=endpoint, action=action, queue=queue, actor=actor,
                                 at=now, detail=detail or {})


def pause_work(endpoint: Endpoint, *, queue: str | None = None, actor: str, now=None) -> list:
    """Pause the whole endpoint (``queue`` None) or one queue of it. While paused, claim_next
    skips the queue, claim refuses ``paused``, doorbells and sweeps hold (ring budget
    untouched); ingest and leases already held go on. Recorded as an event. Returns the
    endpoint's paused list (``["*"]`` for all)."""
    now = now or timezone.now()
    if queue is not None:
        # A name no queue can have (a NUL, say, which PostgreSQL refuses mid-write) is an
        # operator's typo to report, not a failed write.
        queue_name_validator(queue)
    if queue is not None and not endpoint.covers(queue):
        raise ValidationError(f"queue {queue!r} is outside endpoint {endpoint.slug}'s scope "
                              f"{endpoint.scope}")
    with transaction.atomic():
        row = Endpoint.objects.select_for_update().get(pk=endpoint.pk)
        paused = list(row.paused_queues or [])
        if queue is None:
            paused = [ALL_QUEUES]
        elif not row.is_paused(queue):
            paused = sorted({*paused, queue})
        changed = paused != list(row.paused_queues or [])
        if changed:
            row.paused_queues = paused
            row.save(update_fields=["paused_queues"])
            _record(row, "pause", queue=queue or ALL_QUEUES, actor=actor, now=now)
    endpoint.paused_queues = paused
    log.info("endpoint paused", extra={"endpoint": endpoint.slug, "queue": queue or ALL_QUEUES,
                                       "by": actor, "changed": changed})
    return paused


def resume_work(endpoint: Endpoint, *, queue: str | None = None, actor: str, now=None) -> list:
    """Resume the whole endpoint (``queue`` None: every pause lifted) or one paused queue.
    When anything resumed, the push layer sends one digest (reason ``resumed``) after commit
    if work waited. Refuses (ValueError) to resume one queue of a wholly paused endpoint.
    Returns the endpoint's paused list."""
    now = now or timezone.now()
    with transaction.atomic():
        row = Endpoint.objects.select_for_update().get(pk=endpoint.pk)
        before = list(row.paused_queues or [])
        if queue is None:
            paused = []
        elif row.paused_all:
            raise ValueError(f"all of {endpoint.slug} is paused; resume it without a queue")
        else:
            paused = [name for name in before if name != queue]
        changed = paused != before
        if changed:
            row.paused_queues = paused
            row.save(update_fields=["paused_queues"])
            _record(row, "resume", queue=queue or ALL_QUEUES, actor=actor, now=now)
            endpoint.paused_queues = paused
            publish.publish_endpoint_on_commit(endpoint, "resumed", reason="resumed", now=now)
    endpoint.paused_queues = paused
    log.info("endpoint resumed", extra={"endpoint": endpoint.slug, "queue": queue or ALL_QUEUES,
                                        "by": actor, "changed": changed})
    return paused


# -- concurrency caps (docs/work-control.md#caps) -----------------------------------------------

# set_claim_caps: leave max_claimed as it is (None means "unlimited", so it cannot say that).
UNCHANGED = object()


def set_claim_caps(endpoint: Endpoint, *, max_claimed=UNCHANGED, queue_limits=None, actor: str,
                   now=None) -> Endpoint:
    """Change ``endpoint``'s caps on claimed todos: ``max_claimed`` (None: unlimited) and the
    per-queue caps in ``queue_limits`` (``{queue: n}``, n None: that queue's cap removed;
    queues not named keep theirs). Raises ValidationError naming the field for a negative or
    non-integer cap, a bad queue name or a queue outside the endpoint's scope; writes nothing
    then. Recorded as a ``limit`` event. A lowered cap takes effect with the next claim (the
    claims already held go on); a raised one at the next claim or long-poll re-check."""
    now = now or timezone.now()
    for queue in queue_limits or {}:
        try:
            queue_name_validator(queue)
        except ValidationError as bad:
            raise ValidationError({"queue_limits": f"bad queue name {queue!r}: "
                                                   + " ".join(bad.messages)}) from None
        if not endpoint.covers(queue):
            raise ValidationError({"queue_limits": f"queue {queue!r} is outside endpoint "
                                                   f"{endpoint.slug}'s scope {endpoint.scope}"})
    with transaction.atomic():
        row = Endpoint.objects.select_for_update().get(pk=endpoint.pk)
        before = {"max_claimed": row.max_claimed, "queue_limits": dict(row.queue_limits or {})}
        if max_claimed is not UNCHANGED:
            row.max_claimed = max_claimed
        limits = dict(row.queue_limits or {})
        for queue, cap in (queue_limits or {}).items():
            if cap is None:
                limits.pop(queue, None)
            else:
                limits[queue] = cap
        row.queue_limits = dict(sorted(limits.items()))
        validate_claim_caps(row.max_claimed, row.queue_limits)
        after = {"max_claimed": row.max_claimed, "queue_limits": row.queue_limits}
        if after != before:
            row.save(update_fields=["max_claimed", "queue_limits"])
            _record(row, "limit", queue="", actor=actor, now=now,
                    detail={"before": before, "after": after})
    endpoint.max_claimed, endpoint.queue_limits = row.max_claimed, row.queue_limits
    log.info("endpoint caps set", extra={"endpoint": endpoint.slug, "by": actor, **after})
    return endpoint


# -- budgets (docs/reference.md#usage-and-budgets) ------------------------------------------------


# The budgets an endpoint has, and of them the daily ones (a raise of which may lift a hold).
BUDGET_FIELDS = ("budget_usd_per_day", "budget_tokens_per_day", "max_cost_usd")
DAILY_BUDGET_FIELDS = ("budget_usd_per_day", "budget_tokens_per_day")


def set_budget(endpoint: Endpoint, *, budget_usd_per_day=UNCHANGED, budget_tokens_per_day=UNCHANGED,
               max_cost_usd=UNCHANGED, actor: str, now=None) -> dict:
    """Change ``endpoint``'s daily budgets and its per-todo ``max_cost_usd`` (None: none; a
    field left UNCHANGED keeps its value). Raises ValidationError naming the field for a value
    out of range, writing nothing. Recorded and announced by ``record_edited_budget``. Returns
    the budgets before the change. Reading the day's spend is the caller's
    (``todos.usage.set_endpoint_budget``): spend is a todo record."""
    now = now or timezone.now()
    given = dict(zip(BUDGET_FIELDS, (budget_usd_per_day, budget_tokens_per_day, max_cost_usd)))
    with transaction.atomic():
        row = Endpoint.objects.select_for_update().get(pk=endpoint.pk)
        before = {name: getattr(row, name) for name in BUDGET_FIELDS}
        changes = {name: value for name, value in given.items() if value is not UNCHANGED}
        checked = validate_budgets(**{**before, **changes})
        for name in changes:
            setattr(row, name, checked[name])
        if record_edited_budget(row, before, actor=actor, now=now):
            row.save(update_fields=list(BUDGET_FIELDS))
    for name in BUDGET_FIELDS:
        setattr(endpoint, name, getattr(row, name))
    log.info("endpoint budget set", extra={"endpoint": endpoint.slug, "by": actor,
                                           **_budget_detail(checked)})
    return before


def record_edited_budget(endpoint: Endpoint, before: dict, *, actor: str, now) -> bool:
    """``endpoint``'s budgets (its attributes) were changed from ``before`` (``set_budget``,
    the admin's form), inside the caller's transaction: record a ``budget`` event, and
    announce a raised or removed daily budget after commit with the budgets ``before``, so the
    push layer can tell whether they held the endpoint (it then sends one digest, reason
    ``budget``). False, doing nothing, when nothing changed."""
    after = {name: getattr(endpoint, name) for name in BUDGET_FIELDS}
    if after == before:
        return False
    _record(endpoint, "budget", queue="", actor=actor, now=now,
            detail={"before": _budget_detail(before), "after": _budget_detail(after)})
    if any(before[name] is not None and (after[name] is None or after[name] > before[name])
           for name in DAILY_BUDGET_FIELDS):
        publish.publish_endpoint_on_commit(
            endpoint, "budget_raised", reason="budget", now=now,
            before={name: before[name] for name in DAILY_BUDGET_FIELDS})
    return True


def _budget_detail(budgets: dict) -> dict:
    return {name: (None if value is None else str(value) if not isinstance(value, int) else value)
            for name, value in budgets.items()}


def record_budget_day(endpoint_id: int, day) -> bool:
    """Mark UTC ``day`` seen by the budget day-turn sweep; True for exactly one caller per day
    (the guarded UPDATE only moves the mark forward), however many sweeps overlap."""
    return Endpoint.objects.filter(pk=endpoint_id).filter(
        Q(budget_day_seen__isnull=True) | Q(budget_day_seen__lt=day)
    ).update(budget_day_seen=day) == 1
