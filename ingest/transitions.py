"""Writes of the ingest app: webhooks and their routes, secret rotation, operator tokens, and
the one write that matters — an accepted arrival becoming todos (CONTRACT §5).

An arrival is ONE transaction: its delivery event and every routed todo (each through
``todos.transitions.create_todo``), all or none. Doorbells and board updates are published by
``create_todo`` through ``publish_on_commit``, so nothing is announced for a delivery that rolls
back, and a Redis outage cannot fail the write (the publish helper logs and drops).
"""

import base64
import hashlib
import logging
import secrets
from dataclasses import dataclass, field
from datetime import timedelta

from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.utils import timezone

from endpoints.models import queue_name_validator
from switchboard import statements
from todos import transitions as todo_transitions

from .models import (DeliveryEvent, OperatorSecret, OperatorToken, Route, Source, TrustMode,
                     Webhook)
from .verification import STANDARD_SECRET_PREFIX, decode_standard_secret

log = logging.getLogger("switchboard.ingest")

DEFAULT_SECRET_ROTATION_GRACE = timedelta(hours=24)
OPERATOR_SOURCE = "operator"
# Operator keys live in their own namespace: "@" cannot appear in a webhook slug, so an
# operator-chosen key can never collide with "<webhook slug>:<delivery id>".
OPERATOR_KEY_PREFIX = "@operator:"


# -- webhooks ------------------------------------------------------------------------------------


def mint_webhook_secret(source: str) -> str:
    """A fresh secret in the shape the source expects (Standard Webhooks: whsec_ + base64 of
    32 random bytes; Stripe: whsec_…; others: an opaque token). Unsigned webhooks have none."""
    if source == Source.UNSIGNED:
        return ""
    if source == Source.STANDARD:
        return STANDARD_SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()
    if source == Source.STRIPE:
        return STANDARD_SECRET_PREFIX + secrets.token_hex(24)
    return secrets.token_urlsafe(32)


def check_webhook_secret(source: str, secret: str) -> None:
    """Raise ValueError when ``secret`` cannot work for ``source``."""
    if source == Source.UNSIGNED:
        if secret:
            raise ValueError("unsigned webhooks take no secret")
        return
    if len(secret) < 16:
        raise ValueError("a webhook secret must be at least 16 characters")
    if len(secret) > 200:
        raise ValueError("a webhook secret must be at most 200 characters")
    if source == Source.STANDARD:
        try:
            decode_standard_secret(secret)
        except ValueError:
            raise ValueError("a Standard Webhooks secret is whsec_ followed by base64") from None


@transaction.atomic
def create_webhook(*, slug: str, owner, source: str, secret: str | None = None) -> tuple[Webhook, str]:
    """Create a webhook. Returns ``(webhook, secret)``: ``secret`` is the one given, or a
    fresh one (the only moment a minted secret is shown)."""
    if source not in Source.values:
        raise ValueError(f"unknown source {source!r}; one of {', '.join(Source.values)}")
    secret = mint_webhook_secret(source) if secret is None else secret
    check_webhook_secret(source, secret)
    webhook = Webhook(slug=slug, owner=owner, source=source, secret=secret)
    webhook.full_clean()
    webhook.save()
    return webhook, secret


@transaction.atomic
def rotate_webhook_secret(webhook: Webhook, *, secret: str | None = None,
                          grace=DEFAULT_SECRET_ROTATION_GRACE, now=None) -> str:
    """Install a new secret; the current one stays accepted until ``now + grace`` so the sender
    can be reconfigured without dropping deliveries. Returns the new secret."""
    now = now or timezone.now()
    secret = mint_webhook_secret(webhook.source) if secret is None else secret
    check_webhook_secret(webhook.source, secret)
    Webhook.objects.filter(pk=webhook.pk).update(
        previous_secret=webhook.secret, previous_secret_expires_at=now + grace, secret=secret
    )
    webhook.refresh_from_db()
    return secret


def check_route_target(*, webhook: Webhook, endpoint, queue: str) -> None:
    """Raise ValidationError when ``webhook`` may not route to ``endpoint``/``queue``: the queue
    must lie in the endpoint's scope (its agent could never see the todos otherwise), and the
    webhook and endpoint must have the same owner (every todo is attributed to the webhook's
    owner, who must be the endpoint's own human; §3). Admin forms and the command both call
    this, so neither can create such a route."""
    errors = {}
    if not endpoint.covers(queue):
        errors["queue"] = f"queue {queue!r} is outside endpoint {endpoint.slug}'s scope {endpoint.scope}"
    if webhook.owner_id != endpoint.owner_id:
        errors["endpoint"] = (f"webhook {webhook.slug} and endpoint {endpoint.slug} have different "
                              f"owners; a webhook routes only to its owner's endpoints")
    if errors:
        raise ValidationError(errors)


