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
