"""Writes of the ingest app: webhooks and their routes, secret rotation, operator tokens, and the
one write that matters — an accepted arrival becoming todos (docs/architecture.md#a-webhooks-path).

An arrival is ONE transaction: its delivery event and every routed todo (each through
``todos.transitions.create_todo``), all or none. Doorbells and board updates are published by
``create_todo`` through ``publish_on_commit``, so nothing is announced for a delivery that rolls
back, and a Redis outage cannot fail the write (the publish helper logs and drops).
"""

import contextlib
import functools
import hashlib
import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

import psycopg
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import DataError, connection, models, transaction
from django.utils import timezone

from channels_push.bus import publish
from endpoints.models import queue_name_validator
from switchboard import json_input, ratelimit, tracing
from switchboard.db import statements
from todos import queries as todo_queries
from todos import statements as todo_statements
from todos import transitions as todo_transitions
from todos.models import WriteBack as WriteBackLevel

from . import actors, connections, senders, threads
from .models import (DeliveryEvent, DeliveryRecord, FollowUps, OperatorSecret, OperatorToken,
                     Outcome, ReplayLedgerEntry, Route, Source, TrustMode, Webhook)

log = logging.getLogger("switchboard.ingest")

DEFAULT_SECRET_ROTATION_GRACE = timedelta(hours=24)


# Said plainly whenever an unsigned webhook is made or shown (docs/security.md#anonymous-senders):
# add_webhook, the admin, the webhook's page. Its URL is its only secret.
def unsigned_warning() -> str:
    """The warning, naming the body cap this process enforces (the setting, not its default)."""
    cap = settings.SWITCHBOARD_UNSIGNED_MAX_BODY_BYTES
    size = f"{cap // 1024} KiB" if cap % 1024 == 0 else f"{cap} bytes"
    return ("unsigned: ANYONE WHO KNOWS THIS URL CAN CREATE WORK. Deliveries are recorded as trust "
            "unverified, never rung, and agents are told to treat them as data; endpoints with "
            "accept_unverified off never get them until you promote one. Bodies are capped at "
            f"SWITCHBOARD_UNSIGNED_MAX_BODY_BYTES ({size}).")


OPERATOR_SOURCE = "operator"
# The delivery log's reason for a delivery the loop guard filtered (docs/write-back.md).
OWN_WRITE_BACK = "own_write_back"
# Operator keys live in their own namespace: "@" cannot appear in a webhook slug, so an
# operator-chosen key can never collide with "<webhook slug>:<delivery id>".
OPERATOR_KEY_PREFIX = "@operator:"


# -- webhooks ------------------------------------------------------------------------------------


def mint_webhook_secret(source: str) -> str:
    """A fresh secret in the shape the source expects (Standard Webhooks: whsec_ + base64 of
    32 random bytes; Stripe: whsec_…; others: an opaque token). Unsigned webhooks have none."""
    return senders.get_sender(source).mint_secret()


def check_webhook_secret(source: str, secret: str) -> None:
    """Raise ValueError when ``secret`` cannot work for ``source``."""
    sender = senders.get_sender(source)
    if sender.signed and len(secret) < 16:
        raise ValueError("a webhook secret must be at least 16 characters")
    if sender.signed and len(secret) > 200:
        raise ValueError("a webhook secret must be at most 200 characters")
    sender.check_secret(secret)


@transaction.atomic
def create_webhook(*, slug: str, owner, source: str, secret: str | None = None,
                   connection=None) -> tuple[Webhook, str]:
    """Create a webhook, writing back under ``connection`` when given
    (``connections.check_webhook_connection``). Returns ``(webhook, secret)``: ``secret`` is
    the one given, or a fresh one (the only moment a minted secret is shown)."""
    if source not in Source.values:
        raise ValueError(f"unknown source {source!r}; one of {', '.join(Source.values)}")
    secret = mint_webhook_secret(source) if secret is None else secret
    check_webhook_secret(source, secret)
    webhook = Webhook(slug=slug, owner=owner, source=source, secret=secret, connection=connection)
    connections.check_webhook_connection(webhook, connection)
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


def drop_previous_webhook_secrets(webhooks) -> int:
    """End a rotation's grace now: only the current secret verifies from here on. Returns how
    many webhooks still had a previous secret."""
    return webhooks.exclude(previous_secret="").update(previous_secret="",
                                                       previous_secret_expires_at=None)


def check_route_target(*, webhook: Webhook, endpoint, queue: str) -> None:
    """Raise ValidationError when ``webhook`` may not route to ``endpoint``/``queue``: the queue
    must lie in the endpoint's scope (its agent could never see the todos otherwise), and the
    webhook and endpoint must have the same owner (every todo is attributed to the webhook's
    owner, who must be the endpoint's own human). Admin forms and the command both call
    this, so neither can create such a route."""
    errors = {}
    if not endpoint.covers(queue):
        errors["queue"] = f"queue {queue!r} is outside endpoint {endpoint.slug}'s scope {endpoint.scope}"
    if webhook.owner_id != endpoint.owner_id:
        errors["endpoint"] = (f"webhook {webhook.slug} and endpoint {endpoint.slug} have different "
                              f"owners; a webhook routes only to its owner's endpoints")
    if errors:
        raise ValidationError(errors)


