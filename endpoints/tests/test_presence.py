"""Effective presence (CONTRACT §8): override > shift schedule > manual state, clock holds, and
shift math in a non-UTC zone across DST changes. Clock passed as ``now``; no sleeps."""

import io
import json
from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command

from endpoints import transitions
from endpoints.models import (Endpoint, next_shift_boundary, on_shift, shift_boundaries,
                              validate_shift_schedule)

UTC = dt_timezone.utc
BERLIN = "Europe/Berlin"
WEEKDAYS_9_TO_17 = [{"day": d, "start": "09:00", "end": "17:00"}
                    for d in ("mon", "tue", "wed", "thu", "fri", "sat", "sun")]


def at(*args):
    return datetime(*args, tzinfo=UTC)


def test_shift_keeps_local_hours_across_the_spring_dst_change():
    # 2026-03-29 (Sunday): Berlin goes from CET (UTC+1) to CEST (UTC+2) at 02:00 local.
    assert on_shift(WEEKDAYS_9_TO_17, BERLIN, at(2026, 3, 28, 8, 0))  # 09:00 CET
    assert not on_shift(WEEKDAYS_9_TO_17, BERLIN, at(2026, 3, 28, 7, 59))
    assert not on_shift(WEEKDAYS_9_TO_17, BERLIN, at(2026, 3, 29, 6, 59))
    assert on_shift(WEEKDAYS_9_TO_17, BERLIN, at(2026, 3, 29, 7, 0))  # 09:00 CEST
    assert not on_shift(WEEKDAYS_9_TO_17, BERLIN, at(2026, 3, 29, 15, 0))  # 17:00 CEST
    changes = shift_boundaries(WEEKDAYS_9_TO_17, BERLIN, at(2026, 3, 28, 12), at(2026, 3, 29, 18))
    assert changes == [(at(2026, 3, 28, 16), "out"), (at(2026, 3, 29, 7), "in"),
                       (at(2026, 3, 29, 15), "out")]


def test_shift_keeps_local_hours_across_the_autumn_dst_change():
    # 2026-10-25: CEST -> CET; 09:00 local is 08:00 UTC from that day on.
    assert next_shift_boundary(WEEKDAYS_9_TO_17, BERLIN, at(2026, 10, 25, 0)) == at(2026, 10, 25, 8)
    assert next_shift_boundary(WEEKDAYS_9_TO_17, BERLIN, at(2026, 10, 24, 0)) == at(2026, 10, 24, 7)


def test_overnight_and_touching_windows():
    schedule = [{"day": "fri", "start": "22:00", "end": "06:00"},
                {"day": "sat", "start": "06:00", "end": "24:00"}]
    # Friday 2026-12-04 22:00 UTC (UTC zone) through Sunday 00:00 is one long shift.
    assert on_shift(schedule, "UTC", at(2026, 12, 5, 3))
    assert on_shift(schedule, "UTC", at(2026, 12, 5, 6))
    assert shift_boundaries(schedule, "UTC", at(2026, 12, 4), at(2026, 12, 7)) == [
        (at(2026, 12, 4, 22), "in"), (at(2026, 12, 6, 0), "out")]


def test_schedule_validation_names_the_problem():
    validate_shift_schedule(WEEKDAYS_9_TO_17, BERLIN)
    validate_shift_schedule([], "")
    for bad, zone in (([{"day": "monday", "start": "09:00", "end": "17:00"}], BERLIN),
                      ([{"day": "mon", "start": "9:00", "end": "17:00"}], BERLIN),
                      ([{"day": "mon", "start": "09:00"}], BERLIN),
                      (WEEKDAYS_9_TO_17, "Mars/Olympus"), (WEEKDAYS_9_TO_17, ""), ("mon", BERLIN)):
        with pytest.raises(ValidationError):
            validate_shift_schedule(bad, zone)


