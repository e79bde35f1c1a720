"""Operators' sign-in identities from outside Django: the OIDC subject a user signs in as
(docs/console.md#sign-in-and-the-admin)."""

from django.conf import settings
from django.db import models


class OidcIdentity(models.Model):
    """An identity provider's subject (the ``sub`` claim) allowed to sign in as ``user``.

    Accounts are linked by ``sub`` — stable and never reassigned by the provider — and never by
    e-mail address: a provider that lets anyone claim an address would otherwise let them sign
    in as whoever holds it here. Linked by an admin, or on first sign-in
    when ``OIDC_CREATE_USERS=true`` creates the user."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                             related_name="oidc_identities")
    # One provider is configured (OIDC_OP_*), so its subject alone is unique.
    subject = models.CharField(max_length=255, unique=True,
                               help_text="The identity provider's `sub` claim for this user.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name = "OIDC identity"
        verbose_name_plural = "OIDC identities"

    def __str__(self):
        return f"{self.subject} → {self.user}"
