"""Ingest: webhooks, their routes, and the record of every accepted arrival (docs/senders.md)."""

import base64
import functools
import hashlib
import hmac
import logging
import secrets

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from todos.models import (MAX_SCHEDULE_AHEAD, PRIORITY_DEFAULT, PRIORITY_MAX, PRIORITY_MIN,
                          WriteBack as WriteBackLevel)

log = logging.getLogger("switchboard.ingest")


class Source(models.TextChoices):
    GITHUB = "github"
    GITEA = "gitea"
    GITLAB = "gitlab"
    STRIPE = "stripe"
    STANDARD = "standard"
    LINEAR = "linear"
    SLACK = "slack"
    SENTRY = "sentry"
    UNSIGNED = "unsigned"


class SealedSecretField(models.TextField):
    """A secret kept Fernet-encrypted in the database with the operator-secret keyring
    (``build_fernet``; docs/security.md#stored-secrets) and plain text in Python. Empty stays empty
    (unsigned webhooks, no previous secret). A value the keyring cannot decrypt reads as empty,
    which verifies nothing, and is logged: the secrets key changed without keeping the old one."""

    def from_db_value(self, value, expression, connection):
        return unseal_text(value)

    def get_prep_value(self, value):
        value = super().get_prep_value(value)
        return seal_text(value) if value else ""


def seal_text(value: str) -> str:
    return build_fernet().encrypt(value.encode()).decode("ascii") if value else ""


def unseal_text(value) -> str:
    if not value:
        return ""
    return _unseal(value, settings.SWITCHBOARD_SECRETS_KEY, settings.SECRET_KEY)


# Every delivery reads its webhook's sealed secrets: decrypt each ciphertext once per process
# (a ciphertext never changes meaning; rotation writes a new one).
@functools.lru_cache(maxsize=1024)
def _unseal(value: str, secrets_key: str, secret_key: str) -> str:
    try:
        return _fernet_for(secrets_key, secret_key).decrypt(value.encode("ascii")).decode()
    except (InvalidToken, UnicodeEncodeError):
        log.warning("a stored secret (a webhook's or a connection's) could not be decrypted "
                    "with SWITCHBOARD_SECRETS_KEY")
        return ""


class ConnectionKind(models.TextChoices):
    GITHUB_APP = "github_app"
    GITHUB_TOKEN = "github_token"
    GITLAB = "gitlab"
    GITEA = "gitea"
    LINEAR = "linear"
    SLACK = "slack"


class Connection(models.Model):
    """switchboard's outbound identity at one source system (docs/write-back.md): what it
    writes back under. ``secret`` is the App's private key (PEM) or the token, sealed like a
    webhook secret and never shown again; ``app_id`` only for ``github_app``. ``identity`` is
    who the source says we are (``<slug>[bot]`` for an App, the token's user otherwise), with
    ``identity_id`` (the App's or user's id), both recorded by the last successful test."""

    name = models.SlugField(max_length=64, unique=True)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="connections"
    )
    kind = models.CharField(max_length=16, choices=ConnectionKind.choices)
    api_url = models.URLField(max_length=300)
    app_id = models.CharField(max_length=32, blank=True, default="")
    secret = SealedSecretField(blank=True, default="")
    identity = models.CharField(max_length=200, blank=True, default="")
    identity_id = models.CharField(max_length=64, blank=True, default="")
    last_success_at = models.DateTimeField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True, default="")
    last_error_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # The source answered a rate limit with a time: none of this connection's write-backs is
    # sent before it (write_back.hold_connection; docs/write-back.md#the-outbox).
    held_until = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    @property
    def is_ok(self) -> bool:
        """The last test (or request) succeeded after the last error, if any."""
        return self.last_success_at is not None and (
            self.last_error_at is None or self.last_success_at >= self.last_error_at)


