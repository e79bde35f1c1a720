"""Hand-written hot statements: their cursors, and how their whole-row results become model
instances (``model_columns``, ``instance_from_row``; used by the transitions, the MCP bearer
check and the doorbell). The cursors serve the hook's fixed statements (the webhook lookup,
the delivery-event insert, the doorbell's endpoint read).

On PostgreSQL they bind parameters server-side, so psycopg prepares each statement after a few
runs on a connection (settings set ``prepare_threshold``) and the planner's work is done once
per connection instead of per call: Django's default client-side binding sends literal SQL
that PostgreSQL parses and plans every time (measured: the webhook lookup cost the server
0.22 ms a call that way, 0.08 ms prepared). The todo transitions have their own path
(todos/transitions.py, ``_fetch_rows_postgres``). The rest of Django
keeps its default. Wrapped like any Django cursor, so query logging and the query-count tests
still see them. Server-side binding types each parameter: pass Python values of the column's
type (JSON as text needs an explicit ``::jsonb``).
"""

import functools

from django.db import DEFAULT_DB_ALIAS, connection, connections


@functools.cache
def is_postgres() -> bool:
    # One process talks to one database for its life (settings are read once), and the hot
    # paths ask this per statement: asking the connection proxy each time showed in profiles.
    return connection.vendor == "postgresql"


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
