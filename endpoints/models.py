"""Endpoints: what an operator vends to one agent (CONTRACT §3)."""

import hashlib
import re
import hmac
import secrets
from datetime import timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator
from django.db import models

AGENT_VERBS = (
    "list_todos",
    "claim",
    "claim_next",
    "heartbeat",
    "complete",
    "fail",
    "release",
    "read_secret",
    "clock_in",
    "clock_out",
)
ALL_QUEUES = "*"
QUEUE_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$"
queue_name_validator = RegexValidator(QUEUE_NAME_RE, "queue names are 1-64 of A-Z a-z 0-9 _ . -")

CREDENTIAL_PREFIX = "sbk_"


def default_scope():
    return [ALL_QUEUES]


def default_verbs():
    return list(AGENT_VERBS)


def hash_credential(credential: str) -> str:
    """Credentials are 256-bit random tokens, so one SHA-256 is enough (no stretching needed:
    there is nothing to brute-force). Stored and looked up by this digest only."""
    return hashlib.sha256(credential.encode()).hexdigest()


class Endpoint(models.Model):
    slug = models.SlugField(max_length=64, unique=True)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="endpoints"
    )
    # Queue names this endpoint may see; ["*"] grants every queue of the endpoint.
    scope = models.JSONField(default=default_scope)
    verbs = models.JSONField(default=default_verbs)
    default_lease_seconds = models.PositiveIntegerField(
        null=True, blank=True, help_text="Empty: the server default (SWITCHBOARD_DEFAULT_LEASE_SECONDS)."
    )
    max_attempts = models.PositiveSmallIntegerField(default=5)
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self):
        return self.slug

    def clean(self):
        if not isinstance(self.scope, list) or not self.scope:
            raise ValidationError({"scope": 'a non-empty list of queue names, or ["*"]'})
        bad = [n for n in self.scope if n != ALL_QUEUES and not re.match(QUEUE_NAME_RE, str(n))]
        if bad:
            raise ValidationError({"scope": f"bad queue names {bad}: {queue_name_validator.message}"})
        if not isinstance(self.verbs, list) or not self.verbs:
            raise ValidationError({"verbs": "at least one verb (an allowlist never means 'all')"})
        unknown = set(self.verbs) - set(AGENT_VERBS)
        if unknown:
            raise ValidationError({"verbs": f"unknown verbs: {sorted(unknown)}"})
        if self.max_attempts < 1:
            raise ValidationError({"max_attempts": "at least 1"})
        if self.default_lease_seconds is not None and not 1 <= self.default_lease_seconds <= 86400:
            raise ValidationError({"default_lease_seconds": "between 1 and 86400"})

    @property
    def all_queues(self) -> bool:
        return ALL_QUEUES in self.scope

    def covers(self, queue: str) -> bool:
        return self.all_queues or queue in self.scope

    def allows(self, verb: str) -> bool:
        return verb in self.verbs

    @property
    def effective_lease(self) -> timedelta:
        if self.default_lease_seconds:
            return timedelta(seconds=self.default_lease_seconds)
        return settings.SWITCHBOARD_DEFAULT_LEASE


class Credential(models.Model):
    """A bearer credential, stored as its SHA-256 digest only (shown once at vending).

    Rotation sets ``expires_at`` on the old credential (the grace period) and mints a new one
    with no expiry, so both work until the grace ends.
    """

    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="credentials")
    digest = models.CharField(max_length=64, unique=True)
    # First characters of the token, to tell credentials apart in the admin without the secret.
    hint = models.CharField(max_length=16)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)

    def __str__(self):
        return f"{self.hint}… ({self.endpoint.slug})"

    @staticmethod
    def mint() -> str:
        return CREDENTIAL_PREFIX + secrets.token_urlsafe(32)

    def matches(self, credential: str) -> bool:
        return hmac.compare_digest(self.digest, hash_credential(credential))
