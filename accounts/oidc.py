"""Operator sign-in through OIDC (mozilla-django-oidc), linked by subject
(docs/console.md#sign-in-and-the-admin).

The library's defaults match users by ``email__iexact``, check no ``email_verified`` and
create a user for every unknown address: with a provider that lets people register unverified
addresses, anyone could sign in as an existing superuser. This backend instead:

* requires a ``sub`` and a verified e-mail (``email_verified`` true) in the claims;
* finds the user through ``OidcIdentity.subject`` only (active users);
* creates a user (and links its subject) only when ``OIDC_CREATE_USERS=true``.
"""

from django.conf import settings
from django.db import transaction
from mozilla_django_oidc.auth import OIDCAuthenticationBackend

from .models import OidcIdentity


def subject_of(claims) -> str | None:
    subject = claims.get("sub")
    return subject if isinstance(subject, str) and 0 < len(subject) <= 255 else None


def email_verified(claims) -> bool:
    # Some providers send the boolean as a string.
    verified = claims.get("email_verified")
    return (verified is True or verified == "true") and bool(claims.get("email"))


class SubjectOIDCBackend(OIDCAuthenticationBackend):
    def describe_user_by_claims(self, claims):
        return f"sub {subject_of(claims)!r}"  # for the library's log line; never the e-mail

    def verify_claims(self, claims):
        return subject_of(claims) is not None and email_verified(claims)

    def filter_users_by_claims(self, claims):
        subject = subject_of(claims)
        if subject is None:
            return self.UserModel.objects.none()
        return self.UserModel.objects.filter(oidc_identities__subject=subject, is_active=True)

    def create_user(self, claims):
        # The library calls this only when OIDC_CREATE_USER (our OIDC_CREATE_USERS) is on;
        # checked again so that no other path can create an account.
        if not getattr(settings, "OIDC_CREATE_USER", False) or not self.verify_claims(claims):
            return None
        with transaction.atomic():
            user = super().create_user(claims)
            OidcIdentity.objects.create(user=user, subject=subject_of(claims))
        return user