class Webhook(models.Model):
    slug = models.SlugField(max_length=64, unique=True)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="webhooks"
    )
    source = models.CharField(max_length=16, choices=Source.choices)
    secret = SealedSecretField(blank=True, default="")
    # Accepted as well during rotation, until previous_secret_expires_at.
    previous_secret = SealedSecretField(blank=True, default="")
    previous_secret_expires_at = models.DateTimeField(null=True, blank=True)
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # Who switchboard writes back to the source as (docs/write-back.md); none: it writes
    # nothing. A connection of the webhook's own source family and owner
    # (``connections.check_webhook_connection``).
    connection = models.ForeignKey(Connection, null=True, blank=True, on_delete=models.PROTECT,
                                   related_name="webhooks")

    class Meta:
        ordering = ["slug"]

    def __str__(self):
        return self.slug


class FollowUps(models.TextChoices):
    COALESCE = "coalesce"
    NEW = "new"
    SKIP = "skip"


class Route(models.Model):
    """webhook -> (endpoint, queue); ``kinds`` empty means every event kind."""

    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="routes")
    endpoint = models.ForeignKey("endpoints.Endpoint", on_delete=models.CASCADE, related_name="routes")
    queue = models.CharField(max_length=64)
    kinds = models.JSONField(default=list, blank=True)
    # Who may hand work through this route (ingest/actors.py): the event's actor must be one of
    # these logins or hold one of these roles (GitHub's author_association names). Both empty:
    # anyone the sender lets trigger the event.
    actors = models.JSONField(default=list, blank=True)
    author_associations = models.JSONField(default=list, blank=True)
    # What each todo this route creates starts with (docs/work-control.md): its priority, and
    # how long after arrival it becomes ready (0: at once).
    priority = models.SmallIntegerField(
        default=PRIORITY_DEFAULT,
        validators=[MinValueValidator(PRIORITY_MIN), MaxValueValidator(PRIORITY_MAX)])
    delay_seconds = models.PositiveIntegerField(
        default=0, validators=[MaxValueValidator(int(MAX_SCHEDULE_AHEAD.total_seconds()))])
    # The approval gate (docs/work-control.md#approval): this route's todos are created
    # awaiting an operator's approval.
    requires_approval = models.BooleanField(default=False)
    # What the source hears of this route's todos (docs/write-back.md#what-is-written-back),
    # when the webhook has a connection; without one, nothing.
    write_back = models.CharField(max_length=8, choices=WriteBackLevel.choices,
                                  default=WriteBackLevel.STATUS)
    # Threads (docs/work-control.md#threads); "" is the sender's default for both.
    follow_ups = models.CharField(max_length=8, choices=FollowUps.choices, blank=True, default="")
    thread_key = models.CharField(max_length=300, blank=True, default="")
    stop_kinds = models.JSONField(default=list, blank=True)
    stop = models.BooleanField(default=True)
    # What a repository token minted for this route's todos may do (GitHub App permission ->
    # level; docs/write-back.md#repository-tokens-for-agents). Empty: the agent gets none.
    agent_permissions = models.JSONField(default=dict, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["webhook", "endpoint", "queue"], name="route_unique")
        ]

    def __str__(self):
        return f"{self.webhook.slug} -> {self.endpoint.slug}/{self.queue}"

    def clean(self):
        if not self.agent_permissions:
            return
        from .senders import github

        if self.webhook_id and self.webhook.source != Source.GITHUB:
            raise ValidationError({"agent_permissions": "only a GitHub webhook's todos can "
                                                        "have a repository token"})
        if not isinstance(self.agent_permissions, dict):
            raise ValidationError({"agent_permissions": 'an object, e.g. {"contents": "write"}'})
        try:
            github.parse_agent_permissions(",".join(
                f"{name}:{level}" for name, level in self.agent_permissions.items()))
        except ValueError as bad:
            raise ValidationError({"agent_permissions": str(bad)}) from None


class WriteBackState(models.TextChoices):
    PENDING = "pending"  # to send, from next_attempt_at
    SENDING = "sending"  # a worker holds it until sending_until
    SENT = "sent"
    FAILED = "failed"  # the source refused it (a 4xx): not retried
    ABANDONED = "abandoned"  # retried for SWITCHBOARD's 24 h, then given up


