"""Reads on endpoints shared by the MCP transport, the board and the commands."""

import hmac

from django.db import connection
from django.utils import timezone

from switchboard import statements

from .models import Endpoint, hash_credential


def find_endpoint_for_credential(slug: str, credential: str, *, now=None, join_sql: str = "",
                                 join_columns=None, join_params=None) -> Endpoint | None:
    """The active endpoint ``slug`` if ``credential`` is one of its live credentials, else None.

    Looked up by digest (an index probe, no timing signal about other endpoints); the digest is
    compared again in constant time so a future change of lookup cannot open a timing oracle.
    Nothing is cached: a rotated-out, expired or deactivated credential fails on its next use.

    ``join_sql`` / ``join_columns`` (``{attribute: SQL expression}``) / ``join_params``: a
    caller's LEFT JOIN onto ``e`` (this endpoint's row), whose expressions come back as
    attributes of the endpoint. That lets a check of the caller's own rows ride on this one
    statement: the MCP transport checks the request's session here, one round trip per request
    instead of two. Raw SQL rather than the ORM because this runs on every MCP request, and
    building the query cost more CPU than running it (profiled: ORM ~1.5 ms of ~3.4 ms per
    tool call; RawQuerySet still ~0.26 ms against ~0.14 ms for this).
    """
    if not credential:
        return None
    now = now or timezone.now()
    select, names, _, _ = statements.model_columns(Endpoint, "e")
    extra = dict(join_columns or {})
    params = {**(join_params or {}), "slug": slug, "digest": hash_credential(credential),
              "now": connection.ops.adapt_datetimefield_value(now)}
    sql = (
        f"SELECT {select}, c.digest{''.join(f', {expression}' for expression in extra.values())}"
        f" FROM endpoints_credential c JOIN endpoints_endpoint e ON e.id = c.endpoint_id{join_sql}"
        " WHERE c.digest = %(digest)s AND e.slug = %(slug)s AND e.active"
        " AND (c.expires_at IS NULL OR c.expires_at > %(now)s) LIMIT 1"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    if row is None or not hmac.compare_digest(row[len(names)], params["digest"]):
        return None
    endpoint = statements.instance_from_row(Endpoint, "e", row[:len(names)])
    for attribute, value in zip(extra, row[len(names) + 1:]):
        setattr(endpoint, attribute, value)
    return endpoint


def get_endpoint(slug: str) -> Endpoint:
    return Endpoint.objects.get(slug=slug)


def visible_endpoints(user):
    """The endpoints an operator may see and act on: their own; a superuser sees all."""
    if not getattr(user, "is_authenticated", False):
        return Endpoint.objects.none()
    if user.is_superuser:
        return Endpoint.objects.all()
    return Endpoint.objects.filter(owner_id=user.pk)


def can_see_endpoint(user, endpoint_id) -> bool:
    return visible_endpoints(user).filter(pk=endpoint_id).exists()
