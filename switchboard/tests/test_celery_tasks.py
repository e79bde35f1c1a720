"""The beat schedule names real tasks, and each task runs its sweep (executed in-process by
Celery's own task machinery; the Procfile topology itself runs in tests/system). Beat and the
embedded scheduler both read switchboard/schedule.py's table: each task there calls the very
function the embedded scheduler calls."""

from datetime import timedelta
from importlib import import_module

import pytest
from django.utils import timezone

from switchboard import schedule, scheduler
from switchboard.celery import app
from todos import transitions
from todos.models import State, Todo

pytestmark = pytest.mark.django_db


def test_every_beat_entry_is_a_registered_task_with_a_cadence():
    app.loader.import_default_modules()
    for name, entry in app.conf.beat_schedule.items():
        assert entry["task"] in app.tasks, f"beat entry {name} names no task"
        assert 0 < float(entry["schedule"]) <= 3600  # retention is hourly; the rest <= 60 s


def test_beat_and_the_embedded_scheduler_run_every_entry_of_the_table_at_its_cadence():
    names = [entry.name for entry in schedule.SWEEPS]
    assert len(set(names)) == len(names)
    assert set(app.conf.beat_schedule) == set(names)
    embedded = scheduler.embedded_sweeps()
    assert len(embedded) == len(schedule.SWEEPS)
    for entry, (sweep, interval) in zip(schedule.SWEEPS, embedded):
        assert callable(sweep) and f"{sweep.__module__}.{sweep.__qualname__}" == entry.sweep
        assert interval == entry.every.total_seconds() == app.conf.beat_schedule[entry.name]["schedule"]


@pytest.mark.parametrize("entry", schedule.SWEEPS, ids=lambda entry: entry.name)
def test_each_beat_task_calls_the_sweep_the_embedded_scheduler_calls(entry, monkeypatch):
    app.loader.import_default_modules()
    module, name = entry.sweep.rsplit(".", 1)
    ran = object()
    monkeypatch.setattr(import_module(module), name, lambda: ran)
    assert app.conf.beat_schedule[entry.name]["task"] == entry.task
    assert app.tasks[entry.task].run() is ran


def test_the_reaper_and_promoter_tasks_move_todos(agent, make_todo):
    app.loader.import_default_modules()
    past = timezone.now() - timedelta(minutes=20)
    lapsed = transitions.claim_todo(agent, make_todo().pk, lease_ttl_seconds=1, now=past)
    failed = transitions.claim_todo(agent, make_todo().pk, now=past)
    transitions.fail_todo(agent, failed.pk, now=past)

    assert app.tasks["todos.tasks.expire_lapsed_leases"].apply().get() == 1
    assert app.tasks["todos.tasks.promote_due_retries"].apply().get() == 1
    assert set(Todo.objects.filter(pk__in=[lapsed.pk, failed.pk]).values_list("state", flat=True)) == {
        State.PENDING}


def test_the_prune_task_deletes_history_past_retention(agent, make_todo, settings):
    app.loader.import_default_modules()
    long_ago = timezone.now() - settings.SWITCHBOARD_RETAIN_DONE - timedelta(days=1)
    todo = transitions.claim_todo(agent, make_todo(now=long_ago).pk, now=long_ago)
    transitions.complete_todo(agent, todo.pk, now=long_ago)
    assert app.tasks["ingest.tasks.prune_history"].apply().get() == 1 + 3  # todo + its 3 events
    assert not Todo.objects.filter(pk=todo.pk).exists()
