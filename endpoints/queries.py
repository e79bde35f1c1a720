"""Reads on endpoints shared by the MCP transport, the board and the commands."""

import functools
import hmac

from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone

from switchboard.db import statements

from .models import Endpoint, hash_credential


def credential_rights_sql(credential: str = "c", endpoint: str = "e", owner: str = "u", *,
                          now_param: str = "now") -> tuple[str, str]:
    """``(joins, condition)``, over a credential row aliased ``credential``, that hold only while
    that credential still gives its rights (docs/security.md): unexpired (or in its rotation grace),
    its endpoint active, the endpoint's owner active. The one spelling of that rule, shared by
    the bearer check of every MCP request and the re-check of every stream keep-alive (and the
    sweep that ends sessions whose credential lost its rights). Expects the time as the named
    parameter ``now_param``."""
    users = get_user_model()._meta.db_table
    joins = (
        f" JOIN endpoints_endpoint {endpoint} ON {endpoint}.id = {credential}.endpoint_id"
        f" AND {endpoint}.active"
        f" JOIN {users} {owner} ON {owner}.id = {endpoint}.owner_id AND {owner}.is_active"
    )
    return joins, (f"({credential}.expires_at IS NULL"
                   f" OR {credential}.expires_at > %({now_param})s)")


def endpoint_active_sql(endpoint_id: str) -> str:
    """SQL that holds while the endpoint whose id is the SQL expression ``endpoint_id`` (another
    table's column) is active, as one EXISTS the caller's statement carries (a primary-key
    probe)."""
    return f"EXISTS (SELECT 1 FROM endpoints_endpoint ae WHERE ae.id = {endpoint_id} AND ae.active)"


def credential_gives_rights_sql(credential_id: str, *, now_param: str) -> str:
    """SQL that holds while the credential whose id is the SQL expression ``credential_id``
    (another table's column, say an MCP session's) still gives its rights
    (``credential_rights_sql``), as one EXISTS the caller's statement carries. Expects the time
    as the named parameter ``now_param``."""
    joins, rights = credential_rights_sql("sc", "se", "su", now_param=now_param)
    return (f"EXISTS (SELECT 1 FROM endpoints_credential sc{joins}"
            f" WHERE sc.id = {credential_id} AND {rights})")


def find_endpoint_for_credential(slug: str, credential: str, *, now=None, join_sql: str = "",
                                 join_columns=None, join_params=None) -> Endpoint | None:
    """The active endpoint ``slug`` of an active owner if ``credential`` is one of its live
    credentials, else None. ``endpoint.credential_id`` is the credential's row id (MCP sessions
    are bound to it).

    Looked up by digest (an index probe, no timing signal about other endpoints); the digest is
    compared again in constant time so a future change of lookup cannot open a timing oracle.
    Nothing is cached: a rotated-out, expired or deactivated credential (or owner) fails on its
    next use.

    ``join_sql`` / ``join_columns`` (``{attribute: SQL expression}``) / ``join_params``: a
    caller's LEFT JOIN onto ``e`` (this endpoint's row) and ``c`` (the credential's), whose
    expressions come back as attributes of the endpoint. That lets a check of the caller's own
    rows ride on this one statement: the MCP transport checks the request's session here, one
    round trip per request instead of two. Raw SQL rather than the ORM because this runs on
    every MCP request, and building the query (even as a RawQuerySet) cost more CPU than
    running it.
    """
    if not credential:
        return None
    now = now or timezone.now()
    _, names, _, _ = statements.model_columns(Endpoint, "e")
    extra = dict(join_columns or {})
    params = {**(join_params or {}), "slug": slug, "digest": hash_credential(credential),
              "now": connection.ops.adapt_datetimefield_value(now)}
    sql = _credential_lookup_sql(join_sql, tuple(extra.values()))
    # Prepared and read by psycopg's loaders: planning it, and Django's conversion of the row,
    # each cost about as much as the lookup.
    row = next(iter(statements.fetch_all(sql, params)), None)
    if row is None or not hmac.compare_digest(row[len(names)], params["digest"]):
        return None
    endpoint = statements.instance_from_fetched(Endpoint, "e", row[:len(names)])
    endpoint.credential_id = row[len(names) + 1]
    for attribute, value in zip(extra, row[len(names) + 2:]):
        setattr(endpoint, attribute, value)
    return endpoint


@functools.lru_cache(maxsize=32)
def _credential_lookup_sql(join_sql: str, join_expressions: tuple) -> str:
    """The text of ``find_endpoint_for_credential``'s statement: fixed per caller, so built
    once (each caller passes constant join SQL; the cache only bounds a careless one)."""
    select, _, _, _ = statements.model_columns(Endpoint, "e")
    joins, rights = credential_rights_sql("c", "e", "u")
    extra = "".join(f", {expression}" for expression in join_expressions)
    return (
        f"SELECT {select}, c.digest, c.id{extra}"
        f" FROM endpoints_credential c{joins}{join_sql}"
        f" WHERE c.digest = %(digest)s AND e.slug = %(slug)s AND {rights} LIMIT 1"
    )


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