def add_webhook_route(*, webhook: Webhook, endpoint, queue: str, kinds=None,
                      priority: int = 0, delay_seconds: int = 0, actors_allowed=None,
                      author_associations=None, requires_approval: bool = False,
                      write_back: str = WriteBackLevel.STATUS,
                      agent_permissions: dict | None = None, follow_ups: str = "",
                      thread_key: str = "", stop_kinds=None, stop: bool = True) -> Route:
    """Route ``webhook``'s deliveries to ``endpoint``/``queue``, for every kind or ``kinds``,
    from anyone or only from the ``actors_allowed`` logins and ``author_associations`` roles
    (ingest/actors.py); its todos start with ``priority`` and become ready ``delay_seconds``
    after they arrive (docs/work-control.md); with ``requires_approval`` they are created
    awaiting approval; ``write_back`` is what their source hears of them when the webhook has a
    connection (docs/write-back.md); ``agent_permissions`` what a repository token for its
    todos may do (docs/write-back.md#repository-tokens-for-agents). Threads
    (docs/work-control.md#threads): ``follow_ups`` (``coalesce``, ``new``, ``skip``; "" the
    sender's default), ``thread_key`` (a template, "" the sender's key), ``stop_kinds`` (kinds
    that also end a thread), ``stop`` (False: no delivery ends one). Raises ValidationError
    naming the field when the target
    is not allowed (``check_route_target``), a value is out of range or the actor rules cannot
    apply to the webhook's source, before anything is written."""
    queue_name_validator(queue)
    stop_kinds = check_thread_options(follow_ups, thread_key, stop_kinds)
    if stop_kinds and not stop:
        raise ValidationError({"stop_kinds": "kinds that end a thread on a route that no "
                                             "delivery may stop (--no-stop): choose one"})
    try:
        logins, roles = senders.normalized_actor_rules(webhook.source, actors_allowed,
                                                       author_associations)
    except ValueError as bad:
        field, _, message = str(bad).partition(": ")
        raise ValidationError({field: message}) from None
    with transaction.atomic():
        # The endpoint row locked, as endpoints.transitions.set_scope locks it: a route and a
        # concurrent narrowing of the scope are serialized, so neither sees the other half-done.
        endpoint = type(endpoint).objects.select_for_update().get(pk=endpoint.pk)
        check_route_target(webhook=webhook, endpoint=endpoint, queue=queue)
        route = Route(webhook=webhook, endpoint=endpoint, queue=queue, kinds=list(kinds or []),
                      priority=priority, delay_seconds=delay_seconds,
                      actors=logins, author_associations=roles,
                      requires_approval=requires_approval, write_back=write_back,
                      agent_permissions=dict(agent_permissions or {}),
                      follow_ups=follow_ups, thread_key=thread_key, stop_kinds=stop_kinds,
                      stop=stop)
        route.full_clean()
        route.save()
    return route


def check_thread_options(follow_ups: str, thread_key: str, stop_kinds) -> list:
    """A route's thread options, or ValidationError naming the field; the stop kinds as
    stored (stripped, each once)."""
    if follow_ups and follow_ups not in FollowUps.values:
        raise ValidationError({"follow_ups": f"one of {', '.join(FollowUps.values)}"})
    if thread_key:
        try:
            threads.check_template(thread_key)
        except ValueError as bad:
            raise ValidationError({"thread_key": str(bad).partition(": ")[2]}) from None
    if stop_kinds is not None and (isinstance(stop_kinds, str) or not all(
            isinstance(kind, str) for kind in stop_kinds)):
        raise ValidationError({"stop_kinds": "a list of kinds"})
    kinds = list(dict.fromkeys(kind.strip() for kind in stop_kinds or [] if kind.strip()))
    if any(len(kind) > 200 or not kind.isprintable() for kind in kinds):
        raise ValidationError({"stop_kinds": "kinds are printable, at most 200 characters"})
    return kinds


def route_work_control(route: Route, now) -> dict:
    """What a todo created by ``route`` at ``now`` starts with: its priority, when it is
    ready (None: at once), and what its source hears of it (the route's ``write_back`` when
    the webhook has a connection to write under, else nothing)."""
    delay = timedelta(seconds=route.delay_seconds) if route.delay_seconds else None
    return {"priority": route.priority, "not_before": now + delay if delay else None,
            "write_back": route.write_back if route.webhook.connection_id else WriteBackLevel.OFF}


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


def is_route_stranded(route: Route) -> bool:
    """True when the route's webhook and endpoint no longer have the same owner: the endpoint
    was given to another operator (or the webhook was), after the route was made."""
    return route.webhook.owner_id != route.endpoint.owner_id


def route_owned(route: Route) -> bool:
    """A route delivers only while its webhook's owner owns the target endpoint. The check is
    made here, where the route is used, not only when it was made: giving an endpoint to another
    operator must stop the old owner's webhooks (and their redeliveries) writing into it at
    once, whichever way the owner changed. The route stays, shown as stranded to both owners,
    until one of them removes it."""
    if not is_route_stranded(route):
        return True
    log.warning("route skipped: its webhook's owner does not own the endpoint (stranded)", extra={
        "webhook": route.webhook_id, "endpoint": route.endpoint.slug, "queue": route.queue})
    return False


def route_matches(route: Route, kind: str) -> bool:
    """An empty filter takes every kind; ``issues`` takes ``issues`` and ``issues.*``. A kind
    in ``senders.OPT_IN_KINDS`` (a Slack thread's notice) only where the route names it."""
    if kind in senders.OPT_IN_KINDS:
        return kind in route.kinds
    if not route.kinds:
        return True
    event = kind.partition(".")[0]
    return kind in route.kinds or event in route.kinds


# -- arrivals ------------------------------------------------------------------------------------


@dataclass
class Arrival:
    """What a delivery turned into: its event (None when every todo was a duplicate of a live
    one, and the redundant event was not kept) and ``[(todo, created), …]`` in route order;
    the outcome the delivery log recorded, and its record."""

    delivery_event: DeliveryEvent | None
    todos: list = field(default_factory=list)
    outcome: str = Outcome.ACCEPTED
    record: DeliveryRecord | None = None
    # Threads (docs/work-control.md#threads): ids of the todos in ``todos`` this delivery
    # became a follow-up of, of those it stopped, and of those it was dropped for (``skip``).
    followups: frozenset = frozenset()
    stopped: list = field(default_factory=list)
    coalesced: list = field(default_factory=list)


@dataclass(frozen=True)
class ThreadPlan:
    """What a route does with a delivery on a thread: its key (None: no thread), the key it
    holds the thread by (only when it coalesces or skips), its policy, and whether the
    delivery ends the thread instead of making work."""

    thread: str | None = None
    live_key: str | None = None
    policy: str = FollowUps.NEW
    stops: bool = False


def plan_thread(webhook: Webhook, route: Route, kind: str, payload,
                first_routes: dict) -> ThreadPlan:
    """``first_routes``: ``first_route_per_endpoint`` of the webhook's routes."""
    thread = threads.thread_of(route, webhook.source, kind, payload)
    if thread is None:
        return ThreadPlan()
    policy = threads.follow_up_policy(route, webhook.source)
    further = None if first_routes.get(route.endpoint_id) == route.pk else route.pk
    return ThreadPlan(
        thread=thread, policy=policy,
        live_key=threads.live_key(webhook.pk, thread, further)
        if policy != FollowUps.NEW else None,
        stops=threads.ends_thread(route, webhook.source, kind, payload))