def add_webhook_route(*, webhook: Webhook, endpoint, queue: str, kinds=None) -> Route:
    queue_name_validator(queue)
    with transaction.atomic():
        # The endpoint row locked, as endpoints.transitions.set_scope locks it: a route and a
        # concurrent narrowing of the scope are serialized, so neither sees the other half-done.
        endpoint = type(endpoint).objects.select_for_update().get(pk=endpoint.pk)
        check_route_target(webhook=webhook, endpoint=endpoint, queue=queue)
        route = Route(webhook=webhook, endpoint=endpoint, queue=queue, kinds=list(kinds or []))
        route.full_clean()
        route.save()
    return route


def route_in_scope(route: Route) -> bool:
    """A route whose queue its endpoint's scope no longer covers delivers nothing: the todo
    would be one no agent of the endpoint can see, and nobody would be rung for it. Narrowing
    a scope is refused while routes target queues outside it (``Endpoint.clean``); this guard
    holds against a route that raced the narrowing, and says so in the log."""
    if route.endpoint.covers(route.queue):
        return True
    log.warning("route skipped: queue outside its endpoint's scope", extra={
        "webhook": route.webhook_id, "endpoint": route.endpoint.slug, "queue": route.queue})
    return False


def route_matches(route: Route, kind: str) -> bool:
    """An empty filter takes every kind; ``issues`` takes ``issues`` and ``issues.*``."""
    if not route.kinds:
        return True
    event = kind.partition(".")[0]
    return kind in route.kinds or event in route.kinds


# -- arrivals ------------------------------------------------------------------------------------


@dataclass
class Arrival:
    """What a delivery turned into: its event (None when every todo was a duplicate of a live
    one, and the redundant event was not kept) and ``[(todo, created), …]`` in route order."""

    delivery_event: DeliveryEvent | None
    todos: list = field(default_factory=list)


def idempotency_key_for(webhook: Webhook, delivery_id: str, body_sha256: str) -> str:
    return f"{webhook.slug}:{delivery_id or body_sha256}"


def first_route_per_endpoint(routes) -> dict:
    """``{endpoint id: lowest route pk}`` over ALL the webhook's routes (not only the ones a
    delivery matches), so a route's key does not depend on the event kind or on routes added
    later."""
    first = {}
    for route in routes:
        if route.endpoint_id not in first or route.pk < first[route.endpoint_id]:
            first[route.endpoint_id] = route.pk
    return first


def route_idempotency_key(route: Route, key: str, first_routes: dict) -> str:
    """Keys are unique per endpoint, so two routes into queues of ONE endpoint would collapse
    into one todo. The endpoint's first route keeps the contract's plain key (§5), which
    therefore never changes shape when a route is added; every further route to that
    endpoint appends its queue."""
    return key if first_routes.get(route.endpoint_id) == route.pk else f"{key}/{route.queue}"


_DELIVERY_EVENT_FIELDS = ("webhook_id", "trust", "delivery_id", "received_at", "body_sha256",
                          "attributed_to_id", "source", "kind")
# Written by hand: every arrival inserts one, and the ORM's create() (signals, field
# preparation, the compiler) cost several times the CPU of the statement on the hot path.
_INSERT_DELIVERY_EVENT_SQL = (
    f"INSERT INTO {DeliveryEvent._meta.db_table} ({', '.join(_DELIVERY_EVENT_FIELDS)})"
    f" VALUES ({', '.join(['%s'] * len(_DELIVERY_EVENT_FIELDS))}) RETURNING id"
)


def record_delivery_event(**values) -> DeliveryEvent:
    """Insert one delivery event (``values`` keyed by ``_DELIVERY_EVENT_FIELDS``); the caller
    holds the transaction."""
    row = [values[name] for name in _DELIVERY_EVENT_FIELDS]
    params = list(row)
    params[3] = connection.ops.adapt_datetimefield_value(params[3])
    with statements.statement_cursor() as cursor:
        cursor.execute(_INSERT_DELIVERY_EVENT_SQL, params)
        (event_id,) = cursor.fetchone()
    return DeliveryEvent.from_db(connection.alias, ("id", *_DELIVERY_EVENT_FIELDS),
                                 [event_id, *row])