class WriteBackAction(models.TextChoices):
    ACK = "ack"  # the reaction on what made the todo
    STATUS = "status"  # the living status, edited in place
    CHECK = "check"  # a GitHub App's check run on a pull request's head commit
    FOLLOWUP = "followup"  # the ack's reaction on what a follow-up came from


class WriteBack(models.Model):
    """One thing switchboard writes back about a todo (docs/write-back.md#the-outbox): its
    ``ack``, its living ``status`` or its ``check`` run, at most one of each per todo, and a
    ``followup`` ack per follow-up folded into it (``followup_seq``, 0 for the others). Made
    from the todo's outbox entries (``write_back.absorb_outbox_entries``); ``wanted`` counts
    the changes asked for and ``sent`` the count the last successful send covered, so changes
    that arrive while one is sent collapse into the next send, which shows the todo as it is
    then.
    ``external_id`` is what the source answered with (a comment's, reaction's or check run's
    id): the status is edited there, never posted twice."""

    # No constraint, as for todo events: the retention prune deletes todos with plain SQL.
    todo = models.ForeignKey("todos.Todo", on_delete=models.DO_NOTHING, db_constraint=False,
                             related_name="write_backs", db_index=False)
    connection = models.ForeignKey(Connection, on_delete=models.CASCADE,
                                   related_name="write_backs")
    action = models.CharField(max_length=8, choices=WriteBackAction.choices)
    followup_seq = models.PositiveIntegerField(default=0, db_default=0)
    # Where, as the sender's client reads it from the payload (owner, repository, number,
    # comment, installation) and as people read it ("octo/hello#12").
    target = models.JSONField(default=dict)
    target_label = models.CharField(max_length=300, blank=True, default="")
    state = models.CharField(max_length=12, choices=WriteBackState.choices,
                             default=WriteBackState.PENDING)
    wanted = models.PositiveIntegerField(default=1)
    sent = models.PositiveIntegerField(default=0)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    sending_until = models.DateTimeField(null=True, blank=True)
    # When the current run of failures began: retried until 24 h after it, then abandoned.
    failing_since = models.DateTimeField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True, default="")
    external_id = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField()
    sent_at = models.DateTimeField(null=True, blank=True)

    # Its state as every page and command shows it: "retrying" while a send failed and another
    # is due or under way (``RETRYING_STATES`` with ``failing_since``), else the stored state.
    RETRYING = "retrying"
    RETRYING_STATES = (WriteBackState.PENDING, WriteBackState.SENDING)

    @property
    def shown_state(self) -> str:
        if self.state in self.RETRYING_STATES and self.failing_since is not None:
            return self.RETRYING
        return self.state

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["todo", "action", "followup_seq"],
                                    name="writeback_todo_action"),
        ]
        indexes = [
            # write_back.claim_due_write_back (the sender and its sweep): pending rows by when
            # they are due.
            models.Index(fields=["next_attempt_at", "id"], condition=models.Q(state="pending"),
                         name="writeback_due"),
            # write_back.return_stalled_sends: rows a worker took and never finished.
            models.Index(fields=["sending_until"], condition=models.Q(state="sending"),
                         name="writeback_sending"),
            # sweeps.prune_history: write-backs as old as retention, whose todo may be gone.
            models.Index(fields=["created_at"], name="writeback_prune"),
        ]

    def __str__(self):
        return f"{self.action} of #{self.todo_id} ({self.state})"


class WriteBackTally(models.Model):
    """Durable counts of the write-back sender's outcomes, for /metrics
    (docs/operating.md#metrics): per source, ``series`` "outcome" counts sends by ``label``
    (sent, retried, failed, abandoned) and "ack_seconds" counts acks the source took by
    latency bucket (``label`` its upper bound, "+Inf" the last), with ``total_seconds`` their
    sum. Bumped in the statement that records an answer (``write_back.finish_write_back``),
    so every process and every restart adds to the same counts; retention never prunes it."""

    source = models.CharField(max_length=16)
    series = models.CharField(max_length=16)
    label = models.CharField(max_length=16)
    count = models.BigIntegerField(default=0)
    total_seconds = models.FloatField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["source", "series", "label"],
                                    name="writeback_tally_key"),
        ]


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


