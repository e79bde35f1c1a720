"""Writes on endpoints and their credentials: vending and rotation."""

from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from .models import Credential, Endpoint, hash_credential

DEFAULT_ROTATION_GRACE = timedelta(hours=24)


def _issue_credential(endpoint: Endpoint) -> str:
    credential = Credential.mint()
    Credential.objects.create(
        endpoint=endpoint, digest=hash_credential(credential), hint=credential[:12]
    )
    return credential


@transaction.atomic
def vend_endpoint(*, slug, owner, scope=None, verbs=None, default_lease_seconds=None, max_attempts=5):
    """Create an endpoint and its first credential. Returns ``(endpoint, credential)``; the
    plaintext credential exists only in this return value."""
    endpoint = Endpoint(slug=slug, owner=owner, max_attempts=max_attempts,
                        default_lease_seconds=default_lease_seconds)
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
