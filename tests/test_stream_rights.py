"""Streams end when the right to read them ends (CONTRACT §12, issue 12 item 1), end to end:
two real daphne processes with a short keep-alive, raw HTTP streams of two sessions (one per
process), then ``manage.py rotate_credential --grace-seconds 0``. Both streams must close
within one keep-alive interval (plus the time a loaded machine needs), and no doorbell may
reach them once the credential is gone."""

import json
import threading
import time

import httpx
import pytest
from django.core.management import call_command

from channels_push.models import McpSession
from tests.processes import DEADLINE_SECONDS, poll
from tests.test_doorbell_e2e import deliver, setup_route

pytestmark = pytest.mark.django_db(transaction=True)

KEEPALIVE_SECONDS = 1.0
# One keep-alive interval is enough on a quiet machine; a loaded one needs the generous
# deadline. The behaviour before the fix is "never closes", which this still tells apart.
CLOSE_DEADLINE_SECONDS = DEADLINE_SECONDS
INIT = {"protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "rights-test", "version": "1"}}


def rpc_headers(credential, session_id=None):
    headers = {"Authorization": f"Bearer {credential}", "Content-Type": "application/json",
               "Accept": "application/json, text/event-stream"}
    if session_id:
        headers["Mcp-Session-Id"] = session_id
    return headers


def initialize(base_url, slug, credential) -> str:
    answer = httpx.post(f"{base_url}/mcp/{slug}", headers=rpc_headers(credential),
                        timeout=DEADLINE_SECONDS,
                        json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": INIT})
    assert answer.status_code == 200, answer.text
    session_id = answer.headers["mcp-session-id"]
    httpx.post(f"{base_url}/mcp/{slug}", headers=rpc_headers(credential, session_id),
               timeout=DEADLINE_SECONDS,
               json={"jsonrpc": "2.0", "method": "notifications/initialized"})
    return session_id


class RawStream:
    """A GET stream read on a thread: every chunk with the monotonic time it arrived, and the
    time the server ended the response (None while open)."""

    def __init__(self, base_url, slug, credential, session_id):
        self.chunks = []
        self.ended_at = None
        self.status = None
        self._args = (f"{base_url}/mcp/{slug}",
                      {**rpc_headers(credential, session_id), "Accept": "text/event-stream"})
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        url, headers = self._args
        try:
            with httpx.Client(timeout=httpx.Timeout(60.0)) as client:
                with client.stream("GET", url, headers=headers) as response:
                    self.status = response.status_code
                    for chunk in response.iter_raw():
                        self.chunks.append((time.monotonic(), chunk))
        except httpx.HTTPError:
            return  # the server went away (test teardown): not an orderly end
        self.ended_at = time.monotonic()

    def data_frames_after(self, instant):
        return [chunk for at, chunk in self.chunks if at >= instant and b"data: " in chunk]


def test_rotating_with_no_grace_closes_live_streams_on_both_processes_and_silences_them(
        start_daphne):
    env = {"SWITCHBOARD_STREAM_KEEPALIVE_SECONDS": str(KEEPALIVE_SECONDS)}
    web0, web1 = start_daphne(**env), start_daphne(**env)
    endpoint, credential, webhook = setup_route("rights-rotate")
    session0 = initialize(web0.url, endpoint.slug, credential)
    session1 = initialize(web1.url, endpoint.slug, credential)
    streams = [RawStream(web0.url, endpoint.slug, credential, session0),
               RawStream(web1.url, endpoint.slug, credential, session1)]
    assert poll(lambda: McpSession.objects.filter(endpoint=endpoint, open_streams__gt=0).count() == 2)
    # Both streams are live and ringable before the rotation (a doorbell rings one session
    # of the pool, taking turns: two todos ring both).
    deliver(web0.url, webhook, 1)
    deliver(web0.url, webhook, 3)
    assert poll(lambda: all(s.data_frames_after(0) for s in streams))

    rotated_at = time.monotonic()
    call_command("rotate_credential", endpoint.slug, "--grace-seconds", "0", "--json")
    # A todo that would ring a live session, delivered at once after the rotation.
    deliver(web1.url, webhook, 2)

    assert poll(lambda: all(s.ended_at is not None for s in streams),
                deadline_seconds=CLOSE_DEADLINE_SECONDS), "a stream outlived its credential"
    for stream in streams:
        assert stream.status == 200
        assert stream.ended_at - rotated_at <= CLOSE_DEADLINE_SECONDS
        assert stream.data_frames_after(rotated_at) == [], "a doorbell after the rotation"
    # The sessions ended with their credential; the old id does not work with the new one.
    assert not McpSession.objects.filter(endpoint=endpoint, terminated_at__isnull=True).exists()
    new_credential = endpoint.credentials.order_by("-created_at").first()
    assert new_credential is not None
    answer = httpx.post(f"{web0.url}/mcp/{endpoint.slug}", timeout=DEADLINE_SECONDS,
                        headers=rpc_headers(credential, session0),
                        json={"jsonrpc": "2.0", "id": 2, "method": "ping"})
    assert answer.status_code == 401


def test_old_session_id_does_not_work_with_a_new_credential(start_daphne):
    web0 = start_daphne()
    endpoint, credential, _ = setup_route("rights-rebind")
    session = initialize(web0.url, endpoint.slug, credential)
    out = json.loads(call_command_json("rotate_credential", endpoint.slug, "--grace-seconds", "0"))
    answer = httpx.post(f"{web0.url}/mcp/{endpoint.slug}", timeout=DEADLINE_SECONDS,
                        headers=rpc_headers(out["credential"], session),
                        json={"jsonrpc": "2.0", "id": 2, "method": "ping"})
    assert answer.status_code == 404
    stream = httpx.get(f"{web0.url}/mcp/{endpoint.slug}", timeout=DEADLINE_SECONDS,
                       headers={**rpc_headers(out["credential"], session),
                                "Accept": "text/event-stream"})
    assert stream.status_code == 404


def call_command_json(*args) -> str:
    from io import StringIO

    out = StringIO()
    call_command(*args, "--json", stdout=out)
    return out.getvalue()


def session_row_versions(endpoint):
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT id, xmin::text, ctid::text FROM channels_push_mcpsession"
                       " WHERE endpoint_id = %s", [endpoint.pk])
        return {row[0]: row[1:] for row in cursor.fetchall()}


IDLE_STREAMS = 100
IDLE_KEEPALIVE_SECONDS = 0.5
# PostgreSQL reports a backend's transaction counts when it goes idle, at most once a second,
# else up to PGSTAT_IDLE_INTERVAL (10 s) later: a window read in pg_stat_database may count
# traffic from up to that long before it, and miss as much of its own.
PG_STATS_LAG_SECONDS = 10.0
WINDOW_KEEPALIVES = 8


def database_transactions() -> int:
    """Transactions committed in this database so far, every backend (the daphne process's
    included), with this backend's counters flushed first."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT xact_commit FROM pg_stat_database"
                       " WHERE datname = current_database()")
        return cursor.fetchone()[0]


def test_a_hundred_idle_streams_write_nothing_and_cost_one_query_per_keep_alive(start_daphne):
    """A stream whose state did not change writes nothing on its keep-alive, and the
    keep-alive re-check is one query per process per interval for all of its streams
    (channels_push.mcp.stream), not one per stream.

    PostgreSQL gives every UPDATE a new row version (xmin, ctid), so unchanged versions of
    every session row after several keep-alives of every stream prove no write happened. The
    re-checks are counted in pg_stat_database over a window of eight keep-alives: a check per
    stream would commit a hundred transactions per interval, the process's one check (and a
    lease renewal now and then) a couple. The window's length comes from the streams' own
    keep-alives and the bound from the time that passed, so a slow machine stretches both."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("row versions and pg_stat_database are PostgreSQL's")
    web = start_daphne(SWITCHBOARD_STREAM_KEEPALIVE_SECONDS=str(IDLE_KEEPALIVE_SECONDS),
                       SWITCHBOARD_MAX_SESSIONS_PER_CREDENTIAL=str(IDLE_STREAMS))
    endpoint, credential, _ = setup_route("rights-idle")
    sessions = [initialize(web.url, endpoint.slug, credential) for _ in range(IDLE_STREAMS)]
    streams = [RawStream(web.url, endpoint.slug, credential, s) for s in sessions]

    def keepalives(stream):
        return sum(chunk.count(b": keep-alive") for _, chunk in list(stream.chunks))

    # Every stream attached, rung on reconnect and pumping: its first keep-alive came after.
    assert poll(lambda: all(keepalives(s) >= 1 for s in streams), deadline_seconds=DEADLINE_SECONDS)
    opened_at = time.monotonic()
    assert McpSession.objects.filter(endpoint=endpoint, open_streams=1).count() == IDLE_STREAMS
    before = session_row_versions(endpoint)
    seen = [keepalives(s) for s in streams]
    # Every stream has had at least four more keep-alives (each one a re-check).
    assert poll(lambda: all(keepalives(s) >= n + 4 for s, n in zip(streams, seen)),
                deadline_seconds=DEADLINE_SECONDS)
    assert session_row_versions(endpoint) == before

    # Wait out PostgreSQL's reporting lag, so that no transaction of the opens is counted in
    # the window (no event tells when a backend has reported).
    time.sleep(max(0.0, opened_at + PG_STATS_LAG_SECONDS + 1 - time.monotonic()))
    window_started = time.monotonic()
    committed_before = database_transactions()
    seen = [keepalives(s) for s in streams]
    assert poll(lambda: all(keepalives(s) >= n + WINDOW_KEEPALIVES for s, n in zip(streams, seen)),
                deadline_seconds=DEADLINE_SECONDS)
    committed = database_transactions() - committed_before
    # At most one re-check and one renewal per interval that passed (or that PostgreSQL may
    # still have been holding back), plus this test's own few statements.
    intervals = (time.monotonic() - window_started + PG_STATS_LAG_SECONDS) / IDLE_KEEPALIVE_SECONDS
    assert committed < 2 * (intervals + 1) + 10, \
        f"{committed} transactions in {intervals:.0f} intervals for {IDLE_STREAMS} idle streams"
    assert all(s.ended_at is None for s in streams)


