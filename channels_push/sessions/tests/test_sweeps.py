import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from tests.factories import credential_for
from channels_push.sessions import sweeps
from channels_push.sessions import queries
from channels_push.sessions import transitions as session_transitions
from switchboard import scheduler
from channels_push.models import McpSession, StreamAttachment, StreamHost
from tests.processes import DEADLINE_SECONDS


def test_idle_sessions_expire_and_active_ones_stay(endpoint, settings):
    settings.SWITCHBOARD_MCP_SESSION_IDLE = timedelta(hours=1)
    now = timezone.now()
    idle = session_transitions.open_session(endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25",
                                            now=now - timedelta(hours=2))
    busy = session_transitions.open_session(endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25",
                                            now=now - timedelta(hours=2))
    assert session_transitions.touch_session(endpoint=endpoint, session_id=busy.pk,
                                             now=now - timedelta(minutes=5))
    assert sweeps.expire_idle_sessions(now=now) == 1
    assert McpSession.objects.get(pk=idle.pk).terminated_at == now
    assert McpSession.objects.get(pk=busy.pk).terminated_at is None
    assert not session_transitions.touch_session(endpoint=endpoint, session_id=idle.pk)
    assert sweeps.expire_idle_sessions(now=now) == 0  # overlapping/next run: nothing left


def test_stream_counts_left_by_a_crashed_process_are_zeroed(endpoint):
    """An attach grants its stream a lease of stream_lease(); after that the stream counts
    only while the lease of the process holding it is renewed. A count whose leases all ran
    out was left by a process that died with its streams: the sweep deletes the dead host with
    its attachments and sets the count to the attachments left."""
    now = timezone.now()
    crashed_at = now - queries.stream_lease() - timedelta(seconds=1)
    session_transitions.register_stream_host(host_id="dead", now=crashed_at)
    session_transitions.register_stream_host(host_id="alive", now=crashed_at)
    assert session_transitions.renew_stream_host(host_id="alive", now=now)
    session = session_transitions.open_session(endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25",
                                               now=crashed_at)
    assert session_transitions.attach_stream(endpoint=endpoint, session_id=session.pk,
                                             host_id="dead", now=crashed_at)
    # Attached long ago on a process that is still alive: its host's lease keeps it counting.
    old = session_transitions.open_session(endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25",
                                           now=crashed_at)
    assert session_transitions.attach_stream(endpoint=endpoint, session_id=old.pk,
                                             host_id="alive", now=crashed_at)
    assert session_transitions.attach_stream(endpoint=endpoint, session_id=old.pk,
                                             host_id="dead", now=crashed_at)
    live = session_transitions.open_session(endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25", now=now)
    assert session_transitions.attach_stream(endpoint=endpoint, session_id=live.pk, now=now)
    assert queries.has_attached_session(endpoint.pk, now)
    sweeps.expire_idle_sessions(now=now)
    assert McpSession.objects.get(pk=session.pk).open_streams == 0
    assert McpSession.objects.get(pk=old.pk).open_streams == 1  # its stream on "alive"
    assert McpSession.objects.get(pk=live.pk).open_streams == 1
    assert list(StreamHost.objects.values_list("pk", flat=True)) == ["alive"]
    assert StreamAttachment.objects.filter(host_id="dead").count() == 0
    # A stream held by a live process keeps an otherwise idle session from the idle expiry.
    assert McpSession.objects.get(pk=old.pk).terminated_at is None


# -- the dead-host sweep racing a stalled process's renewal (real row locks, PostgreSQL) -------

WAIT_SECONDS = DEADLINE_SECONDS


class OnItsOwnConnection:
    """``work()`` on a thread of its own, so on a database connection of its own (closed when
    it ends); ``pid`` is that connection's backend, for ``wait_until_blocked``."""

    def __init__(self, work):
        self.pid, self.result, self.error = None, None, None
        self.started, self.done = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(work,))
        self.thread.start()
        assert self.started.wait(WAIT_SECONDS)

    def _run(self, work):
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                self.pid = cursor.fetchone()[0]
            self.started.set()
            self.result = work()
        except BaseException as exc:  # surfaced by join()
            self.error = exc
        finally:
            self.started.set()
            self.done.set()
            connections.close_all()

    def join(self):
        self.thread.join(WAIT_SECONDS)
        assert not self.thread.is_alive(), "hung"
        if self.error is not None:
            raise self.error
        return self.result


def wait_until_blocked(worker, *, or_done=False) -> bool:
    """Poll (with a deadline) until ``worker``'s connection waits on another one's lock. With
    ``or_done``, a worker that finished without waiting ends the wait too (False)."""
    deadline = time.monotonic() + WAIT_SECONDS
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute("SELECT cardinality(pg_blocking_pids(%s)) > 0", [worker.pid])
            if cursor.fetchone()[0]:
                return True
            if worker.done.is_set():
                assert or_done, f"finished without waiting on a lock: {worker.error!r}"
                return False
            time.sleep(0.01)
    raise AssertionError(f"backend {worker.pid} never waited on a lock")


