"""Ingest: webhooks, their routes, and the record of every accepted arrival (CONTRACT §3, §5)."""

import base64
import hashlib
import hmac
import secrets

from cryptography.fernet import Fernet, MultiFernet
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import models


class Source(models.TextChoices):
    GITHUB = "github"
    GITEA = "gitea"
    GITLAB = "gitlab"
    STRIPE = "stripe"
    STANDARD = "standard"
    UNSIGNED = "unsigned"


class Webhook(models.Model):
    slug = models.SlugField(max_length=64, unique=True)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="webhooks"
    )
    source = models.CharField(max_length=16, choices=Source.choices)
    secret = models.CharField(max_length=200, blank=True, default="")
    # Accepted as well during rotation, until previous_secret_expires_at.
    previous_secret = models.CharField(max_length=200, blank=True, default="")
    previous_secret_expires_at = models.DateTimeField(null=True, blank=True)
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self):
        return self.slug


class Route(models.Model):
    """webhook -> (endpoint, queue); ``kinds`` empty means every event kind."""

    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="routes")
    endpoint = models.ForeignKey("endpoints.Endpoint", on_delete=models.CASCADE, related_name="routes")
    queue = models.CharField(max_length=64)
    kinds = models.JSONField(default=list, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["webhook", "endpoint", "queue"], name="route_unique")
        ]

    def __str__(self):
        return f"{self.webhook.slug} -> {self.endpoint.slug}/{self.queue}"


class TrustMode(models.TextChoices):
    SIGNED = "signed"
    OPERATOR = "operator"
    UNVERIFIED = "unverified"


class DeliveryEvent(models.Model):
    """What arrived: a webhook delivery or an operator hand-off, and who it is attributed to."""

    webhook = models.ForeignKey(
        Webhook, null=True, blank=True, on_delete=models.SET_NULL, related_name="deliveries"
    )
    trust = models.CharField(max_length=16, choices=TrustMode.choices)
    delivery_id = models.CharField(max_length=300, blank=True, default="")
    received_at = models.DateTimeField()
    body_sha256 = models.CharField(max_length=64, blank=True, default="")
    attributed_to = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
        related_name="+",
    )
    # What the source said it was (webhook source name, or "operator") and the event kind.
    source = models.CharField(max_length=64, blank=True, default="")
    kind = models.CharField(max_length=200, blank=True, default="")

    class Meta:
        indexes = [
            # sweeps.prune_history: delivery events past retention, oldest first.
            models.Index(fields=["received_at", "id"], name="delivery_event_prune"),
        ]

    def __str__(self):
        return f"{self.trust} {self.delivery_id or self.pk}"


# -- operator secrets (§5): stored apart from the payload, encrypted at rest ---------------------

SECRET_REF_PREFIX = "sec_"
OPERATOR_TOKEN_PREFIX = "sbo_"


def build_fernet() -> MultiFernet:
    """The secrets cipher. ``SWITCHBOARD_SECRETS_KEY`` is one Fernet key, or several separated
    by commas (the first encrypts, all decrypt: key rotation without re-encrypting first).
    Unset, a key is derived from SECRET_KEY so the embedded default needs no setup; rotating
    SECRET_KEY then makes stored secrets unreadable, which is why production should set it."""
    configured = [k.strip() for k in settings.SWITCHBOARD_SECRETS_KEY.split(",") if k.strip()]
    if not configured:
        digest = hashlib.sha256(b"switchboard.ingest.secrets:" + settings.SECRET_KEY.encode()).digest()
        configured = [base64.urlsafe_b64encode(digest).decode()]
    try:
        return MultiFernet([Fernet(key) for key in configured])
    except (ValueError, TypeError) as exc:
        raise ImproperlyConfigured(
            f"SWITCHBOARD_SECRETS_KEY: not a Fernet key (generate one with "
            f"cryptography.fernet.Fernet.generate_key()): {exc}"
        ) from None


class OperatorSecret(models.Model):
    """One secret an operator handed over with a todo. The todo's payload carries only
    ``{"$secret": ref}``; the value is here, Fernet-encrypted, and is read back only through
    ``ingest.queries.read_secret`` by a caller who can see the todo."""

    ref = models.CharField(max_length=64, unique=True)
    name = models.CharField(max_length=100)
    todo = models.ForeignKey("todos.Todo", on_delete=models.CASCADE, related_name="secrets")
    ciphertext = models.BinaryField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self):
        return f"{self.ref} ({self.name})"

    @staticmethod
    def mint_ref() -> str:
        return SECRET_REF_PREFIX + secrets.token_urlsafe(18)

    @staticmethod
    def seal(value: str) -> bytes:
        return build_fernet().encrypt(value.encode())

    def unseal(self) -> str:
        return build_fernet().decrypt(bytes(self.ciphertext)).decode()


class OperatorToken(models.Model):
    """A personal API token for the operator API, stored as its SHA-256 digest only (shown once
    at minting, like endpoint credentials: a 256-bit random token needs no slow hash)."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="operator_tokens"
    )
    name = models.CharField(max_length=100, blank=True, default="")
    digest = models.CharField(max_length=64, unique=True, editable=False)
    # First characters of the token, to tell tokens apart in the admin without the secret.
    hint = models.CharField(max_length=16, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self):
        return f"{self.hint}… ({self.user})"

    @staticmethod
    def mint() -> str:
        return OPERATOR_TOKEN_PREFIX + secrets.token_urlsafe(32)

    @staticmethod
    def hash(token: str) -> str:
        return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()

    def matches(self, token: str) -> bool:
        return hmac.compare_digest(self.digest, self.hash(token))