@dataclass(frozen=True)
class Observed:
    """What the delivery log keeps of one request besides its outcome: what the sender claimed
    and where it came from, never the body or a secret header."""

    address: str = ""
    size: int = 0
    body_sha256: str = ""
    delivery_id: str = ""
    kind: str = ""
    headers: dict = field(default_factory=dict)  # safe_headers() of the request


# Headers that carry a signature, token or secret in some sender's scheme, and a pattern for
# the ones nobody listed yet: none of them is ever written to the delivery log.
SECRET_HEADERS = frozenset({
    "x-hub-signature", "x-hub-signature-256", "x-gitea-signature", "x-forgejo-signature",
    "x-gogs-signature", "x-gitlab-token", "stripe-signature", "webhook-signature",
    "linear-signature", "x-slack-signature", "sentry-hook-signature", "authorization",
    "proxy-authorization", "cookie", "set-cookie", "x-api-key", "x-switchboard-token",
})
_SECRET_HEADER_RE = re.compile(r"signature|token|secret|authori[sz]ation|cookie|api[-_]?key|"
                               r"password|credential|session", re.IGNORECASE)
SAFE_HEADERS_MAX = 40
SAFE_HEADER_VALUE_MAX_CHARS = 300


def is_secret_header(name: str) -> bool:
    return name.lower() in SECRET_HEADERS or bool(_SECRET_HEADER_RE.search(name))


def safe_headers(headers: dict) -> dict:
    """A request's headers fit to log and show: every secret-bearing one left out, values made
    printable and capped, at most SAFE_HEADERS_MAX of them."""
    kept = {}
    for name, value in headers.items():
        name = _printable(str(name).lower(), 100)
        if not name or is_secret_header(name):
            continue
        kept[name] = _printable(value, SAFE_HEADER_VALUE_MAX_CHARS)
        if len(kept) >= SAFE_HEADERS_MAX:
            break
    return kept


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
    """Keys are unique per endpoint, so two routes into queues of ONE endpoint would collapse into
    one todo. The endpoint's first route keeps the plain key (docs/reference.md#idempotency), which
    therefore never changes shape when a route is added; every further route to that endpoint
    appends its queue."""
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


# -- the arrival's own rows: delivery event, replay ledger entry, delivery log record ------------

_LEDGER = ReplayLedgerEntry._meta.db_table
_RECORD = DeliveryRecord._meta.db_table
_RECORD_FIELDS = ("webhook_id", "at", "outcome", "status", "delivery_id", "kind", "size",
                  "body_sha256", "source_address", "reason", "delivery_event_id", "todo_ids",
                  "redelivered_from_id", "attributed_to_id", "headers")
# The ledger takes a fingerprint that nothing holds, whose holder is past the replay window, or
# (``same_id_redelivers``) that comes again with the same delivery id and kind after making
# todos: a redelivery. The kind must match because those senders do not sign its header.
_LEDGER_TAKES_OVER = ("l.accepted_at < %(window_start)s"
                      " OR (%(same_id_redelivers)s AND l.made_todos"
                      " AND l.delivery_id = %(delivery_id)s AND l.kind = %(kind)s)")
_LEDGER_UPSERT = (
    f"INSERT INTO {_LEDGER} AS l (webhook_id, fingerprint, delivery_id, kind, accepted_at,"
    " made_todos, delivery_event_id) {source} ON CONFLICT (webhook_id, fingerprint) DO UPDATE"
    " SET delivery_id = EXCLUDED.delivery_id, kind = EXCLUDED.kind,"
    " accepted_at = EXCLUDED.accepted_at, made_todos = EXCLUDED.made_todos,"
    f" delivery_event_id = EXCLUDED.delivery_event_id WHERE {_LEDGER_TAKES_OVER} RETURNING 1"
)
_LEDGER_VALUES = ("VALUES (%(webhook_id)s, %(fingerprint)s, %(delivery_id)s, %(kind)s, %(now)s,"
                  " %(made_todos)s, %(event_id)s)")
# True when the ledger would refuse the fingerprint (``_LEDGER_UPSERT`` would return no row).
_LEDGER_REFUSES_SQL = (
    f"EXISTS (SELECT 1 FROM {_LEDGER} l WHERE l.webhook_id = %(webhook_id)s"
    f" AND l.fingerprint = %(fingerprint)s AND NOT ({_LEDGER_TAKES_OVER}))"
)
_RECORD_COLUMNS = ", ".join(_RECORD_FIELDS)


def _record_values(event_ref: str) -> str:
    names = [f"%(r_{name})s" for name in _RECORD_FIELDS]
    names[_RECORD_FIELDS.index("delivery_event_id")] = event_ref
    if statements.is_postgres():
        # In a SELECT list an untyped parameter (None, JSON text) is resolved as text, which
        # the id and jsonb columns would refuse: say what they are.
        for name, cast in (("todo_ids", "jsonb"), ("headers", "jsonb"),
                           ("redelivered_from_id", "bigint"),
                           ("attributed_to_id", "bigint")):
            names[_RECORD_FIELDS.index(name)] = f"%(r_{name})s::{cast}"
    return ", ".join(names)