def stalled_host_with_a_stream(endpoint, host_id, lapsed):
    """A process that attached a stream and then stalled: its host lease ran out at ``lapsed``
    (the attach's own lease too), so the sweep takes it for dead."""
    session = session_transitions.open_session(
        endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25",
        now=lapsed)
    assert session_transitions.attach_stream(endpoint=endpoint, session_id=session.pk,
                                             host_id=host_id, now=lapsed) == "attached"
    return session


def hosts_and_attached_hosts():
    """The host rows, and the hosts the attachment rows name: equal unless a sweep left a live
    host without its attachments."""
    return (set(StreamHost.objects.values_list("pk", flat=True)),
            set(StreamAttachment.objects.values_list("host_id", flat=True)))


@pytest.mark.skipif("connection.vendor != 'postgresql'",
                    reason="row locks are PostgreSQL's; SQLite's single writer serialises them")
@pytest.mark.django_db(transaction=True)
def test_a_renewal_in_flight_when_the_sweep_starts_keeps_its_host_and_attachments(endpoint):
    """The stalled process's renewal has updated its host row but not committed when the
    dead-host sweep starts: the sweep must wait for it (the row lock), see the renewed lease
    and leave the host WITH its attachments, while still sweeping a host that is really dead.
    A sweep that reads the dead hosts without locking them reads the lapsed lease and deletes
    the host (and its attachments) after the renewal was told it renewed."""
    lapsed = timezone.now() - queries.stream_lease() - timedelta(seconds=1)
    stalled = stalled_host_with_a_stream(endpoint, "stalled", lapsed)
    dead = stalled_host_with_a_stream(endpoint, "dead", lapsed)
    renewed_uncommitted, commit = threading.Event(), threading.Event()

    def renew_then_commit_late():
        with transaction.atomic():
            renewed = session_transitions.renew_stream_host(host_id="stalled")
            renewed_uncommitted.set()
            assert commit.wait(WAIT_SECONDS)
        return renewed

    renewer = OnItsOwnConnection(renew_then_commit_late)
    try:
        assert renewed_uncommitted.wait(WAIT_SECONDS)
        sweeper = OnItsOwnConnection(session_transitions.reset_stale_stream_counts)
        wait_until_blocked(sweeper)  # on the renewal's row lock
    finally:
        commit.set()
    renewed = renewer.join()
    sweeper.join()
    assert (renewed, hosts_and_attached_hosts()) == (True, ({"stalled"}, {"stalled"}))
    assert McpSession.objects.get(pk=stalled.pk).open_streams == 1  # its stream still counts
    assert McpSession.objects.get(pk=dead.pk).open_streams == 0


@pytest.mark.skipif("connection.vendor != 'postgresql'",
                    reason="row locks are PostgreSQL's; SQLite's single writer serialises them")
@pytest.mark.django_db(transaction=True)
def test_a_renewal_after_the_sweep_locked_the_dead_host_finds_it_gone(endpoint):
    """The other order: the sweep has locked the dead host and is still deleting (held here by
    another connection's lock on the host's attachment rows) when the stalled process renews.
    The renewal must wait for the sweep and then learn that its host is gone (False: the
    process closes its streams), never renew a host whose attachments are being deleted. The
    old two statements let the renewal through: the attachments went, the renewed host stayed,
    a live host whose streams stopped counting."""
    lapsed = timezone.now() - queries.stream_lease() - timedelta(seconds=1)
    stalled = stalled_host_with_a_stream(endpoint, "stalled", lapsed)
    attachments_locked, release = threading.Event(), threading.Event()

    def hold_the_attachments():
        with transaction.atomic():
            assert list(StreamAttachment.objects.select_for_update().filter(host_id="stalled"))
            attachments_locked.set()
            assert release.wait(WAIT_SECONDS)

    holder = OnItsOwnConnection(hold_the_attachments)
    try:
        assert attachments_locked.wait(WAIT_SECONDS)
        sweeper = OnItsOwnConnection(session_transitions.reset_stale_stream_counts)
        wait_until_blocked(sweeper)  # deleting the attachments
        # The heartbeat's renewal as production runs it: one statement, autocommit.
        renewer = OnItsOwnConnection(
            lambda: session_transitions.renew_stream_host(host_id="stalled"))
        wait_until_blocked(renewer, or_done=True)
    finally:
        release.set()
    holder.join()
    sweeper.join()
    renewed = renewer.join()
    assert (renewed, hosts_and_attached_hosts()) == (False, (set(), set()))
    assert McpSession.objects.get(pk=stalled.pk).open_streams == 0


