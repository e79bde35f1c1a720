"""Reads of the ingest app used by more than one surface (hook view, operator API, MCP verbs)."""

import json
from datetime import timezone as dt_timezone

from cryptography.fernet import InvalidToken
from django.db import connection
from django.db.models import Count, Q
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from endpoints.models import Endpoint
from switchboard.db import statements
from todos import queries as todo_queries
from todos.models import State, Todo
from todos.transitions import Refusal

from . import senders
from .models import (SECRET_REF_PREFIX, Connection, OperatorSecret, OperatorToken, Route,
                     Webhook, WriteBack, WriteBackState, WriteBackTally, unseal_text)


# The hook's one read, as SQL: the ORM's select_related over three models cost several times
# this statement's CPU. Endpoint fields not listed are deferred, so new ones need no change here.
_WEBHOOK_FIELDS = ["id", "slug", "owner_id", "source", "secret", "previous_secret",
                   "previous_secret_expires_at", "active", "created_at", "connection_id"]
# In the model's field order: Model.from_db reads a partial row's values in that order.
_ROUTE_FIELDS = ["id", "webhook_id", "endpoint_id", "queue", "kinds", "actors",
                 "author_associations", "priority", "delay_seconds", "requires_approval",
                 "write_back", "follow_ups", "thread_key", "stop_kinds", "stop"]
_ROUTE_JSON_COLUMNS = [_ROUTE_FIELDS.index(name) for name in ("kinds", "actors",
                                                               "author_associations",
                                                               "stop_kinds")]
_ROUTE_BOOL_COLUMNS = [_ROUTE_FIELDS.index(name) for name in ("requires_approval", "stop")]
_ENDPOINT_FIELDS = ["id", "slug", "owner_id", "scope", "max_attempts", "active"]
# What the loop guard compares a delivery's actor with (senders.is_own_write_back).
_CONNECTION_FIELDS = ["id", "kind", "app_id", "identity", "identity_id"]
_WEBHOOK_WITH_ROUTES_SQL = (
    "SELECT " + ", ".join(f"w.{name}" for name in _WEBHOOK_FIELDS) + ", "
    + ", ".join(f"c.{name}" for name in _CONNECTION_FIELDS) + ", "
    + ", ".join(f"r.{name}" for name in _ROUTE_FIELDS) + ", "
    + ", ".join(f"e.{name}" for name in _ENDPOINT_FIELDS)
    + " FROM ingest_webhook w JOIN auth_user u ON u.id = w.owner_id"
    " LEFT JOIN ingest_connection c ON c.id = w.connection_id"
    " LEFT JOIN ingest_route r ON r.webhook_id = w.id"
    " LEFT JOIN endpoints_endpoint e ON e.id = r.endpoint_id"
    # An inactive owner's webhooks are as unknown as inactive ones (offboarding).
    " WHERE w.slug = %s AND w.active AND u.is_active ORDER BY r.id"
)


def _json_value(value):
    # PostgreSQL hands jsonb to Django as text (JSONField parses it); SQLite as text too.
    return json.loads(value) if isinstance(value, (str, bytes)) else value


