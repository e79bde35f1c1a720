"""Endpoints: what an operator vends to one agent (docs/agents.md)."""

import hashlib
import re
import secrets
from datetime import datetime, time, timedelta
from decimal import ROUND_DOWN, Decimal, InvalidOperation
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator
from django.db import models

AGENT_VERBS = (
    "list_todos",
    "claim",
    "claim_next",
    "heartbeat",
    "complete",
    "fail",
    "cancel",
    "release",
    "post_update",
    "read_secret",
    "clock_in",
    "clock_out",
)
ALL_QUEUES = "*"
QUEUE_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$"
queue_name_validator = RegexValidator(QUEUE_NAME_RE, "queue names are 1-64 of A-Z a-z 0-9 _ . -")

CREDENTIAL_PREFIX = "sbk_"

# The ranges of the numbers an operator sets (docs/reference.md#number-ranges), checked where
# they come in so that no stored value can break a later request.
MAX_CLAIM_CAP = 10_000
MAX_ATTEMPTS_LIMIT = 100
MAX_LEASE_SECONDS = 86_400
MAX_APPROVAL_TIMEOUT_SECONDS = 365 * 86_400


class Presence(models.TextChoices):
    IN = "in"
    OUT = "out"


# -- shift schedules (docs/reference.md#presence): weekly windows in an IANA time zone ----------
#
# Wall-clock windows become instants per date with zoneinfo, so a shift keeps its local hours
# across a DST change; an end at or before the start runs past midnight.

WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_HHMM_RE = re.compile(r"^([01][0-9]|2[0-3]):([0-5][0-9])$|^24:00$")


def _clock_time(text: str) -> tuple[time, int]:
    """("HH:MM") -> (time, extra days): "24:00" is 00:00 of the next day."""
    if text == "24:00":
        return time(0, 0), 1
    hours, minutes = text.split(":")
    return time(int(hours), int(minutes)), 0


def validate_shift_schedule(schedule, timezone_name: str) -> None:
    """Raise ValidationError unless ``schedule`` is a list of at most
    SWITCHBOARD_MAX_SHIFT_WINDOWS well-formed windows and ``timezone_name`` an IANA zone
    (required as soon as there is a window)."""
    if not isinstance(schedule, list):
        raise ValidationError({"shift_schedule": "a list of {day, start, end} windows"})
    # Checked first: every clock in/out derives all windows under the endpoint's row lock.
    cap = settings.SWITCHBOARD_MAX_SHIFT_WINDOWS
    if len(schedule) > cap:
        raise ValidationError({"shift_schedule": f"at most {cap} windows, got {len(schedule)}"})
    for window in schedule:
        if (not isinstance(window, dict) or set(window) != {"day", "start", "end"}
                or window["day"] not in WEEKDAYS
                or not all(isinstance(window[k], str) and _HHMM_RE.match(window[k])
                           for k in ("start", "end"))
                or window["start"] == "24:00"):
            raise ValidationError({"shift_schedule": f"bad window {window!r}: expected "
                                   '{"day": "mon".."sun", "start": "HH:MM", "end": "HH:MM"}'})
    if schedule:
        try:
            ZoneInfo(timezone_name or "")
        except (ZoneInfoNotFoundError, ValueError):
            raise ValidationError({"shift_timezone": f"not an IANA time zone: {timezone_name!r}"})


def shift_windows(schedule, timezone_name: str, start: datetime, end: datetime):
    """Every shift window ``(begins, ends)`` (aware UTC instants) that overlaps [start, end],
    in order of beginning."""
    zone = ZoneInfo(timezone_name)
    by_weekday = {day: [] for day in WEEKDAYS}
    for window in schedule:
        begin_time, _ = _clock_time(window["start"])
        end_time, extra = _clock_time(window["end"])
        if extra == 0 and end_time <= begin_time:
            extra = 1  # runs past midnight
        by_weekday[window["day"]].append((begin_time, end_time, extra))
    first = start.astimezone(zone).date() - timedelta(days=2)
    last = end.astimezone(zone).date() + timedelta(days=1)
    windows = []
    day = first
    while day <= last:
        for begin_time, end_time, extra in by_weekday[WEEKDAYS[day.weekday()]]:
            begins = datetime.combine(day, begin_time, tzinfo=zone).astimezone(ZoneInfo("UTC"))
            ends = datetime.combine(day + timedelta(days=extra), end_time,
                                    tzinfo=zone).astimezone(ZoneInfo("UTC"))
            if begins < ends and ends >= start and begins <= end:
                windows.append((begins, ends))
        day += timedelta(days=1)
    return sorted(windows)