def _arrival_ctes_postgres(with_ledger: bool, only_if_sql: str = "") -> str:
    """``WITH event AS (…), ledger AS (…), record AS (…)``: the delivery event, the ledger
    entry (when ``with_ledger``) and the log record, which is written only when the ledger
    took the fingerprint. With ``only_if_sql`` the event (and so everything that hangs on it)
    is inserted only when that condition holds."""
    event_columns = ", ".join(_DELIVERY_EVENT_FIELDS)
    if only_if_sql:
        # INSERT … SELECT types a parameter in the select list, not from its column: each is
        # cast, strings to text (a ::varchar(n) would cut a long value silently).
        fields = [DeliveryEvent._meta.get_field(name) for name in _DELIVERY_EVENT_FIELDS]
        typed = ", ".join(
            f"%(e_{name})s::"
            f"{'text' if isinstance(field, models.CharField) else field.db_type(connection)}"
            for name, field in zip(_DELIVERY_EVENT_FIELDS, fields))
        event_rows = f"SELECT {typed} WHERE {only_if_sql}"
    else:
        values = ", ".join(f"%(e_{name})s" for name in _DELIVERY_EVENT_FIELDS)
        event_rows = f"VALUES ({values})"
    ledger = ""
    if with_ledger:
        ledger = ", ledger AS (" + _LEDGER_UPSERT.format(
            source="SELECT %(webhook_id)s, %(fingerprint)s, %(delivery_id)s, %(kind)s, %(now)s,"
                   " %(made_todos)s, event.id"
                   " FROM event") + ")"
    return (
        f"WITH event AS (INSERT INTO {DeliveryEvent._meta.db_table} ({event_columns})"
        f" {event_rows} RETURNING id){ledger},"
        f" record AS (INSERT INTO {_RECORD} ({_RECORD_COLUMNS})"
        f" SELECT {_record_values('event.id')} FROM event{_ledger_gate(with_ledger)} RETURNING id)"
    )


def _ledger_gate(with_ledger: bool) -> str:
    return " WHERE EXISTS (SELECT 1 FROM ledger)" if with_ledger else ""


@functools.cache
def _arrival_sql_postgres(with_ledger: bool) -> str:
    """Event, ledger entry and log record in ONE statement (PostgreSQL's data-modifying CTEs)."""
    return _arrival_ctes_postgres(with_ledger) + " SELECT event.id, (SELECT id FROM record) FROM event"


@functools.cache
def _single_route_sql_postgres(with_ledger: bool, writes_back: bool,
                               holds_thread: bool = False) -> str:
    """The whole of a one-route delivery in ONE statement: the arrival's rows (as
    ``_arrival_sql_postgres``) and the todo with its create event and, when it ``writes_back``,
    its outbox entry (``todos.transitions``' own statement pieces), the todo only when the
    ledger took the fingerprint.

    It must keep all or nothing, as the transaction it replaces did. When, as the statement
    starts, a live todo already holds the key or the ledger holds the fingerprint against this
    delivery (a redelivery, a replay: the ordinary ways to create nothing), it writes nothing
    and returns no row. When that changes while it runs (an identical delivery committing at
    the same moment), no todo is inserted and the last column divides by zero, so the
    statement fails and PostgreSQL undoes every row it wrote. ``(t.id IS NOT NULL)::int`` is a
    column, not a constant, so the planner cannot fold the division away.

    It is kept within what psycopg caches the parse of (``MAX_CACHED_STATEMENT_LENGTH``
    bytes, ``MAX_CACHED_STATEMENT_PARAMS`` parameters): past either, psycopg splits the text
    again on every delivery, which cost more daphne CPU than anything else write-back added
    (docs/decisions/one-statement-delivery.md). Hence ``t.*``, the columns ``t`` RETURNs in
    their order, rather than naming each again.

    ``holds_thread``: the todo is to hold its thread (a coalescing route); a live todo that
    holds it already is one more reason to write nothing, and the transaction path makes the
    follow-up."""
    todo = todo_statements.create_todo_ctes(
        delivery_event_sql="event.id", source_sql="FROM event", where_sql=_ledger_gate(with_ledger),
        writes_back=writes_back)
    creates_nothing = todo_statements.LIVE_KEY_HELD_SQL + (
        f" OR {_LEDGER_REFUSES_SQL}" if with_ledger else "") + (
        f" OR {todo_statements.LIVE_THREAD_HELD_SQL}" if holds_thread else "")
    arrival = _arrival_ctes_postgres(with_ledger, only_if_sql=f"NOT ({creates_nothing})")
    return (f"{arrival}, {todo}"
            " SELECT t.*, (SELECT id FROM record), 1 / (t.id IS NOT NULL)::int"
            " FROM event LEFT JOIN t ON true")


def _arrival_params(*, event_values: dict, record_values: dict, ledger: dict | None) -> dict:
    params = {f"e_{name}": value for name, value in event_values.items()}
    params.update({f"r_{name}": value for name, value in record_values.items()})
    params["e_received_at"] = connection.ops.adapt_datetimefield_value(params["e_received_at"])
    params["r_at"] = connection.ops.adapt_datetimefield_value(params["r_at"])
    if ledger is not None:
        params.update(ledger)
        params["now"] = connection.ops.adapt_datetimefield_value(params["now"])
        params["window_start"] = connection.ops.adapt_datetimefield_value(params["window_start"])
    return params


def _record_arrival(*, event_values: dict, record_values: dict, ledger: dict | None):
    """Insert the delivery event, take the ledger entry (when ``ledger`` is given) and insert
    the log record, inside the caller's transaction. Returns ``(event id, record id)``; the
    record id is None when the ledger refused the fingerprint (a replay or, for timestamped
    sources, a duplicate): the caller rolls back."""
    params = _arrival_params(event_values=event_values, record_values=record_values,
                             ledger=ledger)
    if statements.is_postgres():
        with statements.statement_cursor() as cursor:
            cursor.execute(_arrival_sql_postgres(ledger is not None), params)
            return tuple(cursor.fetchone())
    # SQLite has no data-modifying CTEs: the same three writes, one statement each.
    event = record_delivery_event(**event_values)
    params["event_id"] = event.pk
    with connection.cursor() as cursor:
        if ledger is not None:
            cursor.execute(_LEDGER_UPSERT.format(
                source=_LEDGER_VALUES), params)
            if cursor.fetchone() is None:
                return event.pk, None
        cursor.execute(f"INSERT INTO {_RECORD} ({_RECORD_COLUMNS})"
                       f" VALUES ({_record_values('%(event_id)s')}) RETURNING id", params)
        return event.pk, cursor.fetchone()[0]


def _printable(value: str, limit: int) -> str:
    # Claimed values are the sender's to fill: no NUL or control character reaches a column.
    value = str(value)[:limit * 2]
    if not value.isprintable():  # else there is nothing to drop: skip the walk
        value = "".join(ch for ch in value if ch.isprintable())
    return value[:limit]


# The delivery log's text columns, cut to the width the model declares.
_RECORD_WIDTH = {name: DeliveryRecord._meta.get_field(name).max_length
                 for name in ("delivery_id", "kind", "source_address", "reason")}


