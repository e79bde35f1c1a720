"""OIDC sign-in links accounts by ``sub``, requires ``email_verified`` and creates no account
unless ``OIDC_CREATE_USERS=true`` (CONTRACT §12, issue 12 item 10). The backend class is
driven directly with the claims an identity provider would return: no network."""

import os
import subprocess

import pytest
from django.test import override_settings

from accounts.models import OidcIdentity
from accounts.oidc import SubjectOIDCBackend
from tests.factories import UserFactory
from tests.processes import PYTHON, ROOT

pytestmark = pytest.mark.django_db

OIDC_SETTINGS = dict(
    OIDC_RP_CLIENT_ID="switchboard", OIDC_RP_CLIENT_SECRET="s3cret", OIDC_RP_SIGN_ALGO="HS256",
    OIDC_OP_AUTHORIZATION_ENDPOINT="https://idp.example/authorize",
    OIDC_OP_TOKEN_ENDPOINT="https://idp.example/token",
    OIDC_OP_USER_ENDPOINT="https://idp.example/userinfo",
)


class ClaimsBackend(SubjectOIDCBackend):
    """The production backend with the provider's answer given instead of fetched: everything
    after the userinfo call (verify, match, create) is the real code."""

    def __init__(self, claims):
        super().__init__()
        self.claims = claims

    def get_userinfo(self, access_token, id_token, payload):
        return self.claims


def sign_in(claims, **settings):
    with override_settings(**OIDC_SETTINGS, **settings):
        try:
            return ClaimsBackend(claims).get_or_create_user("access", "id", {})
        except Exception as exc:  # the library raises SuspiciousOperation on bad claims
            return exc


@pytest.fixture
def root():
    return UserFactory(username="root", email="root@example.com", is_staff=True, is_superuser=True)


def test_an_unverified_email_matching_a_superuser_does_not_sign_in_as_them(root):
    for claims in ({"sub": "attacker", "email": "root@example.com", "email_verified": False},
                   {"sub": "attacker", "email": "ROOT@example.com"},
                   {"sub": "attacker", "email": "root@example.com", "email_verified": True}):
        outcome = sign_in(claims, OIDC_CREATE_USER=True)
        assert getattr(outcome, "pk", None) != root.pk, claims


def test_a_linked_subject_with_a_verified_email_signs_in_as_its_user(root):
    OidcIdentity.objects.create(user=root, subject="idp|root")
    claims = {"sub": "idp|root", "email": "anything@else.example", "email_verified": True}
    assert sign_in(claims) == root
    # The same subject without a verified e-mail is refused.
    assert not isinstance(sign_in({**claims, "email_verified": False}), type(root))
    assert not isinstance(sign_in({**claims, "email_verified": "false"}), type(root))


def test_verify_claims_requires_a_subject_and_a_verified_email():
    with override_settings(**OIDC_SETTINGS):
        backend = SubjectOIDCBackend()
    assert backend.verify_claims({"sub": "x", "email": "a@b.c", "email_verified": True})
    assert backend.verify_claims({"sub": "x", "email": "a@b.c", "email_verified": "true"})
    for claims in ({"email": "a@b.c", "email_verified": True}, {"sub": "", "email": "a@b.c",
                   "email_verified": True}, {"sub": "x", "email": "a@b.c"},
                   {"sub": "x", "email_verified": True}, {"sub": "x", "email": "a@b.c",
                   "email_verified": 1}):
        assert not backend.verify_claims(claims), claims


def test_filter_users_by_claims_matches_on_sub_only_and_only_active_users(root):
    with override_settings(**OIDC_SETTINGS):
        backend = SubjectOIDCBackend()
    assert list(backend.filter_users_by_claims({"sub": "x", "email": "root@example.com"})) == []
    OidcIdentity.objects.create(user=root, subject="x")
    assert list(backend.filter_users_by_claims({"sub": "x", "email": "other@example.com"})) == [root]
    root.is_active = False
    root.save()
    assert list(backend.filter_users_by_claims({"sub": "x"})) == []


def test_no_account_is_created_unless_oidc_create_users_is_on():
    claims = {"sub": "idp|new", "email": "new@example.com", "email_verified": True}
    assert sign_in(claims) is None
    with override_settings(**OIDC_SETTINGS):
        assert SubjectOIDCBackend().create_user(claims) is None
    assert not OidcIdentity.objects.exists()
    user = sign_in(claims, OIDC_CREATE_USER=True)
    assert OidcIdentity.objects.get(subject="idp|new").user == user
    assert not user.is_staff and not user.is_superuser
    # The next sign-in finds the same account by its subject.
    assert sign_in(claims) == user


def test_the_configured_oidc_backend_is_the_subject_linking_one():
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="switchboard.settings",
               **{name: value for name, value in OIDC_SETTINGS.items()})
    code = ("import django; django.setup(); from django.conf import settings; "
            "print(' '.join(settings.AUTHENTICATION_BACKENDS)); print(settings.OIDC_CREATE_USER)")
    result = subprocess.run([PYTHON, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    backends, create = result.stdout.strip().splitlines()[-2:]
    assert "accounts.oidc.SubjectOIDCBackend" in backends.split(), result.stderr
    assert "mozilla_django_oidc.auth.OIDCAuthenticationBackend" not in backends.split()
    assert create == "False"
    with_create = subprocess.run([PYTHON, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                 env={**env, "OIDC_CREATE_USERS": "true"})
    assert with_create.stdout.strip().splitlines()[-1] == "True"