def test_override_beats_schedule_beats_manual_state(endpoint):
    now = at(2026, 3, 30, 10)  # Monday 12:00 CEST: on shift
    assert endpoint.presence_at(now) == "in"  # default manual state
    endpoint.presence_state = "out"
    assert endpoint.presence_at(now) == "out"
    endpoint.shift_timezone, endpoint.shift_schedule = BERLIN, WEEKDAYS_9_TO_17
    assert endpoint.presence_at(now) == "in"  # the schedule rules the manual state
    assert endpoint.presence_at(at(2026, 3, 30, 20)) == "out"
    endpoint.presence_override, endpoint.presence_override_until = "out", now + timedelta(hours=1)
    assert endpoint.presence_at(now) == "out"
    assert endpoint.presence_at(now + timedelta(hours=1)) == "in"  # override expired


def test_clock_out_on_shift_holds_until_the_next_boundary(endpoint):
    endpoint.shift_timezone, endpoint.shift_schedule = BERLIN, WEEKDAYS_9_TO_17
    endpoint.save()
    now = at(2026, 3, 30, 10)  # on shift
    assert transitions.set_presence(endpoint, "out", now=now) == ("in", "out")
    row = Endpoint.objects.get(pk=endpoint.pk)
    assert row.presence_hold_until == at(2026, 3, 30, 15)  # 17:00 CEST, the shift's end
    assert row.presence_at(now + timedelta(hours=4)) == "out"
    assert row.presence_at(at(2026, 3, 31, 7)) == "in"  # the next shift starts as scheduled
    # Clocking in off shift holds until the next shift starts.
    assert transitions.set_presence(row, "in", now=at(2026, 3, 30, 20)) == ("out", "in")
    row.refresh_from_db()
    assert row.presence_hold_until == at(2026, 3, 31, 7)
    assert row.presence_at(at(2026, 3, 30, 23)) == "in"


def test_override_needs_a_future_expiry(endpoint):
    now = at(2026, 3, 30, 10)
    with pytest.raises(ValueError):
        transitions.set_presence(endpoint, "out", until=now - timedelta(seconds=1), now=now)
    assert transitions.set_presence(endpoint, "out", until=now + timedelta(hours=2), now=now) == ("in", "out")
    assert Endpoint.objects.get(pk=endpoint.pk).presence_at(now + timedelta(hours=2)) == "in"


def test_the_boundary_mark_moves_forward_once(endpoint):
    boundary = at(2026, 3, 29, 7)
    assert transitions.record_presence_boundary(endpoint.pk, boundary)
    assert not transitions.record_presence_boundary(endpoint.pk, boundary)
    assert not transitions.record_presence_boundary(endpoint.pk, boundary - timedelta(hours=1))
    assert transitions.record_presence_boundary(endpoint.pk, boundary + timedelta(hours=8))


def test_clock_command_prints_endpoint_and_presence(endpoint):
    out = io.StringIO()
    call_command("clock", "out", endpoint.slug, "--json", stdout=out)
    assert json.loads(out.getvalue()) == {"endpoint": endpoint.slug, "presence": "out",
                                          "override_until": None}
    out = io.StringIO()
    call_command("clock", "in", endpoint.slug, "--until", "2099-01-01T00:00:00Z", "--json", stdout=out)
    assert json.loads(out.getvalue()) == {"endpoint": endpoint.slug, "presence": "in",
                                          "override_until": "2099-01-01T00:00:00Z"}
    row = Endpoint.objects.get(pk=endpoint.pk)
    assert row.presence_override == "in" and row.presence_override_until == at(2099, 1, 1)
    with pytest.raises(CommandError):
        call_command("clock", "in", "nope")
    with pytest.raises(CommandError):
        call_command("clock", "in", endpoint.slug, "--until", "tomorrow")


def test_manual_clock_never_clears_an_operator_override(endpoint):
    """§8: an override with an expiry wins; clock_in/clock_out set only the manual state."""
    now = at(2026, 3, 30, 10)
    until = now + timedelta(hours=2)
    transitions.set_presence(endpoint, "out", until=until, now=now)
    assert transitions.set_presence(endpoint, "in", now=now + timedelta(minutes=1)) == ("out", "out")
    row = Endpoint.objects.get(pk=endpoint.pk)
    assert (row.presence_override, row.presence_override_until) == ("out", until)
    assert row.presence_state == "in"  # what rules once the override ends
    assert row.presence_at(until) == "in"
