"""factory-boy factories shared by every app's tests."""

import factory
from django.contrib.auth import get_user_model

from endpoints.models import Endpoint


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)

    username = factory.Sequence(lambda n: f"operator{n}")
    password = factory.django.Password("pw-for-tests")


class EndpointFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Endpoint

    slug = factory.Sequence(lambda n: f"agent-{n}")
    owner = factory.SubFactory(UserFactory)


def credential_for(endpoint) -> int:
    """The id of a live credential of ``endpoint`` (minted when it has none), also set as
    ``endpoint.credential_id`` as the MCP bearer check sets it: MCP sessions are bound to the
    credential that opened them (CONTRACT §12)."""
    from endpoints.models import Credential, hash_credential

    existing = endpoint.credentials.filter(expires_at__isnull=True).order_by("pk").first()
    if existing is None:
        token = Credential.mint()
        existing = Credential.objects.create(endpoint=endpoint, digest=hash_credential(token),
                                             hint=token[:12])
    endpoint.credential_id = existing.pk
    return existing.pk
