"""Sign-in is throttled per (username, client address) pair on both login views: after enough
wrong passwords for a username from an address, the right one fails too from there, for a
while, and nobody can lock an operator out from elsewhere."""

from datetime import timedelta

import pytest
from django.conf import settings
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.test import Client

from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

LOGIN_VIEWS = ("/accounts/login/", "/admin/login/")
RIGHT = "correct horse battery staple"


def sign_in(path, username, password, address="203.0.113.7"):
    client = Client(REMOTE_ADDR=address)
    response = client.post(path, {"username": username, "password": password, "next": "/todos/"})
    return response, client


def signed_in(response, client) -> bool:
    return response.status_code == 302 and settings.SESSION_COOKIE_NAME in client.cookies


@pytest.fixture
def alice():
    return UserFactory(username="alice", password=RIGHT, is_staff=True, is_superuser=True)


def test_the_right_password_signs_in_on_both_views(alice):
    for path in LOGIN_VIEWS:
        assert signed_in(*sign_in(path, "alice", RIGHT))


def test_twenty_wrong_passwords_lock_that_username_out_from_that_address(alice):
    for attempt in range(20):
        sign_in(LOGIN_VIEWS[attempt % 2], "alice", f"wrong-{attempt}", address="198.51.100.9")
    for path in LOGIN_VIEWS:
        response, client = sign_in(path, "alice", RIGHT, address="198.51.100.9")
        assert not signed_in(response, client), path
        assert response.status_code == 429


def test_nobody_can_lock_an_operator_out_from_elsewhere(alice):
    bob = UserFactory(username="bob", password=RIGHT)
    # Someone guesses alice's password, from one address and from many.
    for attempt in range(20):
        sign_in(LOGIN_VIEWS[attempt % 2], "alice", f"wrong-{attempt}", address="198.51.100.9")
        sign_in(LOGIN_VIEWS[attempt % 2], "alice", "wrong", address=f"198.51.100.{100 + attempt}")
    # Alice, from her own address, still signs in on both views...
    for path in LOGIN_VIEWS:
        assert signed_in(*sign_in(path, "alice", RIGHT, address="192.0.2.1")), path
    # ...and so does anyone else from the guesser's address.
    assert signed_in(*sign_in("/accounts/login/", bob.username, RIGHT, address="198.51.100.9"))


def test_the_lockout_ends_after_the_cool_off(alice):
    from axes.models import AccessAttempt

    for attempt in range(20):
        sign_in("/accounts/login/", "alice", "wrong")
    assert not signed_in(*sign_in("/admin/login/", "alice", RIGHT))
    AccessAttempt.objects.update(
        attempt_time=AccessAttempt.objects.first().attempt_time - settings.AXES_COOLOFF_TIME
        - timedelta(seconds=1))
    assert signed_in(*sign_in("/admin/login/", "alice", RIGHT))


@pytest.mark.parametrize("password", ["password", "12345678", "alice-alice", "short"])
def test_djangos_standard_password_validators_are_on(password):
    user = UserFactory.build(username="alice-alice", email="alice-alice@example.com")
    with pytest.raises(ValidationError):
        validate_password(password, user)
    validate_password("a much longer passphrase, 2026", user)