def on_shift(schedule, timezone_name: str, now: datetime) -> bool:
    return any(begins <= now < ends for begins, ends in shift_windows(schedule, timezone_name, now, now))


def shift_boundaries(schedule, timezone_name: str, start: datetime, end: datetime):
    """Instants in (start, end] where the schedule's on/off state changes, each with the
    state it changes to: ``[(instant, "in" | "out")]``. Touching or overlapping windows merge.

    One pass over the windows in order of beginning: each either extends the running shift
    (it begins at or before the running end) or closes it and opens the next, so the shift's
    edges are the boundaries. The windows overlapping [start, end] are all that can decide a
    state inside it."""
    changes = []
    running = None  # (begins, ends) of the merged shift being extended
    for begins, ends in shift_windows(schedule, timezone_name, start, end) + [(None, None)]:
        if running is not None and begins is not None and begins <= running[1]:
            running = (running[0], max(running[1], ends))
            continue
        if running is not None:
            if start < running[0] <= end:
                changes.append((running[0], Presence.IN))
            if start < running[1] <= end:
                changes.append((running[1], Presence.OUT))
        running = (begins, ends)
    return changes


def next_shift_boundary(schedule, timezone_name: str, now: datetime):
    """The first instant after ``now`` where the schedule's state changes (None: never, within
    two weeks)."""
    changes = shift_boundaries(schedule, timezone_name, now, now + timedelta(days=15))
    return changes[0][0] if changes else None


def _is_cap(value) -> bool:
    return (not isinstance(value, bool) and isinstance(value, int)
            and 0 <= value <= MAX_CLAIM_CAP)


def validate_claim_caps(max_claimed, queue_limits) -> None:
    """Raise ValidationError naming the field unless ``max_claimed`` is None or a whole number
    from 0 to MAX_CLAIM_CAP and ``queue_limits`` maps queue names to such numbers. A cap of 0
    holds every claim back (the held leases go on), which is a pause that still lets work
    arrive."""
    if max_claimed is not None and not _is_cap(max_claimed):
        raise ValidationError({"max_claimed": f"a whole number from 0 to {MAX_CLAIM_CAP}, or "
                                              f"unset; got {str(max_claimed)[:40]!r}"})
    if not isinstance(queue_limits, dict):
        raise ValidationError({"queue_limits": 'an object of queue name -> cap, e.g. {"deploys": 1}'})
    for queue, cap in queue_limits.items():
        if not re.match(QUEUE_NAME_RE, str(queue)):
            raise ValidationError({"queue_limits": f"bad queue name {queue!r}: "
                                                   f"{queue_name_validator.message}"})
        if not _is_cap(cap):
            raise ValidationError({"queue_limits": f"cap of queue {queue!r} must be a whole "
                                                   f"number from 0 to {MAX_CLAIM_CAP}; got "
                                                   f"{str(cap)[:40]!r}"})


# Budget ranges (docs/reference.md#usage-and-budgets): wide enough for any fleet, narrow enough
# that a typo of a few digits is refused rather than taken as "no budget".
MAX_BUDGET_USD_PER_DAY = Decimal("1000000")
MAX_BUDGET_TOKENS_PER_DAY = 10**12
MAX_COST_USD_PER_TODO = Decimal("10000")


def _as_decimal(value):
    """A finite Decimal of ``value`` (int, float, Decimal or numeric text), else None."""
    if isinstance(value, bool):
        return None
    try:
        number = Decimal(str(value)) if isinstance(value, (int, float, str)) else value
    except InvalidOperation:
        return None
    return number if isinstance(number, Decimal) and number.is_finite() else None


def check_usd(value, field: str, maximum: Decimal) -> Decimal | None:
    """``value`` as Decimal USD between 0 and ``maximum`` with at most 6 decimal places (None
    stays None); ValidationError naming ``field`` otherwise."""
    if value is None:
        return None
    number = _as_decimal(value)
    if (number is None or not 0 <= number <= maximum
            or number != number.quantize(Decimal("0.000001"), rounding=ROUND_DOWN)):
        raise ValidationError({field: f"a number of US dollars from 0 to {maximum} (at most 6 "
                                      f"decimal places), or unset; got {value!r}"})
    return number


def check_tokens(value, field: str) -> int | None:
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, int)
            or not 0 <= value <= MAX_BUDGET_TOKENS_PER_DAY):
        raise ValidationError({field: f"a whole number of tokens from 0 to "
                                      f"{MAX_BUDGET_TOKENS_PER_DAY}, or unset; got {value!r}"})
    return value