def _record_row(*, webhook_id, at, outcome, status, observed: Observed, reason="",
                delivery_event_id=None, todo_ids=(), redelivered_from_id=None,
                attributed_to_id=None) -> dict:
    return {
        "webhook_id": webhook_id, "at": at, "outcome": outcome, "status": status,
        "delivery_id": _printable(observed.delivery_id, _RECORD_WIDTH["delivery_id"]),
        "kind": _printable(observed.kind, _RECORD_WIDTH["kind"]),
        "size": observed.size, "body_sha256": observed.body_sha256,
        "source_address": _printable(observed.address, _RECORD_WIDTH["source_address"]),
        "reason": _printable(reason, _RECORD_WIDTH["reason"]),
        "delivery_event_id": delivery_event_id, "todo_ids": json.dumps([str(t) for t in todo_ids]),
        "redelivered_from_id": redelivered_from_id, "attributed_to_id": attributed_to_id,
        "headers": json.dumps(observed.headers),
    }


def deliveries_group(webhook_id: int) -> str:
    """The channel-layer group of a webhook page's live stream."""
    return f"ingest.deliveries.{webhook_id}"


def announce_record(webhook_id: int, record_id: int, outcome: str) -> None:
    publish.nudge_group_on_commit(
        deliveries_group(webhook_id),
        {"type": "stream.event", "event": "delivery",
         "data": {"id": str(record_id), "outcome": outcome}},
        context={"webhook": webhook_id, "record": record_id})


# Counters of refused deliveries per webhook and minute outlive their minute long enough for
# the fold sweep (every 15 s) to read their final value several times.
DROP_COUNTER_TTL_SECONDS = 600
DROP_COUNTER_SCOPE = "deliverylog"


