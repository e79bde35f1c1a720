"""Writes on endpoints and their credentials: vending and rotation."""

from datetime import timedelta

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from .models import (Credential, Endpoint, Presence, hash_credential, next_shift_boundary,
                     validate_shift_schedule)

DEFAULT_ROTATION_GRACE = timedelta(hours=24)


def _issue_credential(endpoint: Endpoint) -> str:
    credential = Credential.mint()
    Credential.objects.create(
        endpoint=endpoint, digest=hash_credential(credential), hint=credential[:12]
    )
    return credential


@transaction.atomic
def vend_endpoint(*, slug, owner, scope=None, verbs=None, default_lease_seconds=None, max_attempts=5,
                  accept_unverified=True):
    """Create an endpoint and its first credential. Returns ``(endpoint, credential)``; the
    plaintext credential exists only in this return value."""
    endpoint = Endpoint(slug=slug, owner=owner, max_attempts=max_attempts,
                        default_lease_seconds=default_lease_seconds,
                        accept_unverified=accept_unverified)
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


def set_presence(endpoint: Endpoint, presence: str, *, until=None, now=None) -> tuple[str, str]:
    """Clock ``endpoint`` in or out (§8). Returns its effective presence ``(before, after)``.

    Without ``until``: the manual state (agent verbs, board, admin actions, ``manage.py clock``
    without --until); on an endpoint with a shift schedule it holds until the next shift
    boundary, after which the schedule rules again. It never touches an operator override:
    an override with an expiry wins (§8) until it expires or the operator changes it. With
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
    its effective presence ``(before, after)``, read under the same row lock."""
    validate_shift_schedule(windows, timezone_name)
    now = now or timezone.now()
    with transaction.atomic():
        row = Endpoint.objects.select_for_update().get(pk=endpoint.pk)
        before = row.presence_at(now)
        row.shift_timezone, row.shift_schedule = timezone_name, windows
        row.save(update_fields=["shift_timezone", "shift_schedule"])
    endpoint.shift_timezone, endpoint.shift_schedule = timezone_name, windows
    return before, row.presence_at(now)


def record_presence_boundary(endpoint_id: int, boundary) -> bool:
    """Mark ``boundary`` handled for the endpoint; True for exactly one caller per boundary
    (the guarded UPDATE only moves the mark forward), however many sweeps overlap."""
    return Endpoint.objects.filter(pk=endpoint_id).filter(
        Q(presence_boundary_at__isnull=True) | Q(presence_boundary_at__lt=boundary)
    ).update(presence_boundary_at=boundary) == 1
