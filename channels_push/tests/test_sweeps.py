from datetime import timedelta

from django.utils import timezone

from channels_push import queries, scheduler, sweeps
from channels_push import transitions as session_transitions
from channels_push.models import McpSession


def test_idle_sessions_expire_and_active_ones_stay(endpoint, settings):
    settings.SWITCHBOARD_MCP_SESSION_IDLE = timedelta(hours=1)
    now = timezone.now()
    idle = session_transitions.open_session(endpoint=endpoint, protocol_version="2025-11-25",
                                            now=now - timedelta(hours=2))
    busy = session_transitions.open_session(endpoint=endpoint, protocol_version="2025-11-25",
                                            now=now - timedelta(hours=2))
    assert session_transitions.touch_session(endpoint=endpoint, session_id=busy.pk,
                                             now=now - timedelta(minutes=5))
    assert sweeps.expire_idle_sessions(now=now) == 1
    assert McpSession.objects.get(pk=idle.pk).terminated_at == now
    assert McpSession.objects.get(pk=busy.pk).terminated_at is None
    assert not session_transitions.touch_session(endpoint=endpoint, session_id=idle.pk)
    assert sweeps.expire_idle_sessions(now=now) == 0  # overlapping/next run: nothing left


def test_stream_counts_left_by_a_crashed_process_are_zeroed(endpoint):
    """Open streams renew their stream lease every STREAM_LEASE_RENEW; a count whose lease ran
    out was left by a process that died with its streams."""
    now = timezone.now()
    crashed_at = now - queries.STREAM_LEASE - timedelta(seconds=1)
    session = session_transitions.open_session(endpoint=endpoint, protocol_version="2025-11-25",
                                               now=crashed_at)
    assert session_transitions.attach_stream(endpoint=endpoint, session_id=session.pk,
                                             now=crashed_at)
    live = session_transitions.open_session(endpoint=endpoint, protocol_version="2025-11-25", now=now)
    assert session_transitions.attach_stream(endpoint=endpoint, session_id=live.pk, now=now)
    sweeps.expire_idle_sessions(now=now)
    assert McpSession.objects.get(pk=session.pk).open_streams == 0
    assert McpSession.objects.get(pk=live.pk).open_streams == 1


def test_detach_never_goes_below_zero(endpoint):
    session = session_transitions.open_session(endpoint=endpoint, protocol_version="2025-11-25")
    session_transitions.detach_stream(session_id=session.pk)
    assert McpSession.objects.get(pk=session.pk).open_streams == 0


def test_session_is_pinned_to_its_endpoint(endpoint, vend):
    other, _ = vend(slug="other")
    session = session_transitions.open_session(endpoint=endpoint, protocol_version="2025-11-25")
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
