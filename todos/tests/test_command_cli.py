"""manage.py reap and requeue as a shell runs them: exit status, stderr, --json, --help."""

from datetime import timedelta

import pytest
from django.utils import timezone

from tests.cli import run_manage
from tests.factories import EndpointFactory
from todos import transitions
from todos.models import State

pytestmark = pytest.mark.django_db


@pytest.fixture
def dead_letter(operator):
    endpoint = EndpointFactory(slug="once", owner=operator, max_attempts=1)

    def make(queue="inbox"):
        todo, _ = transitions.create_todo(endpoint=endpoint, queue=queue, title="t", actor="t")
        caller = transitions.Caller.operator(endpoint, "alice")
        transitions.claim_todo(caller, todo.pk)
        transitions.fail_todo(caller, todo.pk, error="x")
        return todo

    return make


@pytest.mark.parametrize("command", ["reap", "requeue"])
def test_help(capsys, command):
    run = run_manage(capsys, command, "--help")
    assert run.code == 0 and "usage:" in run.out and "--json" in run.out


def test_reap_moves_lapsed_leases_and_due_retries(capsys, make_todo, agent):
    lapsed, retrying = make_todo(), make_todo()
    past = timezone.now() - timedelta(hours=1)
    transitions.claim_todo(agent, lapsed.pk, lease_ttl_seconds=1, now=past)
    transitions.claim_todo(agent, retrying.pk, now=past)
    transitions.fail_todo(agent, retrying.pk, now=past)
    run = run_manage(capsys, "reap", "--json")
    assert run.code == 0 and run.err == ""
    assert run.json() == {"moved": 2}
    assert run_manage(capsys, "reap").out.strip() == "moved 0 todos"


def test_reap_rejects_arguments(capsys):
    run = run_manage(capsys, "reap", "extra")
    assert run.code != 0 and "unrecognized arguments" in run.err


def test_requeue_by_ids(capsys, dead_letter):
    first, second = dead_letter(), dead_letter()
    run = run_manage(capsys, "requeue", str(first.pk), str(second.pk), "--json")
    assert run.code == 0
    assert run.json() == {"requeued": [str(first.pk), str(second.pk)]}
    first.refresh_from_db()
    assert first.state == State.PENDING and first.attempts == 0


def test_requeue_dead_letters_of_an_endpoint_and_queue_with_dry_run(capsys, dead_letter):
    inbox, reviews = dead_letter("inbox"), dead_letter("reviews")
    run = run_manage(capsys, "requeue", "--dead-letters", "--endpoint", "once", "--queue", "reviews",
                     "--dry-run", "--json")
    assert run.json() == {"would_requeue": [str(reviews.pk)]}  # §11: a dry run says "would"
    reviews.refresh_from_db()
    assert reviews.is_dead_letter  # dry run changed nothing
    run = run_manage(capsys, "requeue", "--dead-letters", "--endpoint", "once", "--json")
    assert run.json() == {"requeued": [str(inbox.pk), str(reviews.pk)]}
    assert "requeued 0" in run_manage(capsys, "requeue", "--dead-letters", "--endpoint", "once").out


@pytest.mark.parametrize("argv, message", [
    ([], "give todo ids, or --dead-letters"),
    (["1", "--dead-letters", "--endpoint", "once"], "give todo ids, or --dead-letters"),
    (["--dead-letters"], "--dead-letters needs --endpoint"),
    (["--dead-letters", "--endpoint", "nope"], "no endpoint 'nope'"),
    (["1", "--endpoint", "once"], "--endpoint/--queue go with --dead-letters"),
    (["abc"], "not todo ids"),
    (["99999999999999999999999"], "not todo ids"),
    (["\u0661"], "not todo ids"),
    (["999999999"], "no such todos"),
])
def test_requeue_bad_arguments_exit_non_zero_on_stderr(capsys, dead_letter, argv, message):
    run = run_manage(capsys, "requeue", *argv, "--json")
    assert run.code != 0 and message in run.err and run.out == ""


def test_requeue_of_a_todo_that_is_not_failed_is_refused(capsys, make_todo):
    todo = make_todo()
    run = run_manage(capsys, "requeue", str(todo.pk), "--json")
    assert run.code != 0
    assert "not failed" in run.err and "nothing requeued" in run.err


def test_a_real_manage_py_process_exits_non_zero_with_the_error_on_stderr():
    import subprocess
    import sys
    from pathlib import Path

    from django.conf import settings

    result = subprocess.run(
        [sys.executable, "manage.py", "requeue", "--json"], cwd=Path(settings.BASE_DIR),
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    assert result.stdout == ""
    assert "CommandError: give todo ids" in result.stderr


def test_requeue_dry_run_agrees_with_the_real_run_on_a_reused_key(capsys, operator):
    endpoint = EndpointFactory(slug="keys", owner=operator, max_attempts=1)
    caller = transitions.Caller.operator(endpoint, "alice")
    dead, _ = transitions.create_todo(endpoint=endpoint, queue="q", title="t", actor="t",
                                      idempotency_key="hook:1")
    transitions.claim_todo(caller, dead.pk)
    transitions.fail_todo(caller, dead.pk)
    transitions.create_todo(endpoint=endpoint, queue="q", title="t", actor="t", idempotency_key="hook:1")
    for extra in (["--dry-run"], []):
        run = run_manage(capsys, "requeue", str(dead.pk), "--json", *extra)
        assert run.code != 0 and "held by a newer live todo" in run.err and run.out == ""


def test_requeue_partly_refused_prints_what_it_did_and_exits_non_zero(capsys, dead_letter, make_todo):
    dead, pending = dead_letter(), make_todo()
    run = run_manage(capsys, "requeue", str(dead.pk), str(pending.pk), "--json")
    assert run.code != 0 and "not failed" in run.err
    assert run.json() == {"requeued": [str(dead.pk)]}
