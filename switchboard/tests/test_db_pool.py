"""switchboard/db/pool_check.py: the pool's check trusts a connection handed out moments ago whose
socket is quiet, and tests every other one (a terminated backend is never handed out); a
connection comes back to the pool in the returning thread."""

import time

import psycopg
import pytest
from django.db import connection
from psycopg_pool import ConnectionPool

from switchboard.db import pool_check
from tests.processes import DEADLINE_SECONDS


@pytest.fixture
def raw_connection(db):
    if connection.vendor != "postgresql":
        pytest.skip("the pool is PostgreSQL's")
    params = connection.get_connection_params()
    conn = psycopg.connect(**{k: v for k, v in params.items() if k not in ("cursor_factory",)},
                           autocommit=True)
    yield conn
    conn.close()


@pytest.fixture
def full_checks(monkeypatch):
    calls = []
    real = pool_check._empty_query_check
    monkeypatch.setattr(pool_check, "_empty_query_check", lambda conn: (calls.append(conn), real(conn)))
    return calls


def test_a_connection_handed_out_moments_ago_and_quiet_is_handed_out_without_a_query(
        raw_connection, full_checks):
    pool_check.check_pooled_connection(raw_connection)  # never handed out: checked
    pool_check.check_pooled_connection(raw_connection)
    assert full_checks == [raw_connection]


def test_a_connection_handed_out_long_ago_gets_the_full_check(raw_connection, full_checks,
                                                              monkeypatch):
    pool_check.check_pooled_connection(raw_connection)
    later = time.monotonic() + pool_check.TRUSTED_AFTER_HAND_OUT_SECONDS + 1
    monkeypatch.setattr(pool_check.time, "monotonic", lambda: later)
    pool_check.check_pooled_connection(raw_connection)
    assert full_checks == [raw_connection, raw_connection]


def test_a_terminated_backend_is_refused_even_just_after_a_hand_out(raw_connection):
    pool_check.check_pooled_connection(raw_connection)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [raw_connection.info.backend_pid])
    deadline = time.monotonic() + DEADLINE_SECONDS
    while pool_check._socket_quiet(raw_connection):  # the goodbye arrives
        assert time.monotonic() < deadline
        time.sleep(0.01)  # poll interval, bounded by the deadline above
    with pytest.raises(psycopg.OperationalError):
        pool_check.check_pooled_connection(raw_connection)


def test_the_pool_django_builds_uses_this_check_and_takes_returns_back_in_the_caller(db):
    if connection.vendor != "postgresql" or not connection.pool:
        pytest.skip("no pool configured (SQLite, or DATABASE_POOL_MAX_SIZE=0)")
    pool = connection.pool
    assert pool._check is pool_check.check_pooled_connection
    # No ``reset`` callback, so no hand-off to the pool's worker thread: the connection is
    # available again as soon as putconn returns (with one it was still in the worker's queue).
    conn = pool.getconn()
    available = pool.get_stats().get("pool_available", 0)
    pool.putconn(conn)
    assert pool.get_stats()["pool_available"] == available + 1
