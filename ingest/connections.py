"""Writes of connections (docs/write-back.md#connections): switchboard's outbound identity at a
source, its secret sealed at rest, tested against the source's identity endpoint when saved
and on demand, and attached to the webhooks of its source that write back under it.

A test is a request to the source, so it never runs inside a transaction: the connection is
saved first (kept even when the test fails, so the operator can fix the source's side and
test again), then the outcome is recorded in a statement of its own.
"""

from dataclasses import dataclass
from datetime import timedelta

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from . import outbound, senders
from .models import Connection, ConnectionKind, Webhook


# A write-back the source took moves the connection's last success no more often than this:
# "last success" then says the connection worked within about a minute, at one UPDATE a minute.
SUCCESS_RECORD_INTERVAL = timedelta(minutes=1)
# How many webhooks an error names before "…": enough to find them, short enough to read.
MAX_NAMED_WEBHOOKS = 10


@dataclass(frozen=True)
class ConnectionTest:
    ok: bool
    identity: str = ""
    error: str = ""


def buildable_kinds() -> list[str]:
    """The connection kinds switchboard has a client for (the others are in the model for the
    sources still to come, and cannot be made yet)."""
    return [kind for kind, spec in senders.CONNECTION_SPECS.items() if spec.identify is not None]


def check_connection_fields(*, kind: str, secret: str, app_id: str, api_url: str | None) -> dict:
    """The fields of a connection to save, checked: ValidationError naming the field."""
    if kind not in ConnectionKind.values:
        raise ValidationError({"kind": f"unknown kind {kind!r}; one of "
                                       f"{', '.join(ConnectionKind.values)}"})
    spec = senders.get_connection_spec(kind)
    if spec.identify is None:
        raise ValidationError({"kind": f"switchboard cannot write back over {kind} yet; "
                                       f"available: {', '.join(buildable_kinds())}"})
    errors = {}
    app_id = (app_id or "").strip()
    if spec.needs_app_id and not (app_id.isascii() and app_id.isdigit() and len(app_id) < 20):
        errors["app_id"] = "the App's id (a number, on the App's settings page)"
    if not spec.needs_app_id and app_id:
        errors["app_id"] = f"only a github_app connection has an App id, not {kind}"
    try:
        spec.check_secret(secret or "")
    except ValueError as bad:
        errors["secret"] = str(bad)
    url = api_url or spec.default_api_url
    try:
        url = outbound.check_api_url(url) if url else ""
    except ValueError as bad:
        errors["api_url"] = str(bad).partition(": ")[2]
    if not url and "api_url" not in errors:
        errors["api_url"] = f"a {kind} connection needs its instance's API URL"
    if errors:
        raise ValidationError(errors)
    return {"kind": kind, "secret": secret, "app_id": app_id, "api_url": url}


def create_connection(*, name: str, owner, kind: str, secret: str, app_id: str = "",
                      api_url: str | None = None, now=None) -> tuple[Connection, ConnectionTest]:
    """Save a connection of ``owner`` and test it. Returns ``(connection, test)``: the
    connection is kept whatever the test said. Raises ValidationError naming the field (an
    unknown or not yet buildable kind, a secret or App id that cannot work, an api_url that is
    not https) before anything is written."""
    fields = check_connection_fields(kind=kind, secret=secret, app_id=app_id, api_url=api_url)
    connection = Connection(name=name, owner=owner, **fields)
    connection.full_clean(exclude=["secret"])  # checked above; the field holds plaintext now
    with transaction.atomic():
        connection.save()
    return connection, test_connection(connection, now=now)


def replace_connection_secret(connection: Connection, *, secret: str, app_id: str | None = None,
                              api_url: str | None = None, now=None) -> ConnectionTest:
    """Install a new secret (and App id or api_url when given) on ``connection``, then test
    it. ValidationError as ``create_connection``, with nothing written."""
    fields = check_connection_fields(
        kind=connection.kind, secret=secret,
        app_id=connection.app_id if app_id is None else app_id,
        api_url=connection.api_url if api_url is None else api_url)
    Connection.objects.filter(pk=connection.pk).update(
        secret=fields["secret"], app_id=fields["app_id"], api_url=fields["api_url"],
        identity="", identity_id="")
    connection.refresh_from_db()
    return test_connection(connection, now=now)