def validate_budgets(*, budget_usd_per_day, budget_tokens_per_day, max_cost_usd) -> dict:
    """The three as stored (dollars as Decimal); ValidationError naming the field unless each
    is unset or within its range."""
    return {"budget_usd_per_day": check_usd(budget_usd_per_day, "budget_usd_per_day",
                                            MAX_BUDGET_USD_PER_DAY),
            "budget_tokens_per_day": check_tokens(budget_tokens_per_day, "budget_tokens_per_day"),
            "max_cost_usd": check_usd(max_cost_usd, "max_cost_usd", MAX_COST_USD_PER_TODO)}


def default_scope():
    return [ALL_QUEUES]


def default_verbs():
    return list(AGENT_VERBS)


def hash_credential(credential: str) -> str:
    """Credentials are 256-bit random tokens, so one SHA-256 is enough (no stretching needed:
    there is nothing to brute-force). Stored and looked up by this digest only."""
    return hashlib.sha256(credential.encode()).hexdigest()


class Endpoint(models.Model):
    slug = models.SlugField(max_length=64, unique=True)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="endpoints"
    )
    # Queue names this endpoint may see; ["*"] grants every queue of the endpoint.
    scope = models.JSONField(default=default_scope)
    verbs = models.JSONField(default=default_verbs)
    default_lease_seconds = models.PositiveIntegerField(
        null=True, blank=True, help_text="Empty: the server default (SWITCHBOARD_DEFAULT_LEASE_SECONDS)."
    )
    max_attempts = models.PositiveSmallIntegerField(default=5)
    active = models.BooleanField(default=True)
    # Off: claim, claim_next and list_todos never hand out an unverified todo (anyone who
    # knows an unsigned webhook's URL can create one); it waits on the board, where the
    # operator can promote it. On by default: the seeds make every pending todo visible.
    accept_unverified = models.BooleanField(
        default=True, help_text="Hand unverified todos (from unsigned webhooks) to agents. Off: "
                                "they wait on the board until an operator promotes one.")
    created_at = models.DateTimeField(auto_now_add=True)
    # Presence (docs/reference.md#presence). Effective presence = an unexpired override, else the
    # shift schedule (when there is one; a clock in/out holds against it until presence_hold_until),
    # else the manual state. See presence_at().
    presence_state = models.CharField(
        max_length=3, choices=Presence.choices, default=Presence.IN,
        help_text="Manual state, set by clock in/out (agent verbs, board, admin, manage.py clock).")
    presence_override = models.CharField(
        max_length=3, choices=Presence.choices, blank=True, default="",
        help_text="Operator override; wins over everything until presence_override_until.")
    presence_override_until = models.DateTimeField(null=True, blank=True)
    shift_timezone = models.CharField(max_length=64, blank=True, default="",
                                      help_text="IANA time zone of the shift schedule, e.g. Europe/Berlin.")
    shift_schedule = models.JSONField(
        default=list, blank=True,
        help_text='Weekly windows, e.g. [{"day": "mon", "start": "09:00", "end": "17:00"}]. '
                  "Empty: no schedule.")
    # A clock in/out on a scheduled endpoint holds until the next shift boundary.
    presence_hold_until = models.DateTimeField(null=True, blank=True)
    # The last presence boundary (shift change, override end) the boundary sweep handled:
    # advanced by one guarded UPDATE, so overlapping sweeps announce a boundary exactly once.
    presence_boundary_at = models.DateTimeField(null=True, blank=True)
    # Paused work (docs/reference.md#pausing): queue names an operator paused, or ["*"] for the
    # whole endpoint. claim_next skips them, claim refuses ``paused``, doorbells and sweeps hold;
    # ingest and held leases go on. Written only by transitions.pause_work / resume_work.
    paused_queues = models.JSONField(default=list, blank=True)
    # Concurrency caps (docs/work-control.md#caps), enforced inside the claim statement
    # (todos.statements.claim_cap_guard); written by set_claim_caps.
    max_claimed = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="At most this many todos claimed at once (empty: unlimited).")
    queue_limits = models.JSONField(
        default=dict, blank=True,
        help_text='Per-queue caps on claimed todos, e.g. {"deploys": 1}.')
    # The approval gate (docs/work-control.md#approval): a todo awaiting approval longer than this
    # is cancelled by the approval-timeout sweep (todos.sweeps.cancel_stale_approvals). Empty: it
    # waits forever.
    approval_timeout_seconds = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="Cancel todos awaiting approval longer than this. Empty: they wait forever.")
    # Budgets (docs/reference.md#usage-and-budgets): at or over either one on the current UTC
    # day, claims are refused (over_budget) and doorbells hold. Checked inside the claim
    # statement (todos.usage.budget_guard_sql); written by set_budget.
    budget_usd_per_day = models.DecimalField(
        max_digits=14, decimal_places=6, null=True, blank=True,
        help_text="Daily spend (USD, UTC days) at which claims stop. Empty: no budget.")
    budget_tokens_per_day = models.BigIntegerField(
        null=True, blank=True,
        help_text="Daily tokens (input + output, UTC days) at which claims stop. Empty: no budget.")
    max_cost_usd = models.DecimalField(
        max_digits=12, decimal_places=6, null=True, blank=True,
        help_text="Per todo: an attempt that takes a todo's cost past this dead-letters it. "
                  "Empty: no limit.")
    # The last UTC day the budget day-turn sweep handled (one guarded UPDATE moves it forward,
    # so overlapping sweeps send the day's digest once).
    budget_day_seen = models.DateField(null=True, blank=True)

    class Meta:
        ordering = ["slug"]
        indexes = [
            # channels_push.doorbells.sweeps.announce_presence_boundaries: only endpoints that
            # have a schedule or an override can cross a presence boundary.
            models.Index(
                fields=["presence_boundary_at"], name="endpoint_presence_boundary",
                condition=~models.Q(shift_timezone="") | models.Q(presence_override_until__isnull=False),
            ),
            # channels_push.doorbells.sweeps.announce_budget_day_turns: only endpoints with a
            # daily budget have a day turn to announce.
            models.Index(
                fields=["budget_day_seen"], name="endpoint_budget_day_turn",
                condition=(models.Q(budget_usd_per_day__isnull=False)
                           | models.Q(budget_tokens_per_day__isnull=False)),
            ),
        ]

    def __str__(self):
        return self.slug

    def clean(self):
        if not isinstance(self.scope, list) or not self.scope:
            raise ValidationError({"scope": 'a non-empty list of queue names, or ["*"]'})
        bad = [n for n in self.scope if n != ALL_QUEUES and not re.match(QUEUE_NAME_RE, str(n))]
        if bad:
            raise ValidationError({"scope": f"bad queue names {bad}: {queue_name_validator.message}"})
        if not isinstance(self.verbs, list) or not self.verbs:
            raise ValidationError({"verbs": "at least one verb (an allowlist never means 'all')"})
        unknown = set(self.verbs) - set(AGENT_VERBS)
        if unknown:
            raise ValidationError({"verbs": f"unknown verbs: {sorted(unknown)}"})
        if not 1 <= self.max_attempts <= MAX_ATTEMPTS_LIMIT:
            raise ValidationError({"max_attempts": f"from 1 to {MAX_ATTEMPTS_LIMIT}"})
        if (self.default_lease_seconds is not None
                and not 1 <= self.default_lease_seconds <= MAX_LEASE_SECONDS):
            raise ValidationError({"default_lease_seconds": f"between 1 and {MAX_LEASE_SECONDS}"})
        if (self.approval_timeout_seconds is not None
                and not 1 <= self.approval_timeout_seconds <= MAX_APPROVAL_TIMEOUT_SECONDS):
            raise ValidationError({"approval_timeout_seconds": (
                f"at least 1 second and at most {MAX_APPROVAL_TIMEOUT_SECONDS} (365 days), "
                "or empty")})
        validate_shift_schedule(self.shift_schedule, self.shift_timezone)
        validate_claim_caps(self.max_claimed, self.queue_limits)
        validate_budgets(budget_usd_per_day=self.budget_usd_per_day,
                         budget_tokens_per_day=self.budget_tokens_per_day,
                         max_cost_usd=self.max_cost_usd)
        self._check_routes_in_scope()
        if self.presence_override and self.presence_override_until is None:
            raise ValidationError({"presence_override_until": "an override needs an expiry"})

    def presence_at(self, now) -> str:
        """Effective presence at ``now``: override > schedule (unless a clock hold is
        running) > manual state."""
        if self.presence_override and self.presence_override_until and now < self.presence_override_until:
            return self.presence_override
        if self.has_schedule:
            if self.presence_hold_until and now < self.presence_hold_until:
                return self.presence_state
            return Presence.IN if on_shift(self.shift_schedule, self.shift_timezone, now) else Presence.OUT
        return self.presence_state

    @property
    def has_schedule(self) -> bool:
        """A usable schedule: windows and a known zone (clean() rejects anything else, so an
        unknown zone only shows up in an unsaved, invalid form)."""
        if not self.shift_schedule or not self.shift_timezone:
            return False
        try:
            ZoneInfo(self.shift_timezone)
        except (ZoneInfoNotFoundError, ValueError):
            return False
        return True

    def presence_changes(self, start, end) -> list:
        """Where effective presence may change in (start, end]: shift boundaries, the
        override's end and the hold's end, each as ``(instant, reason)`` in order; reason is
        ``shift`` or ``override_end``."""
        instants = []
        if self.has_schedule:
            instants += [(t, "shift") for t, _ in
                         shift_boundaries(self.shift_schedule, self.shift_timezone, start, end)]
            if self.presence_hold_until and start < self.presence_hold_until <= end:
                instants.append((self.presence_hold_until, "shift"))
        if self.presence_override and self.presence_override_until and \
                start < self.presence_override_until <= end:
            instants.append((self.presence_override_until, "override_end"))
        return sorted(instants)

    def _check_routes_in_scope(self):
        """A narrower scope is refused while webhook routes still target queues outside it:
        their deliveries would create todos no agent of this endpoint can see (and nobody would
        be rung for). Routes reach endpoints by their reverse relation (ingest depends on
        endpoints, not the other way round)."""
        if self.pk is None or not isinstance(self.scope, list) or ALL_QUEUES in self.scope:
            return
        stranded = sorted(self.routes.exclude(queue__in=[str(n) for n in self.scope])
                          .values_list("webhook__slug", "queue"))
        if stranded:
            named = ", ".join(f"{webhook} -> {queue}" for webhook, queue in stranded)
            raise ValidationError({"scope": f"routes still deliver outside this scope ({named}); "
                                            "remove or retarget them first"})

    @property
    def all_queues(self) -> bool:
        return ALL_QUEUES in self.scope

    # -- paused work ---------------------------------------------------------------------------

    @property
    def paused_all(self) -> bool:
        return ALL_QUEUES in (self.paused_queues or [])

    def is_paused(self, queue: str) -> bool:
        return self.paused_all or queue in (self.paused_queues or [])

    def unpaused(self, queues):
        """``queues`` (None: every queue of the endpoint) without the paused ones; None again
        when nothing among every queue is excluded by name."""
        if queues is None:
            return None
        return [queue for queue in queues if not self.is_paused(queue)]

    def paused_among(self, queues) -> list:
        """When EVERY queue of ``queues`` (None: all of the endpoint's queues) is paused, what
        to tell the caller (``["*"]`` or the paused names); else ``[]``."""
        if self.paused_all:
            return [ALL_QUEUES]
        if queues is None or not queues:
            return []
        return sorted(queues) if all(self.is_paused(queue) for queue in queues) else []

    # -- concurrency caps ----------------------------------------------------------------------

    @property
    def has_budget(self) -> bool:
        return self.budget_usd_per_day is not None or self.budget_tokens_per_day is not None

    @property
    def has_claim_caps(self) -> bool:
        return self.max_claimed is not None or bool(self.queue_limits)

    def covers(self, queue: str) -> bool:
        return self.all_queues or queue in self.scope

    def allows(self, verb: str) -> bool:
        return verb in self.verbs

    @property
    def effective_lease(self) -> timedelta:
        if self.default_lease_seconds:
            return timedelta(seconds=self.default_lease_seconds)
        return settings.SWITCHBOARD_DEFAULT_LEASE


class Credential(models.Model):
    """A bearer credential, stored as its SHA-256 digest only (shown once at vending).

    Rotation sets ``expires_at`` on the old credential (the grace period) and mints a new one
    with no expiry, so both work until the grace ends.
    """

    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="credentials")
    digest = models.CharField(max_length=64, unique=True)
    # First characters of the token, to tell credentials apart in the admin without the secret.
    hint = models.CharField(max_length=16)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)

    def __str__(self):
        return f"{self.hint}… ({self.endpoint.slug})"

    @staticmethod
    def mint() -> str:
        return CREDENTIAL_PREFIX + secrets.token_urlsafe(32)


class EndpointEvent(models.Model):
    """An operator's change to how an endpoint takes work (pause, resume): who, when, what."""

    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="events")
    action = models.CharField(max_length=32)
    queue = models.CharField(max_length=64, blank=True, default="")
    actor = models.CharField(max_length=200)
    at = models.DateTimeField()
    detail = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at", "-id"]

    def __str__(self):
        return f"{self.endpoint_id} {self.action} {self.queue or '*'}"
