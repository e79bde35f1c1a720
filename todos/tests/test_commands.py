"""The queue's management commands, with the exact CONTRACT §11 signatures and --json output."""

import json

import pytest
from django.core.management import CommandError, call_command

from endpoints.models import Credential, Endpoint, hash_credential
from todos import transitions
from todos.models import State

pytestmark = pytest.mark.django_db


def run_json(capsys, *args):
    call_command(*args, "--json")
    out = capsys.readouterr().out
    return json.loads(out)


def test_vend_endpoint_prints_the_credential_once_and_stores_its_hash(capsys, operator, settings):
    settings.SWITCHBOARD_PUBLIC_URL = "https://sb.example"
    data = run_json(capsys, "vend_endpoint", "reviewer", "--owner", operator.username,
                    "--queues", "inbox,reviews", "--verbs", "list_todos,claim_next,complete",
                    "--lease-seconds", "120", "--max-attempts", "3")
    assert set(data) == {"slug", "mcp_url", "credential"}
    assert data["mcp_url"] == "https://sb.example/mcp/reviewer"
    endpoint = Endpoint.objects.get(slug="reviewer")
    assert endpoint.scope == ["inbox", "reviews"] and endpoint.max_attempts == 3
    assert endpoint.verbs == ["list_todos", "claim_next", "complete"]
    assert endpoint.default_lease_seconds == 120
    stored = Credential.objects.get(endpoint=endpoint)
    assert stored.digest == hash_credential(data["credential"])
    assert data["credential"] not in stored.digest + stored.hint


@pytest.mark.parametrize(
    "args, message",
    [
        (["x", "--owner", "nobody"], "no user"),
        (["bad slug!", "--owner", "alice"], "slug"),
        (["x", "--owner", "alice", "--verbs", "claim,fly"], "unknown verbs"),
        (["x", "--owner", "alice", "--queues", "in box"], "scope"),
        (["x", "--owner", "alice", "--lease-seconds", "0"], "default_lease_seconds"),
        (["agent", "--owner", "alice"], "already exists"),
    ],
)
def test_vend_endpoint_rejects_bad_arguments(endpoint, args, message):
    with pytest.raises(CommandError, match=message):
        call_command("vend_endpoint", *args)


def test_rotate_credential_keeps_the_old_one_for_the_grace(capsys, operator):
    from endpoints import queries

    first = run_json(capsys, "vend_endpoint", "rot", "--owner", operator.username)["credential"]
    second = run_json(capsys, "rotate_credential", "rot", "--grace-seconds", "3600")
    assert set(second) == {"slug", "credential"} and second["credential"] != first
    assert queries.find_endpoint_for_credential("rot", first) is not None
    assert queries.find_endpoint_for_credential("rot", second["credential"]) is not None
    run_json(capsys, "rotate_credential", "rot", "--grace-seconds", "0")
    assert queries.find_endpoint_for_credential("rot", first) is None
    with pytest.raises(CommandError, match="no endpoint"):
        call_command("rotate_credential", "nope")


def dead_letter(agent, todo):
    transitions.claim_todo(agent, todo.pk)
    return transitions.fail_todo(agent, todo.pk, error="x")


def test_requeue_by_id_and_dead_letters_with_dry_run(capsys, agent, endpoint, make_todo):
    endpoint.max_attempts = 1
    endpoint.save()
    a, b, c = (dead_letter(agent, make_todo(q)) for q in ("inbox", "inbox", "other"))
    assert run_json(capsys, "requeue", "--dead-letters", "--endpoint", "agent", "--dry-run") == {
        "requeued": [str(a.pk), str(b.pk), str(c.pk)]}
    assert a.__class__.objects.get(pk=a.pk).state == State.FAILED  # dry run changed nothing
    assert run_json(capsys, "requeue", "--dead-letters", "--endpoint", "agent", "--queue", "other") == {
        "requeued": [str(c.pk)]}
    assert run_json(capsys, "requeue", str(a.pk)) == {"requeued": [str(a.pk)]}
    assert a.__class__.objects.get(pk=a.pk).state == State.PENDING


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "give todo ids"),
        (["1", "--dead-letters", "--endpoint", "agent"], "give todo ids"),
        (["--dead-letters"], "needs --endpoint"),
        (["--dead-letters", "--endpoint", "nope"], "no endpoint"),
        (["abc"], "not todo ids"),
        (["999999"], "no such todos"),
        (["1", "--queue", "x"], "go with --dead-letters"),
    ],
)
def test_requeue_rejects_bad_arguments(endpoint, args, message):
    with pytest.raises(CommandError, match=message):
        call_command("requeue", *args)


def test_requeue_of_a_pending_todo_fails_loudly(capsys, make_todo):
    todo = make_todo()
    with pytest.raises(CommandError, match="nothing requeued"):
        call_command("requeue", str(todo.pk))
    assert "not failed" in capsys.readouterr().err


def test_reap_runs_the_sweeps_once(capsys):
    assert run_json(capsys, "reap") == {"moved": 0}