# -- the delivery log and the replay ledger ------------------------------------------------------


class Outcome(models.TextChoices):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    REPLAY = "replay"
    BAD_SIGNATURE = "bad_signature"
    STALE_TIMESTAMP = "stale_timestamp"
    MALFORMED = "malformed"
    TOO_LARGE = "too_large"
    UNSUPPORTED_TYPE = "unsupported_type"
    RATE_LIMITED = "rate_limited"
    NO_ROUTE = "no_route"
    # Routes matched the kind, but the event's actor qualified for none of them.
    FILTERED = "filtered"
    COALESCED = "coalesced"
    STOPPED = "stopped"


class DeliveryRecord(models.Model):
    """One request to ``/hooks/<slug>`` naming this webhook, whatever became of it: what the
    sender claimed (delivery id, kind), the body's size and digest, where it came from and what
    was answered, and its non-secret headers. Never the body or a secret header. Accepted ones link their delivery event,
    whose todos are the ones created; a redelivery names the record it re-sent."""

    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="records")
    at = models.DateTimeField()
    outcome = models.CharField(max_length=20, choices=Outcome.choices)
    status = models.PositiveSmallIntegerField()
    delivery_id = models.CharField(max_length=300, blank=True, default="")
    kind = models.CharField(max_length=200, blank=True, default="")
    size = models.PositiveIntegerField(default=0)
    body_sha256 = models.CharField(max_length=64, blank=True, default="")
    source_address = models.CharField(max_length=64, blank=True, default="")
    # Why it was refused, as safe to show as a log line (never the body or a signature).
    reason = models.CharField(max_length=200, blank=True, default="")
    # No database constraints on these two links: the retention prune deletes delivery events
    # (and may delete records) with plain SQL, and a log line outliving its event is fine.
    delivery_event = models.ForeignKey(DeliveryEvent, null=True, blank=True, db_constraint=False,
                                       on_delete=models.DO_NOTHING, related_name="records")
    # Todos named by a duplicate (the live ones it collapsed into); accepted records reach
    # theirs through delivery_event.
    todo_ids = models.JSONField(default=list, blank=True)
    # The request's headers as received, less every one that could carry a secret
    # (transitions.safe_headers): what an operator compares with the sender's own log.
    headers = models.JSONField(default=dict, blank=True)
    redelivered_from = models.ForeignKey("self", null=True, blank=True, db_constraint=False,
                                         on_delete=models.DO_NOTHING, related_name="redeliveries")
    attributed_to = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                      on_delete=models.SET_NULL, related_name="+")

    class Meta:
        indexes = [
            # The webhook page and `manage.py deliveries`: newest first per webhook.
            models.Index(fields=["webhook", "-id"], name="deliveryrecord_webhook_newest"),
            # The retention sweep: oldest first.
            models.Index(fields=["at"], name="deliveryrecord_at"),
        ]

    def __str__(self):
        return f"#{self.pk} {self.outcome} {self.status}"


class DeliveryDrops(models.Model):
    """Refused deliveries past the per-minute recording cap: only counted, per webhook and
    minute (folded in from the shared counters by ``sweeps.fold_dropped_delivery_counts``)."""

    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="drops")
    minute = models.DateTimeField()
    dropped = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["webhook", "minute"],
                                               name="deliverydrops_webhook_minute")]


