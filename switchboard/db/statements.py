"""Hand-written hot statements: their cursors, and how their whole-row results become model
instances (``model_columns``, ``instance_from_row``; used by the transitions, the MCP bearer
check and the doorbell). The cursors serve the hook's fixed statements (the webhook lookup,
the delivery-event insert, the doorbell's endpoint read).

On PostgreSQL they bind parameters server-side, so psycopg prepares each statement after a few runs
on a connection (settings set ``prepare_threshold``) and the planner's work is done once per
connection instead of per call: Django's default client-side binding sends literal SQL that
PostgreSQL parses and plans every time, and on these short statements parsing and planning cost the
server more than running them. The hottest statements take ``fetch_rows`` (prepared on first use,
psycopg's C loaders). The rest of Django keeps its default. Wrapped like any Django cursor, so query
logging and the query-count tests still see them. Server-side binding types each parameter: pass
Python values of the column's type (JSON as text needs an explicit ``::jsonb``).
"""

import functools
import time
import weakref

import psycopg
from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.models import signals
from django.db.models.base import ModelState
from psycopg.types.datetime import TimestamptzLoader
from psycopg.types.json import JsonbLoader

from .sql import is_postgres


def statement_cursor():
    """A cursor for a fixed statement text: prepared after a few runs on PostgreSQL, Django's
    ordinary cursor elsewhere."""
    if not is_postgres():
        return connection.cursor()
    from django.db.backends.postgresql.base import ServerBindingCursor

    db = connections[DEFAULT_DB_ALIAS]  # one proxy lookup, not three
    db.ensure_connection()
    return db._prepare_cursor(ServerBindingCursor(db.connection))


@functools.cache
def model_columns(model, table_alias: str):
    """How hand-written SQL reads whole rows of ``model``: a select list of its columns over
    ``table_alias``, their attribute names, and the ORM's database-to-Python converters (JSON
    text, SQLite's datetime text). Worked out once per process: building a query (ORM or raw
    queryset) per call cost more CPU than running it on these paths."""
    fields = model._meta.concrete_fields
    quote = connection.ops.quote_name
    select = ", ".join(f"{table_alias}.{quote(field.column)}" for field in fields)
    compiler = model.objects.none().query.get_compiler(connection=connection)
    converters = compiler.get_converters([field.get_col(table_alias) for field in fields])
    return select, tuple(field.attname for field in fields), compiler, converters


def instance_from_row(model, table_alias: str, values):
    """A ``model`` instance from the values of ``model_columns``' select list, in order."""
    _, attnames, compiler, converters = model_columns(model, table_alias)
    if converters:
        values = next(iter(compiler.apply_converters([values], converters)))
    return model.from_db(DEFAULT_DB_ALIAS, attnames, values)


# -- the hot statements' own path to PostgreSQL ---------------------------------------------------
#
# Through Django's cursor wrapper and Python-level loaders, reading a row of these per-operation
# statements cost about as much CPU as running them. The C loaders are registered once per
# psycopg connection on one reusable cursor (a connection belongs to one thread at a time).


_CURSORS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _loaded_cursor(pg_connection) -> psycopg.Cursor:
    """One cursor per psycopg connection with the C loaders registered once (a connection
    belongs to one thread at a time; the cursor dies with it)."""
    cursor = _CURSORS.get(pg_connection)
    if cursor is None or cursor.closed:
        cursor = psycopg.Cursor(pg_connection)
        cursor.adapters.register_loader("timestamptz", TimestamptzLoader)
        cursor.adapters.register_loader("jsonb", JsonbLoader)
        _CURSORS[pg_connection] = cursor
    return cursor


def fetch_rows(sql: str, params) -> list[tuple]:
    """PostgreSQL only: run a fixed statement text and return its rows. The hottest code in
    switchboard (every todo transition, the MCP bearer check, the webhook lookup, the
    one-statement delivery) takes this path.

    A plain psycopg cursor on Django's connection, so the transaction, the pool and the error
    translation (``wrap_database_errors``: an IntegrityError stays Django's) are Django's, but:

    * parameters are bound server-side and each statement is PREPAREd on first use per
      connection (``prepare=True``; ``DATABASE_PREPARED_STATEMENTS=false`` turns it off), so the
      planner's work is done once per connection, not per call: unprepared, planning cost
      PostgreSQL more than running the claim+complete cycle's statements. These
      are a small fixed set of texts, which is what prepared statements suit (a connection
      pooler in front must support them, as PgBouncer >= 1.21 in transaction mode does);
    * timestamptz and jsonb are read by psycopg's own (C) loaders; the connection's time zone
      is UTC (Django sets it), so the values are the same aware datetimes and dicts.

    Query logging (DEBUG, ``CaptureQueriesContext``, the one-query-per-transition tests) still
    sees every statement. ``connection.execute_wrapper`` hooks do not; nothing here uses them.
    """
    db = connections[DEFAULT_DB_ALIAS]  # one proxy lookup, not several
    db.ensure_connection()
    db.validate_no_broken_transaction()  # as Django's cursors do inside a failed atomic block
    started = time.monotonic() if db.queries_logged else None
    with db.wrap_database_errors:
        cursor = _loaded_cursor(db.connection)
        cursor.execute(sql, params, prepare=True)
        rows = cursor.fetchall()
    if started is not None:
        db.queries_log.append({"sql": sql, "time": f"{time.monotonic() - started:.3f}"})
    return rows


def instance_from_loaded_row(model, table_alias: str, values):
    """A ``model`` instance from a ``fetch_rows`` row of ``model_columns``' select list: the
    values are final (no converters to apply), so the instance is made as ``Model.from_db``
    makes it without running ``__init__`` field by field, unless something listens for the
    model's init signals (then ``from_db`` itself, so they still fire)."""
    _, attnames, _, _ = model_columns(model, table_alias)
    if signals.pre_init.has_listeners(model) or signals.post_init.has_listeners(model):
        return model.from_db(DEFAULT_DB_ALIAS, attnames, values)
    instance = model.__new__(model)
    instance.__dict__.update(zip(attnames, values))
    instance._state = ModelState()
    instance._state.adding = False
    instance._state.db = DEFAULT_DB_ALIAS
    return instance


def fetch_all(sql: str, params) -> list[tuple]:
    """The rows of a fixed statement: by ``fetch_rows`` on PostgreSQL, through a statement
    cursor elsewhere. Turn a row's whole-model part into an instance with
    ``instance_from_fetched``."""
    if is_postgres():
        return fetch_rows(sql, params)
    with statement_cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


def instance_from_fetched(model, table_alias: str, values):
    """A ``model`` instance from a ``fetch_all`` row's values of ``model_columns``' select
    list, whichever backend read it."""
    if is_postgres():
        return instance_from_loaded_row(model, table_alias, values)
    return instance_from_row(model, table_alias, values)