def find_webhook_with_routes(slug: str) -> tuple[Webhook | None, list[Route]]:
    """The active webhook ``slug`` of an active owner and its routes (endpoints loaded), in route order, in one
    query; ``(None, [])`` when there is no such active webhook."""
    # The transitions' own path (on PostgreSQL prepared on first use, jsonb and timestamptz
    # read by psycopg's C loaders): Django's cursor wrapper and its Python loaders cost more
    # CPU than this statement on the hook's hot path.
    rows = statements.fetch_all(_WEBHOOK_WITH_ROUTES_SQL, [slug])
    if not rows:
        return None, []
    db = connection.alias
    route_width = len(_ROUTE_FIELDS)
    webhook_width = len(_WEBHOOK_FIELDS) + len(_CONNECTION_FIELDS)
    first = rows[0]
    webhook_values = list(first[:len(_WEBHOOK_FIELDS)])
    webhook_values[4] = unseal_text(webhook_values[4])
    webhook_values[5] = unseal_text(webhook_values[5])
    webhook_values[6] = _datetime(webhook_values[6])
    webhook_values[8] = _datetime(webhook_values[8])
    webhook = Webhook.from_db(db, _WEBHOOK_FIELDS, webhook_values)
    connection_values = list(first[len(_WEBHOOK_FIELDS):webhook_width])
    if connection_values[0] is not None:
        webhook.connection = Connection.from_db(db, _CONNECTION_FIELDS, connection_values)
    routes = []
    for row in rows:
        route_values = list(row[webhook_width:webhook_width + route_width])
        if route_values[0] is None:
            continue  # the LEFT JOIN row of a webhook without routes
        endpoint_values = list(row[webhook_width + route_width:])
        for column in _ROUTE_JSON_COLUMNS:
            route_values[column] = _json_value(route_values[column])
        # SQLite hands booleans over as 0/1.
        for column in _ROUTE_BOOL_COLUMNS:
            route_values[column] = bool(route_values[column])
        endpoint_values[3] = _json_value(endpoint_values[3])
        route = Route.from_db(db, _ROUTE_FIELDS, route_values)
        route.webhook = webhook
        route.endpoint = Endpoint.from_db(db, _ENDPOINT_FIELDS, endpoint_values)
        routes.append(route)
    return webhook, routes


def _datetime(value):
    """PostgreSQL returns aware datetimes; SQLite naive UTC ones (or text)."""
    if isinstance(value, str):
        value = parse_datetime(value)
    if value is not None and value.tzinfo is None:
        value = value.replace(tzinfo=dt_timezone.utc)
    return value


def find_operator_for_token(token: str):
    """The active user holding the unrevoked personal API token ``token``, or None. Looked up by
    digest, then compared again in constant time (as endpoint credentials are)."""
    if not token:
        return None
    row = (
        OperatorToken.objects.select_related("user")
        .filter(digest=OperatorToken.hash(token), revoked_at__isnull=True, user__is_active=True)
        .first()
    )
    if row is None or not row.matches(token):
        return None
    return row.user


def read_secret(caller, ref, *, todo_id=None) -> dict:
    """The ``read_secret`` agent verb: ``{"ref", "value"}`` for a secret ref found in a todo's
    payload, decrypted.

    ``caller`` is a ``todos.transitions.Caller``: the secret must belong to a todo of
    ``caller.endpoint`` in a queue the caller can see, which the caller holds under an
    unexpired lease (``lease_lost`` otherwise); with ``todo_id`` (a todo token's call), of
    that todo only. Refuses ``invalid_argument`` for a
    malformed ref and ``not_found`` otherwise — a secret of a todo outside the caller's endpoint
    or scope is indistinguishable from a missing one. Never logs the value.
    """
    if not isinstance(ref, str) or not ref.startswith(SECRET_REF_PREFIX) or len(ref) > 64:
        raise Refusal("invalid_argument", "ref must be a secret ref (sec_…) from a todo's payload")
    secret = (
        OperatorSecret.objects.filter(ref=ref, todo__endpoint_id=caller.endpoint.pk)
        .only("ref", "ciphertext", "todo_id").first()
    )
    if secret is None or (todo_id is not None and secret.todo_id != todo_id):
        raise Refusal("not_found", f"no secret {ref}")
    todo = (Todo.objects.filter(pk=secret.todo_id)
            .only("queue", "state", "lease_owner", "lease_expires_at").first())
    # A secret dies with its todo (docs/security.md#stored-secrets): from the moment the todo
    # ends it reads as missing, even before the sweep deletes it and after an operator
    # re-queues the dead letter.
    if todo is None or not caller.covers(todo.queue) or todo_queries.has_ended(todo.pk):
        raise Refusal("not_found", f"no secret {ref}")
    # Only the worker doing the job reads its secrets (docs/security.md#stored-secrets): the session
    # holding the todo's unexpired lease, not its siblings, and not after the work is handed back.
    if not (todo.state == State.CLAIMED and todo.lease_owner == caller.actor
            and todo.lease_expires_at is not None and todo.lease_expires_at > timezone.now()):
        raise Refusal("lease_lost", f"secret {ref} can be read only while this session holds "
                                    f"the lease on todo {todo.pk}; claim it first")
    try:
        value = secret.unseal()
    except InvalidToken:
        # The secrets key changed without keeping the old one (SWITCHBOARD_SECRETS_KEY list).
        raise Refusal("not_found", f"secret {ref} can no longer be decrypted") from None
    return {"ref": ref, "value": value}


