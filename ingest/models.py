"""Ingest: webhooks, their routes, and the record of every accepted arrival (CONTRACT §3, §5)."""

from django.conf import settings
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

    def __str__(self):
        return f"{self.trust} {self.delivery_id or self.pk}"