def stream_open_sessions(endpoint) -> set:
    """The sessions of ``endpoint`` that count as having an open stream now (the doorbell's
    own rule, ``queries.stream_open_sql``)."""
    from django.db import connection
    from django.utils import timezone

    from channels_push.sessions import queries

    params = {"endpoint_id": endpoint.pk}
    sql = ("SELECT s.id FROM channels_push_mcpsession s WHERE s.endpoint_id = %(endpoint_id)s"
           f" AND {queries.stream_open_sql('s', params, timezone.now())}")
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return {row[0] for row in cursor.fetchall()}


# The host lease is renewed at a fraction of its length; 6 s leaves a process a few seconds'
# stall on a loaded machine before its live streams would stop counting.
LEASE_SECONDS = 6.0


def test_streams_of_a_process_killed_with_sigkill_lapse_and_are_swept(start_daphne):
    """A daphne process killed -9 says no goodbye: its streams' attachments stay behind. They
    keep counting as open only while its host lease runs (renewed by its heartbeat, one row
    for all its streams); then they stop counting on their own, and the idle-session sweep
    deletes the dead host with its attachments and zeroes the sessions' stream counts. The
    streams of a live process, meanwhile, keep counting past their attach's own lease."""
    from django.utils import timezone

    from channels_push.sessions import sweeps
    from channels_push.models import StreamAttachment, StreamHost

    env = {"SWITCHBOARD_STREAM_KEEPALIVE_SECONDS": "0.5",
           "SWITCHBOARD_STREAM_LEASE_SECONDS": str(LEASE_SECONDS)}
    doomed, survivor = start_daphne(**env), start_daphne(**env)
    endpoint, credential, _ = setup_route("killed")
    on_doomed = [initialize(doomed.url, endpoint.slug, credential) for _ in range(3)]
    on_survivor = initialize(survivor.url, endpoint.slug, credential)
    streams = [RawStream(doomed.url, endpoint.slug, credential, s) for s in on_doomed]
    streams.append(RawStream(survivor.url, endpoint.slug, credential, on_survivor))
    assert poll(lambda: StreamAttachment.objects.count() == 4)
    assert StreamHost.objects.count() == 2
    # Past the attaches' own lease: the hosts' heartbeats keep all four counting.
    assert poll(lambda: not McpSession.objects.filter(
        endpoint=endpoint, stream_lease_until__gt=timezone.now()).exists())
    assert stream_open_sessions(endpoint) == {*on_doomed, on_survivor}

    doomed.process.kill()  # SIGKILL: no finally, no detach
    doomed.process.wait()
    assert StreamAttachment.objects.count() == 4  # left behind
    assert poll(lambda: stream_open_sessions(endpoint) == {on_survivor}), \
        "a dead process's streams kept counting"
    sweeps.expire_idle_sessions()
    assert sorted(McpSession.objects.filter(endpoint=endpoint).values_list("id", "open_streams")) \
        == sorted([(s, 0) for s in on_doomed] + [(on_survivor, 1)])
    assert list(StreamAttachment.objects.values_list("session_id", flat=True)) == [on_survivor]
    assert StreamHost.objects.count() == 1
    # Killed streams' sessions are not ended (their clients reconnect to another process).
    assert not McpSession.objects.filter(endpoint=endpoint, terminated_at__isnull=False).exists()
    assert streams[-1].ended_at is None