def todos_of_delivery_event(event_id) -> list:
    """The todos one delivery event created, endpoints loaded, oldest first."""
    return list(Todo.objects.filter(delivery_event_id=event_id).select_related("endpoint")
                .order_by("id"))


def latest_deliveries(webhook, *, outcome=None, limit=200) -> list:
    """The webhook's delivery log, newest first, each with ``todo_id_list`` filled (the todos an
    accepted delivery created, through its event, or those a duplicate named) and
    ``redelivered_as`` (the records that re-sent it). Three queries."""
    from .models import DeliveryRecord

    records = (DeliveryRecord.objects.filter(webhook=webhook).select_related("attributed_to")
               .defer("headers"))  # shown only on a delivery's own page
    if outcome:
        records = records.filter(outcome=outcome)
    records = list(records.order_by("-id")[:limit])
    event_ids = [r.delivery_event_id for r in records if r.delivery_event_id]
    created = {}
    for todo_id, event_id in (Todo.objects.filter(delivery_event_id__in=event_ids)
                              .order_by("id").values_list("id", "delivery_event_id")):
        created.setdefault(event_id, []).append(str(todo_id))
    redelivered_as = {}
    for record_id, source_id in (DeliveryRecord.objects.filter(
            redelivered_from__in=[r.pk for r in records if r.outcome == "accepted"])
            .order_by("id").values_list("id", "redelivered_from_id")):
        redelivered_as.setdefault(source_id, []).append(record_id)
    for record in records:
        record.todo_id_list = created.get(record.delivery_event_id, []) or [
            str(t) for t in record.todo_ids or []]
        record.redelivered_as = redelivered_as.get(record.pk, [])
    return records


def delivery_as_dict(record) -> dict:
    """One delivery log entry as ``manage.py deliveries --json`` prints it
    (docs/commands.md#deliveries)."""
    return {
        "id": str(record.pk), "at": record.at.isoformat().replace("+00:00", "Z"),
        "outcome": record.outcome, "status": record.status, "delivery_id": record.delivery_id,
        "kind": record.kind, "size": record.size, "todos": record.todo_id_list,
        "reason": record.reason,
        "redelivered_from": str(record.redelivered_from_id) if record.redelivered_from_id else None,
    }


def find_connection(name: str) -> Connection | None:
    return Connection.objects.filter(name=name).first()


# A write-back the source refused, or one given up on: it waits for an operator's retry.
FAILING_WRITE_BACK_STATES = (WriteBackState.FAILED, WriteBackState.ABANDONED)
# A send failed and another is due or under way (``WriteBack.shown_state``'s "retrying").
RETRYING_WRITE_BACKS = Q(state__in=WriteBack.RETRYING_STATES, failing_since__isnull=False)


def latest_write_backs(*, todo_id=None, webhook=None, state=None, limit: int):
    """Write-backs newest first, of one todo, or of the todos one webhook's deliveries made,
    or all; in one ``state`` when given (``manage.py write_backs``)."""
    rows = WriteBack.objects.select_related("connection").order_by("-id")
    if todo_id is not None:
        rows = rows.filter(todo_id=todo_id)
    if webhook is not None:
        rows = rows.filter(todo__delivery_event__webhook=webhook)
    if state == WriteBack.RETRYING:
        rows = rows.filter(RETRYING_WRITE_BACKS)
    elif state:
        rows = rows.filter(state=state)
    return rows[:limit]