def test_connection(connection: Connection, *, now=None) -> ConnectionTest:
    """Call the source's identity endpoint (``GET /app`` for an App, ``GET /user`` for a
    token) and record the answer: the identity and ``last_success_at``, or ``last_error``
    and ``last_error_at``. Never raises for what the source answered."""
    now = now or timezone.now()
    spec = senders.get_connection_spec(connection.kind)
    try:
        identity = spec.identify(connection, now)
    except outbound.SourceError as failed:
        record_connection_error(connection, failed.message, now=now)
        return ConnectionTest(ok=False, identity=connection.identity, error=failed.message)
    Connection.objects.filter(pk=connection.pk).update(
        identity=identity.login[:200], identity_id=identity.id[:64], last_success_at=now)
    connection.identity, connection.identity_id = identity.login[:200], identity.id[:64]
    connection.last_success_at = now
    return ConnectionTest(ok=True, identity=connection.identity)


def record_connection_success(connection: Connection, *, now) -> bool:
    """A write-back the source took: ``last_success_at`` moves to ``now``, at most once per
    ``SUCCESS_RECORD_INTERVAL``, so a busy connection costs one UPDATE a minute, not one per
    send. The time the caller read with the row decides whether to ask at all; the statement's
    guard (stored time older than the interval, or none) keeps overlapping workers to one write
    and never moves the time back. Returns whether it was recorded."""
    recorded = connection.last_success_at
    if recorded is not None and recorded > now - SUCCESS_RECORD_INTERVAL:
        return False
    moved = Connection.objects.filter(
        Q(last_success_at__isnull=True) | Q(last_success_at__lte=now - SUCCESS_RECORD_INTERVAL),
        pk=connection.pk).update(last_success_at=now)
    if moved:
        connection.last_success_at = now
    return bool(moved)


def record_connection_error(connection: Connection, error: str, *, now) -> None:
    """The connection's last error: a failed test, or a write-back the source refused for the
    connection's own sake (a revoked token, a removed App)."""
    error = error[:Connection._meta.get_field("last_error").max_length]
    Connection.objects.filter(pk=connection.pk).update(last_error=error, last_error_at=now)
    connection.last_error, connection.last_error_at = error, now


def check_webhook_connection(webhook: Webhook, connection: Connection | None) -> None:
    """ValidationError unless ``connection`` may write back for ``webhook``: one of its
    source's kinds (a GitHub webhook takes a github_app or github_token connection), and the
    same owner (a webhook writes back only as its own operator's identity)."""
    if connection is None:
        return
    source = senders.CONNECTION_SOURCE.get(connection.kind)
    if source != webhook.source:
        kinds = [s.kind for s in senders.get_sender(webhook.source).connections]
        raise ValidationError({"connection": (
            f"connection {connection.name} is {connection.kind}; a {webhook.source} webhook "
            + (f"takes {' or '.join(kinds)}" if kinds else "writes nothing back"))})
    if connection.owner_id != webhook.owner_id:
        raise ValidationError({"connection": (
            f"connection {connection.name} and webhook {webhook.slug} have different owners; a "
            "webhook writes back only under its owner's connections")})


def check_connection_owner(connection: Connection, owner) -> None:
    """ValidationError naming the webhooks that write back under ``connection`` unless
    ``owner`` owns them all: moving a connection to another operator would have their
    webhooks write back under someone else's identity (``check_webhook_connection``'s rule)."""
    if connection.pk is None or owner is None or owner.pk == connection.owner_id:
        return
    slugs = list(Webhook.objects.filter(connection=connection).exclude(owner=owner)
                 .order_by("slug").values_list("slug", flat=True)[:MAX_NAMED_WEBHOOKS + 1])
    if slugs:
        named = ", ".join(slugs[:MAX_NAMED_WEBHOOKS]) + (
            ", …" if len(slugs) > MAX_NAMED_WEBHOOKS else "")
        raise ValidationError({"owner": (
            f"webhooks of another owner write back under connection {connection.name}: "
            f"{named}; a webhook writes back only under its owner's connections, so choose "
            "another connection for them (set_connection) before moving this one")})


def set_webhook_connection(webhook: Webhook, connection: Connection | None) -> None:
    """Write back for ``webhook`` under ``connection`` (None: write nothing back).
    ValidationError as ``check_webhook_connection``."""
    check_webhook_connection(webhook, connection)
    Webhook.objects.filter(pk=webhook.pk).update(connection=connection)
    webhook.connection = connection
