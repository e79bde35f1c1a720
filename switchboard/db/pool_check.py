"""The PostgreSQL pool's connection check, without a round trip per request
(docs/decisions/pool-without-reset-callback.md).

psycopg's pool can test a connection each time it hands one out (``ConnectionPool.
check_connection``: an empty query). switchboard checks a connection out and back in on every
request's thread hop, so that cost one round trip to PostgreSQL per request, a visible share
of the web process's CPU. A connection that was handed out moments ago and whose socket
has nothing to read is as good as the check would say: a PostgreSQL that restarted or
terminated the backend has sent its goodbye and closed the socket, which makes it readable. Such
a connection is handed out as is; any other gets the full check.

The moment is noted here, as the check passes, not by the pool's ``reset`` callback as the
connection comes back: with any ``reset`` callback psycopg's pool returns every connection
through its worker thread (a queue, a wake-up and a thread switch per request, measured by
bench/ingest.py), where without one the returning thread puts it
back itself. Timed from the hand-out, a connection held for a while earns less trust, never more.
"""

import logging
import select
import time
import weakref

from django.db import connection
from psycopg_pool import ConnectionPool

log = logging.getLogger("switchboard.db")

# How long after it was last handed out a quiet connection is trusted without the empty query.
# Short, so a silent network fault (no goodbye) is still found on the next request after a pause.
TRUSTED_AFTER_HAND_OUT_SECONDS = 5.0

_handed_out_at: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

_empty_query_check = ConnectionPool.check_connection


def check_pooled_connection(connection) -> None:
    """The pool's ``check`` callback: return quietly for a usable connection, else raise."""
    now = time.monotonic()
    handed_out = _handed_out_at.get(connection)
    if not (handed_out is not None and now - handed_out < TRUSTED_AFTER_HAND_OUT_SECONDS
            and not connection.closed and _socket_quiet(connection)):
        _empty_query_check(connection)
    _handed_out_at[connection] = now


def install_check() -> None:
    """Make this the check Django gives the pool. Django builds its pool with
    ``check=ConnectionPool.check_connection`` (CONN_HEALTH_CHECKS) and refuses another in
    OPTIONS["pool"], so the one attribute it reads is replaced; switchboard is the only user
    of psycopg_pool in its processes, and a pool Django re-creates (Celery's prefork children)
    picks it up the same way."""
    ConnectionPool.check_connection = staticmethod(check_pooled_connection)


def _socket_quiet(connection) -> bool:
    try:
        readable, _, _ = select.select([connection.fileno()], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


def discard_broken_pooled_connections() -> None:
    """After a database error, test every idle pooled connection now and replace the dead ones.

    Why: a PostgreSQL restart kills every pooled connection at once. The pool checks a connection
    only when it hands it out, backing off 1 s, 2 s, 4 s … between failed checks, so with several
    dead ones a request outlasts the 5 s pool wait and fails, and so does the next (seen on a loaded
    machine: several of the first requests after a restart). Checking them all at the first error
    leaves at most that one request failed (with a retryable answer)."""
    pool = getattr(connection, "pool", None)
    if pool is None:
        return
    try:
        pool.check()
    except Exception as exc:  # the database may still be down; the next error tries again
        log.warning("pool check failed", extra={"error": type(exc).__name__})
