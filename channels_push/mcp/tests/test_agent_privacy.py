"""What one agent session may learn and do about another's work (CONTRACT §12; issue 12 items
8 and 9), with two real MCP sessions through the ASGI application."""

import pytest

from channels_push.models import McpSession
from channels_push.tests.conftest import McpDriver, make_ready_todo
from ingest import sweeps as ingest_sweeps
from ingest import transitions as ingest_transitions
from ingest.models import OperatorSecret
from todos import transitions
from todos.models import Todo


@pytest.fixture
def workers(vend):
    endpoint, credential = vend(slug="pool")
    one, two = McpDriver(endpoint.slug, credential), McpDriver(endpoint.slug, credential)
    one.initialize()
    two.initialize()
    one.endpoint = two.endpoint = endpoint
    return one, two


def structured(reply):
    return reply["result"]["structuredContent"]


def error_code(reply):
    return structured(reply)["error"]["code"]


def test_a_sibling_sees_no_lease_id_and_only_an_8_character_owner_hint(workers):
    one, two = workers
    todo = make_ready_todo(one.endpoint)
    claimed = structured(one.call("claim", {"todo_id": str(todo.pk)}))["todo"]
    assert claimed["lease_id"]  # the holder gets its lease

    listed = structured(two.call("list_todos"))["todos"]
    row = next(t for t in listed if t["id"] == str(todo.pk))
    assert row["lease_id"] is None
    assert row["lease_owner"] == one.session_id[:8]
    assert one.session_id not in str(listed)
    assert claimed["lease_id"] not in str(listed)
    # The holder's own listing still shows its lease.
    mine = next(t for t in structured(one.call("list_todos"))["todos"] if t["id"] == str(todo.pk))
    assert mine["lease_id"] == claimed["lease_id"]
    assert mine["lease_owner"] == one.session_id[:8]

    # Worker 2 cannot finish worker 1's claim, with or without guessing from the hint.
    assert error_code(two.call("complete", {"todo_id": str(todo.pk)})) == "lease_lost"
    assert error_code(two.call("complete", {"todo_id": str(todo.pk),
                                            "lease_id": row["lease_owner"]})) == "lease_lost"
    assert Todo.objects.get(pk=todo.pk).state == "claimed"
    # Nor end worker 1's session by the hint it saw.
    assert two.request("DELETE", mcp_session_id=row["lease_owner"]).status == 404
    assert McpSession.objects.get(pk=one.session_id).terminated_at is None


def test_the_board_shows_only_the_owner_hint(workers, client):
    one, _ = workers
    todo = make_ready_todo(one.endpoint)
    lease_id = structured(one.call("claim", {"todo_id": str(todo.pk)}))["todo"]["lease_id"]
    client.force_login(one.endpoint.owner)
    board = client.get("/todos/").content.decode()
    assert one.session_id[:8] in board
    assert one.session_id not in board and lease_id not in board
    # The todo's page and its history name the holder by client and hint, never the whole
    # session id or the lease id.
    detail = client.get(f"/todos/{todo.pk}/").content.decode()
    assert f"held by <span class=\"holder\">pytest 1 · {one.session_id[:8]}</span>" in detail
    assert one.session_id not in detail and lease_id not in detail


def handed_over(endpoint):
    todo, _ = ingest_transitions.hand_over_todo(
        endpoint=endpoint, operator=endpoint.owner, queue="inbox", title="deploy",
        secret_values={"token": "tok-live-123"})
    return todo, todo.payload["secrets"]["token"]["$secret"]


def test_read_secret_works_only_while_the_calling_session_holds_the_lease(workers):
    one, two = workers
    todo, ref = handed_over(one.endpoint)
    assert error_code(one.call("read_secret", {"ref": ref})) == "lease_lost"  # not claimed yet
    one.call("claim", {"todo_id": str(todo.pk)})
    assert structured(one.call("read_secret", {"ref": ref}))["value"] == "tok-live-123"
    assert error_code(two.call("read_secret", {"ref": ref})) == "lease_lost"
    one.call("release", {"todo_id": str(todo.pk)})
    assert error_code(one.call("read_secret", {"ref": ref})) == "lease_lost"


def test_secrets_are_deleted_when_their_todo_is_done(workers):
    one, _ = workers
    todo, ref = handed_over(one.endpoint)
    one.call("claim", {"todo_id": str(todo.pk)})
    assert OperatorSecret.objects.filter(ref=ref).exists()
    one.call("complete", {"todo_id": str(todo.pk)})
    # Dead from the moment the todo is done; off the disk with the next sweep.
    assert error_code(one.call("read_secret", {"ref": ref})) == "not_found"
    assert ingest_sweeps.delete_secrets_of_ended_todos() == 1
    assert not OperatorSecret.objects.filter(ref=ref).exists()
    assert error_code(one.call("read_secret", {"ref": ref})) == "not_found"


def test_secrets_are_deleted_when_their_todo_is_dead_lettered_but_kept_for_a_retry(vend):
    endpoint, credential = vend(slug="two-tries", max_attempts=2)
    worker = McpDriver(endpoint.slug, credential)
    worker.initialize()
    todo, ref = handed_over(endpoint)
    worker.call("claim", {"todo_id": str(todo.pk)})
    worker.call("fail", {"todo_id": str(todo.pk), "error": "first"})
    assert ingest_sweeps.delete_secrets_of_ended_todos() == 0
    assert OperatorSecret.objects.filter(ref=ref).exists()  # waiting to retry
    Todo.objects.filter(pk=todo.pk).update(state="pending", retry_at=None)
    worker.call("claim", {"todo_id": str(todo.pk)})
    assert structured(worker.call("read_secret", {"ref": ref}))["value"] == "tok-live-123"
    worker.call("fail", {"todo_id": str(todo.pk), "error": "last"})
    assert Todo.objects.get(pk=todo.pk).dead_lettered_at is not None
    assert ingest_sweeps.delete_secrets_of_ended_todos() == 1
    assert not OperatorSecret.objects.filter(ref=ref).exists()


def test_a_requeued_dead_letter_gets_no_secret_back(vend):
    """The secret died with the dead letter: an operator's requeue before the sweep took it
    off the disk does not bring it back."""
    endpoint, credential = vend(slug="requeued", max_attempts=1)
    worker = McpDriver(endpoint.slug, credential)
    worker.initialize()
    todo, ref = handed_over(endpoint)
    worker.call("claim", {"todo_id": str(todo.pk)})
    worker.call("fail", {"todo_id": str(todo.pk), "error": "last"})
    operator = transitions.Caller.operator(endpoint, "alice")
    transitions.requeue_todo(operator, todo.pk)
    worker.call("claim", {"todo_id": str(todo.pk)})
    assert OperatorSecret.objects.filter(ref=ref).exists()  # not swept yet
    assert error_code(worker.call("read_secret", {"ref": ref})) == "not_found"
    assert ingest_sweeps.delete_secrets_of_ended_todos() == 1


def test_a_lease_lapsing_on_the_last_attempt_deletes_the_secrets(vend):
    from datetime import timedelta

    from django.utils import timezone

    endpoint, _ = vend(slug="lapse", max_attempts=1)
    todo, ref = handed_over(endpoint)
    transitions.claim_todo(transitions.Caller.agent(endpoint, "s1"), todo.pk)
    transitions.return_lapsed_leases(now=timezone.now() + timedelta(hours=1), limit=10)
    assert Todo.objects.get(pk=todo.pk).dead_lettered_at is not None
    assert ingest_sweeps.delete_secrets_of_ended_todos() == 1
    assert not OperatorSecret.objects.filter(ref=ref).exists()