def minute_of(now) -> int:
    return int(now.timestamp() // 60)


def record_refused(webhook: Webhook, *, outcome: str, status: int, observe,
                   reason: str = "", now, todo_ids=()) -> DeliveryRecord | None:
    """Log a delivery that created nothing, unless this webhook already logged
    SWITCHBOARD_DELIVERY_LOG_REFUSED_PER_MINUTE of them this minute: then it is only counted
    (``sweeps.fold_dropped_delivery_counts`` writes the counts), so a flood of anonymous
    requests costs at most the cap in rows. ``observe()`` gives the ``Observed`` facts, called
    only when the row is written (a dropped one costs no hashing of its body). Never raises:
    a log must not fail the answer."""
    try:
        count = ratelimit.count_hit(DROP_COUNTER_SCOPE, f"{webhook.pk}:{minute_of(now)}",
                                    ttl_seconds=DROP_COUNTER_TTL_SECONDS)
        if count > settings.SWITCHBOARD_DELIVERY_LOG_REFUSED_PER_MINUTE:
            return None
        row = _record_row(webhook_id=webhook.pk, at=now, outcome=outcome, status=status,
                          observed=observe(), reason=reason, todo_ids=todo_ids)
        row["todo_ids"] = json.loads(row["todo_ids"])
        row["headers"] = json.loads(row["headers"])
        # Its own (sub)transaction: a failed write must not poison a caller's transaction.
        with transaction.atomic():
            record = DeliveryRecord.objects.create(**row)
            announce_record(webhook.pk, record.pk, outcome)
        return record
    except Exception as exc:  # noqa: BLE001 — the answer matters more than its log row
        log.warning("delivery log write failed",
                    extra={"webhook": webhook.slug, "outcome": outcome, "error": type(exc).__name__})
        return None


def take_url_verification(webhook: Webhook, *, fingerprint: str, now) -> bool:
    """Enter Slack's signed url_verification handshake in the replay ledger (it makes no
    delivery event). Returns False when the ledger already holds this very request inside the
    replay window: a repeat, which the caller answers as the first and charges to its sender."""
    params = {"webhook_id": webhook.pk, "fingerprint": fingerprint, "delivery_id": "",
              "kind": "url_verification", "made_todos": False, "event_id": None,
              "same_id_redelivers": False,
              "now": connection.ops.adapt_datetimefield_value(now),
              "window_start": connection.ops.adapt_datetimefield_value(
                  now - settings.SWITCHBOARD_REPLAY_WINDOW)}
    with connection.cursor() as cursor:
        cursor.execute(_LEDGER_UPSERT.format(
            source=_LEDGER_VALUES), params)
        return cursor.fetchone() is not None


class Refused(Exception):
    """The ledger refused an arrival: a replay (another delivery id) or a repeat of a
    timestamped request (``duplicate_event_id`` names the accepted one)."""

    def __init__(self, outcome: str, duplicate_event_id=None):
        super().__init__(outcome)
        self.outcome = outcome
        self.duplicate_event_id = duplicate_event_id


def _ledger_verdict(webhook: Webhook, fingerprint: str, delivery_id: str, kind: str) -> Refused:
    entry = (ReplayLedgerEntry.objects.filter(webhook_id=webhook.pk, fingerprint=fingerprint)
             .values("delivery_id", "kind", "delivery_event_id").first())
    if entry is not None and entry["delivery_id"] == delivery_id and entry["kind"] == kind:
        return Refused(Outcome.DUPLICATE, entry["delivery_event_id"])
    return Refused(Outcome.REPLAY)


def _statement_scope():
    """Where the one-statement delivery runs: on its own in autocommit (a statement is its own
    transaction, and the after-commit publishing runs once it returns), inside a savepoint when
    a caller's transaction is open, so a statement that failed on purpose leaves that
    transaction usable for the fallback."""
    if connection.get_autocommit() and not connection.in_atomic_block:
        return contextlib.nullcontext()
    return transaction.atomic()


def _deliver_in_one_statement(*, webhook: Webhook, route: Route, idempotency_key: str,
                              title: str, payload: dict, payload_storable: bool, kind: str,
                              trust: str, now,
                              event_values: dict, record_values: dict, ledger: dict | None,
                              outcome: str, plan: ThreadPlan = ThreadPlan()) -> Arrival | None:
    """PostgreSQL, exactly one matching route (the common delivery): the delivery event, ledger
    entry, log record, todo and todo event as ONE autocommit statement
    (``_single_route_sql_postgres``) instead of a transaction of four round trips; what that
    saves is measured in docs/decisions/one-statement-delivery.md.

    Returns the arrival when the todo was created. Returns None, having written nothing, when
    it was not: the ledger refused the fingerprint, or a live todo holds the key (a redelivery,
    or a concurrent identical delivery that won). The caller then takes the transaction path,
    which decides what happened exactly as it always has; so this path only ever answers
    "accepted, created", and everything else keeps its one implementation. Only the race
    makes the statement fail (PostgreSQL logs that ERROR); a plain redelivery or replay is
    seen before anything is written."""
    params = _arrival_params(event_values=event_values, record_values=record_values,
                             ledger=ledger)
    params.update(todo_transitions.create_todo_params(
        endpoint=route.endpoint, queue=route.queue, title=title, actor=f"webhook:{webhook.slug}",
        payload=payload, kind=kind, source=webhook.source, idempotency_key=idempotency_key,
        trust=trust, now=now, payload_storable=payload_storable,
        requires_approval=route.requires_approval, thread=plan.thread,
        thread_live_key=plan.live_key, **route_work_control(route, now)))
    # Not in this statement (the event's id and detail come from its own rows): fewer
    # parameters for psycopg to cache the statement with.
    del params["detail"], params["delivery_event_id"]
    try:
        with _statement_scope():
            rows = statements.fetch_rows(_single_route_sql_postgres(
                ledger is not None, params["write_back"] != WriteBackLevel.OFF,
                plan.live_key is not None), params)
    except DataError as exc:
        if isinstance(exc.__cause__, psycopg.errors.DivisionByZero):
            return None  # the statement's own guard (a race): no todo, nothing kept
        raise
    if not rows:
        return None  # a live todo holds the key or the ledger refuses: nothing written
    (row,) = rows
    todo = todo_statements.todo_from_row(row[:-2])
    record_id = row[-2]
    event = DeliveryEvent.from_db(connection.alias, ("id", *_DELIVERY_EVENT_FIELDS),
                                  [todo.delivery_event_id, *event_values.values()])
    # Registered after the statement returned: in autocommit they run now, on durable rows;
    # inside a caller's transaction, when it commits.
    todo_transitions.announce_created(todo, route.endpoint)
    announce_record(webhook.pk, record_id, outcome)
    return Arrival(delivery_event=event, todos=[(todo, True)], outcome=outcome,
                   record=DeliveryRecord.from_db(connection.alias, ("id",), [record_id]))


def _admitted_by_actor(webhook: Webhook, routes, kind: str, payload) -> tuple[list, str]:
    """``routes`` without those whose actor rules the delivery's actor does not meet, and the
    delivery log's note naming who was filtered where ("" when none was). A filtered route
    creates nothing; when every route is filtered the delivery is logged ``filtered``. A Slack
    bot's message is read on every route: only a route listing the bot takes it."""
    if not senders.get_sender(webhook.source).reads_every_actor and not any(
            actors.filters_actors(route) for route in routes):
        return list(routes), ""
    actor = senders.event_actor(webhook.source, kind, payload)
    admitted = [route for route in routes if actors.admits(route, actor)]
    refused = [route for route in routes if route not in admitted]
    if not refused:
        return admitted, ""
    log.info("delivery filtered by actor", extra={
        "webhook": webhook.slug, "actor": actor.login[:100],
        "routes": [f"{route.endpoint.slug}/{route.queue}" for route in refused]})
    where = ", ".join(f"{route.endpoint.slug}/{route.queue}" for route in refused)
    return admitted, _printable(f"filtered {actor.describe()} on {where}", _RECORD_WIDTH["reason"])


def ingest_delivery(*, webhook: Webhook, routes, trust: str, delivery_id: str, kind: str,
                    title: str, payload: dict, body_sha256: str, observed: Observed | None = None,
                    payload_storable: bool = False,
                    fingerprint: str = "", timestamped: bool = False, status: int = 202,
                    attributed_to_id=None, idempotency_key: str | None = None,
                    redelivered_from_id=None, note: str = "", now=None,
                    joins_threads: bool = True) -> Arrival:
    """Record one verified webhook delivery and create one todo per matching route, in one
    transaction: all of them or none (an exception rolls the whole delivery back).

    ``routes`` are the webhook's routes with their endpoints loaded (the view already has
    them). ``payload_storable``: the caller knows ``payload`` is storable
    (``json_input.is_plainly_storable`` of the text it was parsed from), so it is not walked
    again. Redelivery of a key whose todo is live returns that todo (``created`` False). When
    *every* todo was a duplicate the new delivery event is rolled back, so redeliveries do not
    pile up empty records; the answer then names the original event.

    With a ``fingerprint`` the replay ledger is consulted in the statement that writes the
    delivery event and the log record: a fingerprint held under another delivery id inside
    SWITCHBOARD_REPLAY_WINDOW raises ``Refused("replay")`` — and any repeat of the same
    delivery raises ``Refused("duplicate")`` unless its sender redelivers under the same id
    (``senders.Sender.redelivers_under_its_id``, not ``timestamped``) and the first made
    todos — with nothing written. The log record of a duplicate is written after the rollback
    (``record_refused``).

    Threads (docs/work-control.md#threads): per route, a delivery on a thread whose todo is
    live becomes its follow-up (``coalesce``) or is dropped (``skip``), and one that ends its
    thread stops its todos instead of making one; ``joins_threads`` False (an operator's
    redelivery) makes every route's todo anew, keeping only the thread key.
    """
    now = now or timezone.now()
    observed = observed or Observed(body_sha256=body_sha256, delivery_id=delivery_id, kind=kind)
    candidates = [r for r in routes if r.endpoint.active and route_matches(r, kind)
                  and route_in_scope(r) and route_owned(r)]
    matching, filtered = _admitted_by_actor(webhook, candidates, kind, payload)
    own = senders.is_own_write_back(webhook, kind, payload)
    if own:
        # The loop guard: switchboard's own write-back coming back makes nothing, anywhere.
        matching, filtered = [], OWN_WRITE_BACK
    if filtered:
        note = "; ".join(filter(None, [note, filtered]))
    key = idempotency_key or idempotency_key_for(webhook, delivery_id, body_sha256)
    first_routes = first_route_per_endpoint(routes)
    attributed_to_id = attributed_to_id or webhook.owner_id
    event_values = {
        "webhook_id": webhook.pk, "trust": trust, "delivery_id": delivery_id, "received_at": now,
        "body_sha256": body_sha256, "attributed_to_id": attributed_to_id,
        "source": webhook.source, "kind": kind,
    }
    outcome = (Outcome.ACCEPTED if matching
               else Outcome.FILTERED if candidates or own else Outcome.NO_ROUTE)
    record_values = _record_row(webhook_id=webhook.pk, at=now, outcome=outcome, status=status,
                                observed=observed, reason=note,
                                redelivered_from_id=redelivered_from_id,
                                attributed_to_id=attributed_to_id if redelivered_from_id else None)
    ledger = None
    if fingerprint:
        ledger = {"webhook_id": webhook.pk, "fingerprint": fingerprint, "delivery_id": delivery_id,
                  "kind": kind, "now": now, "window_start": now - settings.SWITCHBOARD_REPLAY_WINDOW,
                  "same_id_redelivers": not timestamped and senders.get_sender(
                      webhook.source).redelivers_under_its_id,
                  "made_todos": bool(matching)}
    if matching and not payload_storable:
        # Checked once for the whole delivery, never once per route: the body may be an
        # anonymous one, and its cost must not grow with the routes it reaches.
        reason = json_input.unstorable_reason(payload)
        if reason is not None:
            raise todo_transitions.Refusal("invalid_argument", f"payload {reason}")
        payload_storable = True
    plans = [plan_thread(webhook, route, kind, payload, first_routes) for route in matching]
    if not joins_threads:
        plans = [ThreadPlan(thread=plan.thread) for plan in plans]
    if len(matching) == 1 and statements.is_postgres() and not plans[0].stops:
        route = matching[0]
        arrival = _deliver_in_one_statement(
            webhook=webhook, route=route, title=title, payload=payload, kind=kind, trust=trust,
            payload_storable=payload_storable,
            idempotency_key=route_idempotency_key(route, key, first_routes), now=now,
            event_values=event_values, record_values=record_values, ledger=ledger,
            outcome=outcome, plan=plans[0])
        if arrival is not None:
            return arrival
    refused = None
    with transaction.atomic():
        event_id, record_id = _record_arrival(event_values=event_values,
                                              record_values=record_values, ledger=ledger)
        if record_id is None:
            transaction.set_rollback(True)
            refused = True
        else:
            event = DeliveryEvent.from_db(connection.alias, ("id", *_DELIVERY_EVENT_FIELDS),
                                          [event_id, *event_values.values()])
            threaded = _ThreadResults()
            results = []
            for route, plan in zip(matching, plans):
                if plan.stops:
                    threaded.stop(webhook, route, plan, now)
                    continue
                made = _create_or_follow_up(
                    webhook=webhook, route=route, plan=plan, event=event, threaded=threaded,
                    title=title, payload=payload, kind=kind, trust=trust, now=now,
                    idempotency_key=route_idempotency_key(route, key, first_routes))
                if made is not None:
                    results.append(made)
            if results and not any(created for _, created in results) and not threaded.any():
                transaction.set_rollback(True)
            else:
                outcome = threaded.outcome(outcome, results)
                if threaded.any():
                    _note_threads_in_record(record_id, outcome, threaded, note)
                announce_record(webhook.pk, record_id, outcome)
                record = DeliveryRecord.from_db(connection.alias, ("id",), [record_id])
                return Arrival(delivery_event=event, todos=results, outcome=outcome,
                               record=record, followups=frozenset(threaded.followups),
                               stopped=threaded.stopped, coalesced=threaded.coalesced)
    if refused:
        raise _ledger_verdict(webhook, fingerprint, delivery_id, kind)
    # Every todo was a live duplicate: nothing of this arrival was kept but its log line.
    record = record_refused(webhook, outcome=Outcome.DUPLICATE, status=status,
                            observe=lambda: observed, now=now, reason=note,
                            todo_ids=[todo.pk for todo, _ in results])
    return Arrival(delivery_event=None, todos=results, outcome=Outcome.DUPLICATE, record=record)


REDELIVERY_SPAN_NAME = "redeliver"


@dataclass
class _ThreadResults:
    """What a delivery's routes did on its thread besides making todos: the todos it became a
    follow-up of, stopped, or was dropped for."""

    followups: list = field(default_factory=list)
    stopped: list = field(default_factory=list)
    coalesced: list = field(default_factory=list)
    _stops_done: set = field(default_factory=set)

    def any(self) -> bool:
        return bool(self.followups or self._stops_done or self.coalesced)

    def stop(self, webhook: Webhook, route: Route, plan: ThreadPlan, now) -> None:
        # One stop per endpoint and thread, however many of its routes the delivery matched.
        if (route.endpoint_id, plan.thread) in self._stops_done:
            return
        self._stops_done.add((route.endpoint_id, plan.thread))
        self.stopped += todo_transitions.stop_thread(
            route.endpoint_id, plan.thread, webhook_id=webhook.pk,
            actor=f"webhook:{webhook.slug}", now=now)

    def outcome(self, outcome: str, results) -> str:
        """Accepted when the delivery made or joined work; else ``stopped`` when it ended a
        thread, ``coalesced`` when it was dropped for a live todo."""
        if any(created for _, created in results) or self.followups:
            return outcome
        if self._stops_done:
            return Outcome.STOPPED
        return Outcome.COALESCED if self.coalesced else outcome


def _create_or_follow_up(*, webhook: Webhook, route: Route, plan: ThreadPlan, event, threaded,
                         title: str, payload, kind: str, trust: str, idempotency_key: str, now):
    """The route's todo, ``(todo, created)``; or, when its thread's live todo holds the thread,
    that todo as ``(todo, False)`` with this delivery as its follow-up (``coalesce``), or None
    (``skip``). A todo that ends between the create's conflict and the follow-up frees its
    thread, so the create is tried again."""
    for _ in range(3):
        try:
            return todo_transitions.create_todo(
                endpoint=route.endpoint, queue=route.queue, title=title,
                actor=f"webhook:{webhook.slug}", payload=payload, kind=kind,
                source=webhook.source, idempotency_key=idempotency_key, delivery_event=event,
                trust=trust, now=now, payload_storable=True, **route_work_control(route, now),
                requires_approval=route.requires_approval, thread=plan.thread,
                thread_live_key=plan.live_key)
        except todo_transitions.ThreadHeld as held:
            if todo_queries.has_followup_of_delivery(
                    held.todo.pk, webhook_id=webhook.pk, delivery_id=event.delivery_id,
                    body_sha256=event.body_sha256):
                return held.todo, False  # a redelivery of a follow-up: a duplicate
            if plan.policy == FollowUps.SKIP:
                threaded.coalesced.append(str(held.todo.pk))
                return None
            followup = todo_transitions.add_followup(
                held.todo.pk, delivery_event=event, kind=kind, title=title,
                actor=senders.event_actor(webhook.source, kind, payload).login, trust=trust,
                payload=payload, now=now, event_actor=f"webhook:{webhook.slug}",
                payload_storable=True)
            if followup is not None:
                threaded.followups.append(str(held.todo.pk))
                followup.todo.endpoint = route.endpoint
                return followup.todo, False
    raise RuntimeError(f"thread {plan.thread!r} kept changing hands")


def _note_threads_in_record(record_id: int, outcome: str, threaded: _ThreadResults,
                            note: str) -> None:
    """The delivery log names the todos a delivery joined, stopped or was dropped for."""
    said = [f"follow-up of #{', #'.join(threaded.followups)}" if threaded.followups else "",
            f"stopped #{', #'.join(threaded.stopped)}" if threaded.stopped else "",
            f"dropped: #{', #'.join(threaded.coalesced)} is live on its thread"
            if threaded.coalesced else ""]
    reason = _printable("; ".join(filter(None, [note, *said])), _RECORD_WIDTH["reason"])
    todo_ids = list(dict.fromkeys(threaded.followups + threaded.stopped + threaded.coalesced))
    DeliveryRecord.objects.filter(pk=record_id).update(
        outcome=outcome, reason=reason, todo_ids=todo_ids)


def redeliver(record: DeliveryRecord, *, operator, routes, now=None) -> Arrival:
    """An operator sends an accepted delivery through the webhook's routes again: the payload
    its todos were created with (the body itself is never stored), as a new delivery attributed
    to ``operator`` (the redeliverer), under a fresh idempotency key, logged as "redelivered
    from #N". ``routes`` are the webhook's current routes (endpoints loaded).

    The new delivery keeps the original's trust: re-sending is not vouching for it, so an
    ``unverified`` original stays unverified (hidden from endpoints that refuse it, never
    rung), and only an explicit promote raises it. Its todos are new even on a live thread
    (no follow-ups: the operator asked for the work again); a delivery that became a follow-up
    is re-sent from the follow-up's payload. Raises ValueError when there is nothing to
    re-send (its todos and follow-ups were pruned)."""
    from todos.models import FollowUp, Todo

    if record.outcome != Outcome.ACCEPTED or record.delivery_event_id is None:
        raise ValueError("only an accepted delivery can be redelivered")
    original = DeliveryEvent.objects.filter(pk=record.delivery_event_id).only("trust").first()
    kept = (Todo.objects.filter(delivery_event_id=record.delivery_event_id).order_by("id")
            .only("payload", "kind", "traceparent").first())
    if kept is None:
        # A delivery folded into a live todo kept its payload on the follow-up row.
        kept = (FollowUp.objects.filter(delivery_event_id=record.delivery_event_id)
                .order_by("id").only("payload", "kind").first())
    if kept is None or original is None:
        raise ValueError("the delivery's todos are gone (pruned); nothing to re-send")
    webhook = record.webhook
    kind = kept.kind
    traceparent = getattr(kept, "traceparent", "")
    # Its own trace (the operator's act), linked to the original's.
    with tracing.delivery(REDELIVERY_SPAN_NAME, None, links=[traceparent] if traceparent else [],
                          **{"switchboard.webhook_id": webhook.pk,
                             "switchboard.source": webhook.source,
                             "switchboard.kind": kind}) as span:
        arrival = _redeliver(record, webhook, routes, original, kind, kept.payload, operator, now)
        span.set(**{"switchboard.todo_ids": [str(made.pk) for made, _ in arrival.todos]})
    return arrival


def _redeliver(record, webhook, routes, original, kind, payload, operator, now) -> Arrival:
    return ingest_delivery(
        webhook=webhook, routes=routes, trust=original.trust, delivery_id="", kind=kind,
        title=senders.derive_title(webhook.source, kind, payload, webhook_slug=webhook.slug),
        payload=payload, payload_storable=True,  # read back from a stored todo
        body_sha256=record.body_sha256,
        observed=Observed(size=record.size, body_sha256=record.body_sha256,
                          delivery_id=record.delivery_id, kind=kind),
        attributed_to_id=operator.pk,
        idempotency_key=f"{OPERATOR_KEY_PREFIX}redelivery:{uuid.uuid4().hex}",
        redelivered_from_id=record.pk, note=f"redelivered from #{record.pk}", now=now,
        joins_threads=False,
    )


# -- operator hand-offs (docs/reference.md#the-operator-api) --------------------------------------


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
                   priority: int = 0, not_before=None, requires_approval: bool = False,
                   max_cost_usd=None, thread=None, now=None):
    """An operator hands ``endpoint`` a todo: a delivery event of trust ``operator`` naming the
    human, the todo (rung exactly like a verified webhook's), and its secrets encrypted apart.
    ``requires_approval``: created awaiting approval (rung once approved); ``max_cost_usd``:
    its own cost limit, over the endpoint's (docs/reference.md#usage-and-budgets); ``thread``:
    its thread key, shown with it (it takes no follow-ups: docs/work-control.md#threads).

    Returns ``(todo, created)``. A live todo holding the same idempotency key is returned
    instead, and nothing of this call is kept (no event, no secrets, no ring). The caller has
    checked that ``operator`` owns ``endpoint``. ``priority`` and ``not_before`` (a resolved
    time, ``todos.transitions.resolve_not_before``) as for any todo (docs/work-control.md).
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
            delivery_event=event, trust=TrustMode.OPERATOR, now=now, priority=priority,
            not_before=not_before, requires_approval=requires_approval,
            max_cost_usd=max_cost_usd, thread=thread,
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