def test_a_stream_on_a_live_process_keeps_its_session_from_the_idle_expiry(endpoint, settings):
    settings.SWITCHBOARD_MCP_SESSION_IDLE = timedelta(hours=1)
    now = timezone.now()
    long_ago = now - timedelta(hours=3)
    session_transitions.register_stream_host(host_id="alive", now=now)
    streaming = session_transitions.open_session(endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25",
                                                 now=long_ago)
    assert session_transitions.attach_stream(endpoint=endpoint, session_id=streaming.pk,
                                             host_id="alive", now=long_ago)
    idle = session_transitions.open_session(endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25",
                                            now=long_ago)
    assert sweeps.expire_idle_sessions(now=now) == 1
    assert McpSession.objects.get(pk=idle.pk).terminated_at == now
    assert McpSession.objects.get(pk=streaming.pk).terminated_at is None
    # Closed: idle like any other session from then on.
    session_transitions.detach_stream(session_id=streaming.pk, host_id="alive",
                                      now=now - timedelta(hours=2))
    assert not StreamAttachment.objects.exists()
    assert sweeps.expire_idle_sessions(now=now) == 1


def test_the_retention_prune_leaves_a_session_a_stream_attachment_names(endpoint):
    """The attachment's foreign key would refuse the delete (and fail the whole batch): the
    prune skips such a session until the stream closes or its dead process is swept."""
    from ingest import sweeps as ingest_sweeps

    now = timezone.now()
    session_transitions.register_stream_host(host_id="h", now=now)
    attached = session_transitions.open_session(endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25",
                                                now=now - timedelta(days=3))
    assert session_transitions.attach_stream(endpoint=endpoint, session_id=attached.pk,
                                             host_id="h", now=now - timedelta(days=3))
    ended = session_transitions.open_session(endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25",
                                             now=now - timedelta(days=3))
    McpSession.objects.filter(pk__in=[attached.pk, ended.pk]).update(
        terminated_at=now - timedelta(days=2))
    assert ingest_sweeps.prune_history(now=now, pause_seconds=0)["mcp_sessions"] == 1
    assert list(McpSession.objects.values_list("pk", flat=True)) == [attached.pk]
    session_transitions.detach_stream(session_id=attached.pk, host_id="h")
    assert ingest_sweeps.prune_history(now=now, pause_seconds=0)["mcp_sessions"] == 1
    assert not McpSession.objects.exists()


def test_one_heartbeat_statement_rechecks_every_held_session(endpoint, vend,
                                                            django_assert_num_queries):
    """The process heartbeat: one read for all the sessions it holds; the ones whose
    credential lost its rights end in one more statement."""
    now = timezone.now()
    other, _ = vend(slug="revoked-one")
    sessions = [session_transitions.open_session(
        endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25",
        now=now).pk for _ in range(5)]
    lost = session_transitions.open_session(endpoint=other, credential_id=credential_for(other),
                                            protocol_version="2025-11-25", now=now).pk
    with django_assert_num_queries(1):
        assert session_transitions.check_stream_sessions(
            session_ids=sessions + [lost], now=now) == set(sessions + [lost])
    other.active = False
    other.save(update_fields=["active"])
    with django_assert_num_queries(2):
        assert session_transitions.check_stream_sessions(
            session_ids=sessions + [lost], now=now) == set(sessions)
    assert McpSession.objects.get(pk=lost).terminated_at == now
    with django_assert_num_queries(1):
        assert session_transitions.renew_stream_host(host_id="gone", now=now) is False


def test_detach_never_goes_below_zero(endpoint):
    session = session_transitions.open_session(endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25")
    session_transitions.detach_stream(session_id=session.pk)
    assert McpSession.objects.get(pk=session.pk).open_streams == 0


def test_session_is_pinned_to_its_endpoint(endpoint, vend):
    other, _ = vend(slug="other")
    credential_for(other)
    session = session_transitions.open_session(endpoint=endpoint, credential_id=credential_for(endpoint), protocol_version="2025-11-25")
    assert not session_transitions.touch_session(endpoint=other, session_id=session.pk)
    assert not session_transitions.terminate_session(endpoint=other, session_id=session.pk)
    assert not session_transitions.attach_stream(endpoint=other, session_id=session.pk)


def test_embedded_scheduler_and_beat_run_the_session_sweep():
    from switchboard.celery import app

    assert (sweeps.expire_idle_sessions, 60.0) in scheduler.embedded_sweeps()
    entry = app.conf.beat_schedule["expire-idle-mcp-sessions"]
    assert entry["task"] == "channels_push.tasks.expire_idle_sessions"
    from channels_push import tasks

    assert tasks.expire_idle_sessions.name == entry["task"]