def ingest_delivery(*, webhook: Webhook, routes, trust: str, delivery_id: str, kind: str,
                    title: str, payload: dict, body_sha256: str, now=None) -> Arrival:
    """Record one verified webhook delivery and create one todo per matching route, in one
    transaction: all of them or none (an exception rolls the whole delivery back).

    ``routes`` are the webhook's routes with their endpoints loaded (the view already has
    them). Redelivery of a key whose todo is live returns that todo (``created`` False). When
    *every* todo was a duplicate the new delivery event is rolled back, so redeliveries do not
    pile up empty records; the answer then names the original event.
    """
    now = now or timezone.now()
    matching = [r for r in routes if r.endpoint.active and route_matches(r, kind)
                and route_in_scope(r)]
    key = idempotency_key_for(webhook, delivery_id, body_sha256)
    first_routes = first_route_per_endpoint(routes)
    with transaction.atomic():
        event = record_delivery_event(
            webhook_id=webhook.pk, trust=trust, delivery_id=delivery_id, received_at=now,
            body_sha256=body_sha256, attributed_to_id=webhook.owner_id, source=webhook.source,
            kind=kind,
        )
        results = [
            todo_transitions.create_todo(
                endpoint=route.endpoint, queue=route.queue, title=title, actor=f"webhook:{webhook.slug}",
                payload=payload, kind=kind, source=webhook.source,
                idempotency_key=route_idempotency_key(route, key, first_routes),
                delivery_event=event, trust=trust, now=now,
            )
            for route in matching
        ]
        if results and not any(created for _, created in results):
            transaction.set_rollback(True)
            event = None
    return Arrival(delivery_event=event, todos=results)


# -- operator hand-offs (ADR-0040) ---------------------------------------------------------------


def _with_secret_refs(payload: dict, secret_values: dict) -> tuple[dict, list[OperatorSecret]]:
    """Replace each secret by a ``{"$secret": ref}`` under ``payload["secrets"]``; the values
    go to OperatorSecret rows (saved once the todo exists)."""
    rows, refs = [], {}
    for name, value in secret_values.items():
        row = OperatorSecret(ref=OperatorSecret.mint_ref(), name=name,
                             ciphertext=OperatorSecret.seal(value))
        rows.append(row)
        refs[name] = {"$secret": row.ref}
    if refs:
        payload = {**payload, "secrets": refs}
    return payload, rows


def hand_over_todo(*, endpoint, operator, queue: str, title: str, payload=None, kind: str = "",
                   idempotency_key: str | None = None, secret_values=None, body_sha256: str = "",
                   now=None):
    """An operator hands ``endpoint`` a todo: a delivery event of trust ``operator`` naming the
    human, the todo (rung exactly like a verified webhook's), and its secrets encrypted apart.

    Returns ``(todo, created)``. A live todo holding the same idempotency key is returned
    instead, and nothing of this call is kept (no event, no secrets, no ring). The caller has
    checked that ``operator`` owns ``endpoint``.
    """
    now = now or timezone.now()
    key = OPERATOR_KEY_PREFIX + idempotency_key if idempotency_key else None
    with transaction.atomic():
        event = record_delivery_event(
            webhook_id=None, trust=TrustMode.OPERATOR, delivery_id=idempotency_key or "",
            received_at=now, body_sha256=body_sha256, attributed_to_id=operator.pk,
            source=OPERATOR_SOURCE, kind=kind,
        )
        payload, secret_rows = _with_secret_refs(payload or {}, secret_values or {})
        todo, created = todo_transitions.create_todo(
            endpoint=endpoint, queue=queue, title=title, actor=operator.get_username(),
            payload=payload, kind=kind, source=OPERATOR_SOURCE, idempotency_key=key,
            delivery_event=event, trust=TrustMode.OPERATOR, now=now,
        )
        if not created:
            transaction.set_rollback(True)
            return todo, False
        for row in secret_rows:
            row.todo = todo
        OperatorSecret.objects.bulk_create(secret_rows)
    return todo, True


# -- operator tokens -----------------------------------------------------------------------------


def mint_operator_token(*, user, name: str = "") -> tuple[OperatorToken, str]:
    """A personal API token for ``user``. Returns ``(row, token)``; the plaintext exists only in
    this return value."""
    token = OperatorToken.mint()
    row = OperatorToken.objects.create(
        user=user, name=name, digest=OperatorToken.hash(token), hint=token[:12]
    )
    return row, token


def revoke_operator_tokens(tokens, *, now=None) -> int:
    now = now or timezone.now()
    return tokens.filter(revoked_at__isnull=True).update(revoked_at=now)


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()