class ReplayLedgerEntry(models.Model):
    """A signed body accepted for a webhook: its fingerprint (sha256 of the body, or for
    Stripe/Standard of the exact signed message, timestamp included), the delivery id it came
    under and when. A later delivery of the same fingerprint under another id inside the
    replay window is a replay; for timestamped sources, for sources that never redeliver and
    for a delivery that made no todo, any repeat is a duplicate. Bounded:
    ``sweeps.prune_replay_ledger`` deletes entries past the window.

    ``kind`` is the kind the body was accepted as: GitHub, Gitea and GitLab sign the body only,
    not the event header the kind comes from, so the same delivery id and body under another
    event is a replay too, never new work on a route the original did not match."""

    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="+")
    fingerprint = models.CharField(max_length=64)
    delivery_id = models.CharField(max_length=300, blank=True, default="")
    kind = models.CharField(max_length=200, blank=True, default="")
    accepted_at = models.DateTimeField()
    # The accepted delivery event (a duplicate answers with its todos); no constraint: the
    # ledger must not hold up pruning deliveries.
    delivery_event_id = models.BigIntegerField(null=True, blank=True)
    # Only a delivery that made todos has a redelivery for idempotency to answer; a repeat of
    # one that made none (a ping, a handshake) is a duplicate however it comes.
    made_todos = models.BooleanField(default=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["webhook", "fingerprint"],
                                               name="replayledger_webhook_fingerprint")]
        indexes = [
            # prune_replay_ledger: entries older than the window, oldest first.
            models.Index(fields=["accepted_at"], name="replayledger_accepted_at"),
        ]


# -- operator secrets: stored apart from the payload, encrypted at rest --------------------------

SECRET_REF_PREFIX = "sec_"
OPERATOR_TOKEN_PREFIX = "sbo_"


def build_fernet() -> MultiFernet:
    return _fernet_for(settings.SWITCHBOARD_SECRETS_KEY, settings.SECRET_KEY)


@functools.lru_cache(maxsize=4)
def _fernet_for(secrets_key: str, secret_key: str) -> MultiFernet:
    """The secrets cipher, built once per key setting (webhook secrets are read on every
    delivery). ``SWITCHBOARD_SECRETS_KEY`` is one Fernet key, or several separated
    by commas (the first encrypts, all decrypt: key rotation without re-encrypting first).
    Unset, a key is derived from SECRET_KEY so the embedded default needs no setup; rotating
    SECRET_KEY then makes stored secrets unreadable, which is why production should set it."""
    configured = [k.strip() for k in secrets_key.split(",") if k.strip()]
    if not configured:
        digest = hashlib.sha256(b"switchboard.ingest.secrets:" + secret_key.encode()).digest()
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


class RepoToken(models.Model):
    """A GitHub installation token minted for the agent holding one todo's lease
    (docs/write-back.md#repository-tokens-for-agents): one repository, the route's permissions.
    Sealed at rest, handed again to the same lease while it has time left, and revoked at
    GitHub once the lease ends (``revoked_at``; ``ingest.sweeps.revoke_ended_agent_tokens``)."""

    # No database constraint: the retention prune deletes these before their todo
    # (ingest.sweeps.prune_history), so the todos' prune touches todos' tables only.
    todo = models.ForeignKey("todos.Todo", on_delete=models.DO_NOTHING, db_constraint=False,
                             related_name="repo_tokens")
    lease_id = models.CharField(max_length=64)
    connection = models.ForeignKey(Connection, on_delete=models.CASCADE, related_name="+")
    repository = models.CharField(max_length=200)
    # What GitHub granted (the answer's), and what the route asked for when it was minted: a
    # route whose grant changed since gets a new token, not this one.
    permissions = models.JSONField(default=dict)
    requested_permissions = models.JSONField(default=dict)
    token = SealedSecretField(blank=True, default="")
    issued_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)
    # The last revocation GitHub refused (retried by the next pass until the token expires).
    revoke_error = models.CharField(max_length=300, blank=True, default="")

    class Meta:
        indexes = [
            # ingest.sweeps.revoke_ended_agent_tokens: the tokens not yet revoked.
            models.Index(fields=["issued_at"], name="repotoken_unrevoked",
                         condition=models.Q(revoked_at__isnull=True)),
            # repo_tokens.get_repo_token: the one a lease already has.
            models.Index(fields=["todo", "lease_id"], name="repotoken_by_lease"),
        ]

    def __str__(self):
        return f"repository token for {self.repository} (todo {self.todo_id})"
