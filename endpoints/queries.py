"""Reads on endpoints shared by the MCP transport, the board and the commands."""

from django.db.models import Q
from django.utils import timezone

from .models import Credential, Endpoint, hash_credential


def find_endpoint_for_credential(slug: str, credential: str, *, now=None) -> Endpoint | None:
    """The active endpoint ``slug`` if ``credential`` is one of its live credentials, else None.

    Looked up by digest (an index probe, no timing signal about other endpoints); the digest is
    compared again in constant time so a future change of lookup cannot open a timing oracle.
    """
    if not credential:
        return None
    now = now or timezone.now()
    match = (
        Credential.objects.select_related("endpoint")
        .filter(digest=hash_credential(credential), endpoint__slug=slug, endpoint__active=True)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .first()
    )
    if match is None or not match.matches(credential):
        return None
    return match.endpoint


def get_endpoint(slug: str) -> Endpoint:
    return Endpoint.objects.get(slug=slug)


def visible_endpoints(user):
    """The endpoints an operator may see and act on: their own; a superuser sees all."""
    if not getattr(user, "is_authenticated", False):
        return Endpoint.objects.none()
    if user.is_superuser:
        return Endpoint.objects.all()
    return Endpoint.objects.filter(owner_id=user.pk)


def can_see_endpoint(user, endpoint_id) -> bool:
    return visible_endpoints(user).filter(pk=endpoint_id).exists()
