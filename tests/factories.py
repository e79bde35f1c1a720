"""factory-boy factories shared by every app's tests."""

import factory
from django.contrib.auth import get_user_model

from endpoints.models import Endpoint

# The apps whose model permissions an operator needs to act on the console and the operator
# API (seed_demo grants the same).
OPERATOR_APPS = ("todos", "endpoints", "ingest")


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)
        skip_postgeneration_save = True  # the permissions are rows of their own

    username = factory.Sequence(lambda n: f"operator{n}")
    password = factory.django.Password("pw-for-tests")

    @factory.post_generation
    def permissions(user, create, extracted, **kwargs):
        """An operator acts with the model permissions of the apps they work in, as
        ``seed_demo``'s operator does (docs/security.md#who-may-act): every permission of
        ``extracted`` app labels, by default OPERATOR_APPS; ``permissions=()`` for a user
        with none."""
        from django.contrib.auth.models import Permission

        apps = OPERATOR_APPS if extracted is None else tuple(extracted)
        if create and apps:
            user.user_permissions.add(
                *Permission.objects.filter(content_type__app_label__in=apps))


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