def count_write_back_outcomes() -> list[tuple]:
    """The write-back sender's durable tally for /metrics: ``(source, series, label, count,
    total_seconds)`` rows (``WriteBackTally``), a handful per source."""
    return list(WriteBackTally.objects.order_by("source", "series", "label").values_list(
        "source", "series", "label", "count", "total_seconds"))


def write_back_as_dict(row: WriteBack, *, now=None) -> dict:
    """``row`` as ``manage.py write_backs`` shows it: ``next_attempt_at`` while it waits, and
    ``held_until`` while its connection is held by a source's rate limit."""
    now = now or timezone.now()
    held = row.connection.held_until
    return {"id": row.pk, "todo": str(row.todo_id), "connection": row.connection.name,
            "action": row.action, "target": row.target_label, "url": write_back_url(row) or None,
            "state": row.state, "retrying": row.shown_state == WriteBack.RETRYING,
            "attempts": row.attempts, "last_error": row.last_error,
            "external_id": row.external_id or None,
            "sent_at": row.sent_at.isoformat() if row.sent_at else None,
            "next_attempt_at": (row.next_attempt_at.isoformat()
                                if row.next_attempt_at and row.state == WriteBackState.PENDING
                                else None),
            "held_until": held.isoformat() if held and held > now else None}


def write_back_url(row: WriteBack) -> str:
    """The web page of what ``row`` writes on (the issue, the comment), as its sender's client
    builds it from the connection's api_url and the target's checked segments; "" when the
    client links none."""
    source = senders.CONNECTION_SOURCE.get(row.connection.kind)
    client = senders.get_sender(source).write_back if source else None
    if client is None or client.target_url is None:
        return ""
    return client.target_url(row.connection, row.target)


def write_backs_of_todos(todo_ids) -> dict:
    """todo id -> its write-backs (the ack first), each with its ``url``: one query for any
    number of todos (a delivery may have made several)."""
    found = {}
    for row in (WriteBack.objects.filter(todo_id__in=list(todo_ids)).select_related("connection")
                .order_by("todo_id", "id")):
        row.url = write_back_url(row)
        found.setdefault(row.todo_id, []).append(row)
    return found




def write_back_trouble(webhook, *, limit: int) -> dict:
    """Of the write-backs of the todos ``webhook``'s deliveries made: how many are failing
    (failed or abandoned) and how many retrying (a send failed, another is due), and the
    latest ``limit`` failing ones (with their ``url``). Two queries."""
    rows = WriteBack.objects.filter(todo__delivery_event__webhook=webhook)
    counts = rows.aggregate(
        failing=Count("id", filter=Q(state__in=FAILING_WRITE_BACK_STATES)),
        retrying=Count("id", filter=RETRYING_WRITE_BACKS))
    latest = list(rows.filter(state__in=FAILING_WRITE_BACK_STATES).select_related("connection")
                  .order_by("-id")[:limit])
    for row in latest:
        row.url = write_back_url(row)
    return {**counts, "latest_failing": latest}


def repo_tokens_of(todo_id) -> list[dict]:
    """The repository tokens minted for ``todo_id``'s agents, oldest first, for its page:
    when, for which repository and permissions, revoked when; never the token."""
    from .models import RepoToken

    return list(RepoToken.objects.filter(todo_id=todo_id).order_by("issued_at", "id").values(
        "id", "lease_id", "repository", "permissions", "issued_at", "expires_at", "revoked_at",
        "revoke_error"))


def count_agent_credentials() -> list[tuple]:
    """For /metrics: ``(kind, issued, revoked)`` of todo tokens and repository tokens over the
    kept history (their rows go with their todo at the retention prune)."""
    from todos.models import TodoToken

    from .models import RepoToken

    rows = []
    for kind, model in (("todo_token", TodoToken), ("repo_token", RepoToken)):
        counted = model.objects.aggregate(issued=Count("pk"), revoked=Count("revoked_at"))
        rows.append((kind, counted["issued"], counted["revoked"]))
    return rows
