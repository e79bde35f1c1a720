"""Shift schedules are bounded (≤ SWITCHBOARD_MAX_SHIFT_WINDOWS windows, CONTRACT §12) wherever
they are set — model validation, admin, ``manage.py shift_schedule`` — and the next boundary is
found in one pass over the windows: checked against a brute-force reference on random
schedules, across DST changes."""

import json
from datetime import datetime, timedelta, timezone as dt_timezone
from zoneinfo import ZoneInfo

import pytest
from django.core.exceptions import ValidationError
from hypothesis import given, settings as hypothesis_settings, strategies as st

from endpoints import models
from endpoints.models import (AGENT_VERBS, WEEKDAYS, Endpoint, next_shift_boundary,
                              shift_boundaries, validate_shift_schedule)
from tests.cli import run_manage
from tests.factories import EndpointFactory, UserFactory

UTC = dt_timezone.utc
FIFTY_ONE = [{"day": WEEKDAYS[n % 7], "start": f"{n % 24:02d}:00", "end": f"{n % 24:02d}:30"}
             for n in range(51)]


def test_model_validation_refuses_more_than_fifty_windows():
    validate_shift_schedule(FIFTY_ONE[:50], "UTC")
    with pytest.raises(ValidationError, match="at most 50"):
        validate_shift_schedule(FIFTY_ONE, "UTC")


@pytest.mark.django_db
def test_admin_refuses_more_than_fifty_windows(client, operator):
    client.force_login(UserFactory(username="root", is_superuser=True, is_staff=True))
    endpoint = EndpointFactory(slug="shifty", owner=operator)

    def post(schedule):
        return client.post(f"/admin/endpoints/endpoint/{endpoint.pk}/change/", {
            "slug": "shifty", "owner": operator.pk, "scope": "*", "verbs": list(AGENT_VERBS),
            "max_attempts": "5", "active": "on", "shift_timezone": "UTC",
            "shift_schedule": json.dumps(schedule),
            "credentials-TOTAL_FORMS": "0", "credentials-INITIAL_FORMS": "0"})

    refused = post(FIFTY_ONE)
    assert refused.status_code == 200 and b"at most 50" in refused.content
    endpoint.refresh_from_db()
    assert endpoint.shift_schedule == []
    assert post(FIFTY_ONE[:50]).status_code == 302
    endpoint.refresh_from_db()
    assert len(endpoint.shift_schedule) == 50


@pytest.mark.django_db
def test_cli_sets_a_schedule_and_refuses_more_than_fifty_windows(capsys, endpoint):
    refused = run_manage(capsys, "shift_schedule", endpoint.slug, "--timezone", "UTC",
                         "--windows", json.dumps(FIFTY_ONE))
    assert refused.code != 0 and "at most 50" in refused.err
    assert Endpoint.objects.get(pk=endpoint.pk).shift_schedule == []
    windows = [{"day": "mon", "start": "09:00", "end": "17:00"}]
    done = run_manage(capsys, "shift_schedule", endpoint.slug, "--timezone", "Europe/Berlin",
                      "--windows", json.dumps(windows), "--json")
    assert done.code == 0, done.err
    assert done.json()["windows"] == windows and done.json()["timezone"] == "Europe/Berlin"
    row = Endpoint.objects.get(pk=endpoint.pk)
    assert (row.shift_timezone, row.shift_schedule) == ("Europe/Berlin", windows)
    bad_json = run_manage(capsys, "shift_schedule", endpoint.slug, "--windows", "[{")
    assert bad_json.code != 0 and "--windows" in bad_json.err
    cleared = run_manage(capsys, "shift_schedule", endpoint.slug, "--clear", "--json")
    assert cleared.code == 0 and cleared.json()["windows"] == []
    assert Endpoint.objects.get(pk=endpoint.pk).shift_schedule == []


def test_next_boundary_reads_the_windows_once(monkeypatch):
    """The search used to re-derive every window for every candidate instant (800 windows:
    4-5 s of CPU under the endpoint's row lock); now one pass over one list."""
    calls = []
    real = models.shift_windows
    monkeypatch.setattr(models, "shift_windows",
                        lambda *args: calls.append(args) or real(*args))
    schedule = [{"day": WEEKDAYS[n % 7], "start": f"{n % 24:02d}:00", "end": f"{n % 24:02d}:20"}
                for n in range(50)]
    now = datetime(2026, 3, 30, 10, tzinfo=UTC)
    assert next_shift_boundary(schedule, "Europe/Berlin", now) is not None
    assert len(calls) == 1


# -- brute-force reference ---------------------------------------------------------------------

def reference_instances(schedule, zone_name, start, end):
    """Every window on every local date near [start, end], as UTC instants (naively)."""
    zone = ZoneInfo(zone_name)
    day = start.astimezone(zone).date() - timedelta(days=3)
    last = end.astimezone(zone).date() + timedelta(days=2)
    instances = []
    while day <= last:
        for window in schedule:
            if WEEKDAYS[day.weekday()] != window["day"]:
                continue
            sh, sm = map(int, window["start"].split(":"))
            eh, em = map(int, window["end"].split(":"))
            end_day = day + timedelta(days=1) if (eh, em) <= (sh, sm) or eh == 24 else day
            if eh == 24:
                eh = 0
            begins = datetime(day.year, day.month, day.day, sh, sm, tzinfo=zone).astimezone(UTC)
            ends = datetime(end_day.year, end_day.month, end_day.day, eh, em,
                            tzinfo=zone).astimezone(UTC)
            if begins < ends:
                instances.append((begins, ends))
        day += timedelta(days=1)
    return instances


def reference_boundaries(schedule, zone_name, start, end):
    """Try every window edge: a boundary is an edge where the state differs from the state a
    microsecond before it (quadratic, obviously right)."""
    instances = reference_instances(schedule, zone_name, start, end)

    def on(t):
        return any(b <= t < e for b, e in instances)

    edges = sorted({t for window in instances for t in window if start < t <= end})
    tick = timedelta(microseconds=1)
    return [(t, "in" if on(t) else "out") for t in edges if on(t) != on(t - tick)]


ZONES = ["UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata",
         "Pacific/Chatham"]
CLOCK = st.sampled_from([f"{h:02d}:{m:02d}" for h in range(24) for m in (0, 15, 30, 45)]
                        + ["02:30", "01:30", "24:00"])
WINDOW = st.fixed_dictionaries({"day": st.sampled_from(WEEKDAYS), "start": CLOCK.filter(
    lambda t: t != "24:00"), "end": CLOCK})


@hypothesis_settings(max_examples=300, deadline=None)
@given(schedule=st.lists(WINDOW, max_size=12), zone=st.sampled_from(ZONES),
       now=st.datetimes(min_value=datetime(2026, 1, 1), max_value=datetime(2027, 12, 31),
                        timezones=st.just(UTC)))
def test_next_boundary_matches_a_brute_force_reference(schedule, zone, now):
    horizon = now + timedelta(days=15)
    expected = reference_boundaries(schedule, zone, now, horizon)
    assert shift_boundaries(schedule, zone, now, horizon) == expected
    assert next_shift_boundary(schedule, zone, now) == (expected[0][0] if expected else None)
