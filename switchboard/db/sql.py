"""The one copy of each fragment of hand-written SQL that differs between PostgreSQL and SQLite
(the embedded default): row locks, time and duration parameters, JSON parameters and lists of
ids or names. Every app's statements take these; none spells a backend's dialect itself."""

import functools
import json
from datetime import date, timedelta

from django.db import connection


@functools.cache
def is_postgres() -> bool:
    # One process talks to one database for its life (settings are read once), and the hot
    # paths ask this per statement: asking the connection proxy each time showed in profiles.
    return connection.vendor == "postgresql"


def skip_locked(of: str = "") -> str:
    """`` FOR UPDATE [OF of] SKIP LOCKED`` on PostgreSQL, so overlapping batches take different
    rows; nothing on SQLite, whose single writer never meets a row lock."""
    if not is_postgres():
        return ""
    return f" FOR UPDATE OF {of} SKIP LOCKED" if of else " FOR UPDATE SKIP LOCKED"


def db_time(value):
    """A datetime parameter as the backend stores it (SQLite keeps naive UTC text)."""
    if value is None or is_postgres():
        return value
    return connection.ops.adapt_datetimefield_value(value)


def db_date(value: date):
    """A date parameter as the backend stores it (SQLite keeps ISO text, as Django writes it)."""
    return value if is_postgres() else value.isoformat()


def bigint(param: str) -> str:
    """An integer parameter typed as a bigint on PostgreSQL, which cannot infer a NULL one's
    type from a comparison or a COALESCE."""
    return f"%({param})s::bigint" if is_postgres() else f"%({param})s"


def db_duration(value: timedelta):
    """A duration parameter as the backend stores it (SQLite: microseconds as an integer)."""
    if is_postgres():
        return value
    return int(value / timedelta(microseconds=1))


def plus_duration(at_param: str, duration_sql: str) -> str:
    """The datetime parameter ``at_param`` plus a duration column or expression.

    SQLite has no datetime type; Django registers ``django_format_dtdelta`` on every SQLite
    connection for exactly this sum, and it writes the text format Django stores."""
    if is_postgres():
        return f"%({at_param})s + {duration_sql}"
    return f"django_format_dtdelta('+', %({at_param})s, {duration_sql})"


def minus_seconds(at_param: str, seconds_sql: str) -> str:
    """The datetime parameter ``at_param`` less an integer column or expression of seconds."""
    if is_postgres():
        return f"%({at_param})s - make_interval(secs => {seconds_sql})"
    return f"datetime(%({at_param})s, '-' || {seconds_sql} || ' seconds')"


def jsonb(param: str) -> str:
    """A JSON text parameter, typed for a jsonb column on PostgreSQL."""
    return f"%({param})s::jsonb" if is_postgres() else f"%({param})s"


def json_merge(left_sql: str, right_sql: str) -> str:
    """The JSON object ``left_sql`` with the members of ``right_sql`` added (or replaced)."""
    if is_postgres():
        return f"({left_sql} || {right_sql})"
    return f"json_patch({left_sql}, {right_sql})"


def json_key_missing(column: str, key: str) -> str:
    """SQL true when the JSON object column ``column`` has no member ``key`` (or a null one);
    ``key`` is a constant of the caller's, never input."""
    if is_postgres():
        return f"{column} -> '{key}' IS NULL"
    return f"json_extract({column}, '$.{key}') IS NULL"


def text_list(values):
    """A parameter holding a list of names, for ``text_in``."""
    values = tuple(values)
    return _text_array_literal(values) if is_postgres() else json.dumps(list(values))


@functools.lru_cache(maxsize=4096)
def _text_array_literal(values: tuple) -> str:
    """``'{"a","b"}'`` for a ``::text[]`` parameter: a string psycopg sends as is, where a list
    is introspected and dumped element by element on every statement. Few distinct lists
    (queue scopes) exist, so each literal is built once."""
    quoted = ('"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"' for value in values)
    return "{" + ",".join(quoted) + "}"


def text_in(column: str, param: str) -> str:
    """``column`` is one of the names in the ``text_list`` parameter ``param``."""
    if is_postgres():
        return f"{column} = ANY(%({param})s::text[])"
    return f"{column} IN (SELECT value FROM json_each(%({param})s))"


def id_list(values):
    """A parameter holding a list of ids (or other scalars), for ``id_in``."""
    return list(values) if is_postgres() else json.dumps(list(values))


def id_in(column: str, param: str, params: dict, values) -> str:
    """``column`` is one of ``values``, bound as ``params[param]``."""
    params[param] = id_list(values)
    if is_postgres():
        return f"{column} = ANY(%({param})s)"
    return f"{column} IN (SELECT value FROM json_each(%({param})s))"


def id_text_pair_in(id_column: str, text_column: str, param: str, params: dict, pairs) -> str:
    """``(id_column, text_column)`` is one of ``pairs`` (``(id, name)`` each), bound under
    names starting with ``param``."""
    if is_postgres():
        params[f"{param}_ids"] = [first for first, _ in pairs]
        params[f"{param}_queues"] = [second for _, second in pairs]
        return (f"({id_column}, {text_column}) IN (SELECT * FROM"
                f" unnest(%({param}_ids)s::bigint[], %({param}_queues)s::text[]))")
    params[f"{param}_pairs"] = json.dumps(list(pairs))
    return (f"EXISTS (SELECT 1 FROM json_each(%({param}_pairs)s) j"
            f" WHERE json_extract(j.value, '$[0]') = {id_column}"
            f" AND json_extract(j.value, '$[1]') = {text_column})")


def json_rows(param: str, columns) -> str:
    """A ``SELECT`` of one row per element of the JSON array parameter ``param``, each element
    an array whose items become ``columns`` (``(name, PostgreSQL type)`` pairs, in order)."""
    if is_postgres():
        items = ", ".join(f"(r.value->>{i})::{kind} AS {name}"
                          for i, (name, kind) in enumerate(columns))
        return f"SELECT {items} FROM jsonb_array_elements({jsonb(param)}) r"
    items = ", ".join(f"json_extract(r.value, '$[{i}]') AS {name}"
                      for i, (name, _) in enumerate(columns))
    return f"SELECT {items} FROM json_each(%({param})s) r"


def json_entries(param: str) -> str:
    """The rows ``(key, value)`` of the JSON object parameter ``param``; a value is text on
    PostgreSQL and the JSON scalar on SQLite, so compare it through a cast."""
    if is_postgres():
        return f"jsonb_each_text({jsonb(param)})"
    return f"json_each(%({param})s)"


def json_member(param: str, key_sql: str) -> str:
    """The member named by ``key_sql`` of the JSON object parameter ``param`` (NULL when it has
    none), as text on PostgreSQL and the JSON scalar on SQLite."""
    if is_postgres():
        return f"({jsonb(param)} ->> {key_sql})"
    return f"(SELECT value FROM json_each(%({param})s) WHERE key = {key_sql})"
