"""The outbox and GitHub write-back (docs/write-back.md): deliveries made from GitHub's own
example payloads (@octokit/webhooks-examples), sent to a stand-in held to GitHub's published
description. The worker is driven by hand (``send_due_write_backs``), as a Celery task or the
embedded scheduler would call it, so every test sees exactly when requests leave."""

import json
import threading
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import transaction
from django.utils import timezone

from ingest import connections, status_text, transitions, write_back
from ingest.models import Connection, DeliveryRecord, Route, WriteBack
from ingest.senders import github as github_sender
from ingest.tests import hook_client, signing
from ingest.tests.conftest import SECRETS
from ingest.tests.github_standin import app_object, schema_problems, wait_for, webhook_example
from switchboard import schedule
from endpoints.models import Endpoint
from todos import transitions as todo_transitions
from todos.models import OutboxEntry, Todo

pytestmark = pytest.mark.django_db
INSTALLATION = 4242


@pytest.fixture(autouse=True)
def public_url(settings):
    settings.SWITCHBOARD_PUBLIC_URL = "https://sb.example"


def deliver(event: str, payload: dict, *, slug="gh") -> Todo | None:
    payload.setdefault("installation", {"id": INSTALLATION, "node_id": "MDIzOkludGVncmF0aW9u"})
    body = signing.body_of(payload)
    answer = hook_client.post(slug, body, **signing.github(SECRETS["github"], body, event=event))
    assert answer.status_code == 202, answer.content
    todos = answer.json()["todos"]
    return Todo.objects.get(pk=todos[0]["id"]) if todos else None


def issue_opened() -> dict:
    return webhook_example("issues", action="opened")


def send(now=None) -> int:
    return write_back.send_due_write_backs(now=now)


def rows(todo) -> dict:
    return {row.action: row for row in WriteBack.objects.filter(todo_id=todo.pk)}


def test_a_delivery_gets_eyes_on_its_issue(hooked, github):
    payload = issue_opened()
    todo = deliver("issues", payload)
    assert todo.write_back == "status"
    assert not github.requests_to("reactions/create-for-issue")  # nothing inside the delivery
    assert send() == 1
    (seen,) = github.requests_to("reactions/create-for-issue")
    repo = payload["repository"]
    assert seen.path == (f"/repos/{repo['owner']['login']}/{repo['name']}/issues/"
                         f"{payload['issue']['number']}/reactions")
    assert seen.body == {"content": "eyes"}
    ack = rows(todo)["ack"]
    assert ack.state == "sent" and ack.external_id and ack.attempts == 1
    assert ack.target_label == f"{repo['full_name']}#{payload['issue']['number']}"
    # Written as the App's installation, with a token minted for the delivery's installation.
    (minted,) = github.requests_to("apps/create-installation-access-token")
    assert minted.path == f"/app/installations/{INSTALLATION}/access_tokens"
    assert github.reactions[0]["user"] == "switchboard-test[bot]"
    assert "status" not in rows(todo)  # no status before the todo's first change


def test_a_review_comment_gets_eyes_on_the_review_comment(hooked, github):
    payload = webhook_example("pull_request_review_comment", action="created")
    deliver("pull_request_review_comment", payload)
    send()
    (seen,) = github.requests_to("reactions/create-for-pull-request-review-comment")
    assert seen.path.endswith(f"/pulls/comments/{payload['comment']['id']}/reactions")


def test_a_comment_gets_eyes_on_the_comment(hooked, github):
    payload = webhook_example("issue_comment", action="created")
    deliver("issue_comment", payload)
    send()
    (seen,) = github.requests_to("reactions/create-for-issue-comment")
    assert seen.path.endswith(f"/issues/comments/{payload['comment']['id']}/reactions")


def test_one_status_comment_per_todo_edited_in_place(hooked, github, agent):
    todo = deliver("issues", issue_opened())
    send()
    todo_transitions.claim_todo(agent, todo.pk)
    send()
    (posted,) = github.requests_to("issues/create-comment")
    assert "Being worked on" in posted.body["body"] and "`agent`" in posted.body["body"]
    assert f"https://sb.example/todos/{todo.pk}/" in posted.body["body"]
    todo_transitions.heartbeat_todo(agent, todo.pk)
    assert not OutboxEntry.objects.filter(todo_id=todo.pk).exists()  # a heartbeat shows nothing
    todo_transitions.complete_todo(agent, todo.pk, result={
        "summary": "Fixed the crash; see the PR.", "url": "https://github.com/o/r/pull/9"})
    send()
    (edited,) = github.requests_to("issues/update-comment")
    (comment,) = github.status_comments()
    assert comment["body"] == edited.body["body"]
    assert "Done" in comment["body"] and "Fixed the crash; see the PR\\." in comment["body"]
    assert "<https://github.com/o/r/pull/9>" in comment["body"]
    assert edited.path.endswith(f"/issues/comments/{comment['id']}")
    status = rows(todo)["status"]
    assert status.state == "sent" and status.external_id == str(comment["id"])
    assert status.wanted == status.sent == 2


def test_changes_before_a_send_collapse_into_one_showing_the_latest(hooked, github, agent):
    todo = deliver("issues", issue_opened())
    todo_transitions.claim_todo(agent, todo.pk)
    todo_transitions.fail_todo(agent, todo.pk, error="flaky test")
    todo_transitions.requeue_todo(todo_transitions.Caller.operator(todo.endpoint, "alice"),
                                  todo.pk)
    todo_transitions.claim_todo(agent, todo.pk)
    assert OutboxEntry.objects.filter(todo_id=todo.pk).count() == 5  # create + four changes
    send()
    assert len(github.requests_to("reactions/create-for-issue")) == 1
    (posted,) = github.requests_to("issues/create-comment")
    assert "Being worked on" in posted.body["body"] and "attempt 1 of" in posted.body["body"]
    assert rows(todo)["status"].wanted == 4 and not OutboxEntry.objects.exists()


def test_an_outbox_entry_exists_exactly_when_its_transition_committed(hooked, agent):
    todo = deliver("issues", issue_opened())
    send()
    with pytest.raises(RuntimeError), transaction.atomic():
        todo_transitions.claim_todo(agent, todo.pk)
        assert OutboxEntry.objects.filter(todo_id=todo.pk).count() == 1
        raise RuntimeError("the caller's transaction rolls back")
    assert not OutboxEntry.objects.exists()
    assert Todo.objects.get(pk=todo.pk).state == "pending"


def test_an_ack_route_reacts_and_writes_no_status(hooked, github, agent, endpoint):
    hooked.routes.update(write_back="ack")
    todo = deliver("issues", issue_opened())
    todo_transitions.claim_todo(agent, todo.pk)
    todo_transitions.complete_todo(agent, todo.pk, result={"summary": "done"})
    assert OutboxEntry.objects.count() == 1
    send()
    assert len(github.requests_to("reactions/create-for-issue")) == 1
    assert not github.requests_to("issues/create-comment")


@pytest.mark.parametrize("how", ["route off", "no connection"])
def test_nothing_is_written_where_the_route_or_webhook_says_so(hooked, github, agent, how):
    if how == "route off":
        hooked.routes.update(write_back="off")
    else:
        connections.set_webhook_connection(hooked, None)
    todo = deliver("issues", issue_opened())
    assert todo.write_back == "off"
    todo_transitions.claim_todo(agent, todo.pk)
    assert not OutboxEntry.objects.exists()
    assert send() == 0 and github.seen == [github.seen[0]]  # only the connection's test


def test_an_event_with_nothing_to_react_to_writes_nothing(hooked, github):
    deliver("push", webhook_example("push"))
    assert send() == 0 and not WriteBack.objects.exists()


# -- failures, retries and the source being down -------------------------------------------------


def test_a_source_that_is_down_neither_fails_nor_touches_transitions(hooked_by_token, github,
                                                                     agent):
    github.fail(503, times=None)
    todo = deliver("issues", issue_opened())
    requests_before = len(github.seen)
    todo_transitions.claim_todo(agent, todo.pk)
    todo_transitions.complete_todo(agent, todo.pk, result={"summary": "ok"})
    assert len(github.seen) == requests_before  # transitions never call the source
    now = timezone.now()
    send(now)
    ack = rows(todo)["ack"]
    assert ack.state == "pending" and ack.last_error == "503: Service Unavailable"
    assert ack.next_attempt_at == now + write_back.FIRST_BACKOFF
    assert "status" not in rows(todo) or rows(todo)["status"].attempts == 0  # waits for its ack
    for minutes in range(1, 6):  # down for five minutes: each due retry fails again
        send(now + timedelta(minutes=minutes))
    github.recover()
    send(now + timedelta(minutes=20))
    send(now + timedelta(minutes=21))
    assert {row.state for row in rows(todo).values()} == {"sent"}
    reactions = github.requests_to("reactions/create-for-issue")
    assert len([seen for seen in reactions if seen.status == 201]) == 1
    assert len(github.requests_to("issues/create-comment")) == 1
    assert "Done" in github.status_comments()[0]["body"]


def assert_a_429_waits_as_said(standin, seconds: int):
    """The one write-back due meets a 429 with ``Retry-After: seconds``: it waits that long,
    not a moment less, then goes."""
    standin.fail(429, headers={"Retry-After": str(seconds)}, message="rate limited")
    now = timezone.now()
    send(now)
    (row,) = WriteBack.objects.all()
    assert row.state == "pending" and row.next_attempt_at == now + timedelta(seconds=seconds)
    assert send(now + timedelta(seconds=seconds - 1)) == 0
    assert send(now + timedelta(seconds=seconds)) == 1
    row.refresh_from_db()
    assert row.state == "sent"


def test_a_rate_limit_waits_as_long_as_github_says(hooked_by_token, github):
    deliver("issues", issue_opened())
    assert_a_429_waits_as_said(github, 120)


def test_a_secondary_rate_limit_403_waits_for_the_reset(hooked, github):
    deliver("issues", issue_opened())
    now = timezone.now().replace(microsecond=0)
    reset = now + timedelta(minutes=3)
    github.fail(403, headers={"x-ratelimit-remaining": "0",
                              "x-ratelimit-reset": str(int(reset.timestamp()))},
                message="API rate limit exceeded")
    send(now)
    (ack,) = WriteBack.objects.all()
    assert ack.state == "pending" and ack.next_attempt_at == reset


def test_after_24_hours_of_failing_a_write_back_is_abandoned(hooked_by_token, github):
    deliver("issues", issue_opened())
    github.fail(502, times=None, message="Bad Gateway")
    start = timezone.now()
    send(start)
    (ack,) = WriteBack.objects.all()
    assert ack.failing_since == start and ack.state == "pending"
    # The clock moved: a minute before the 24 h are up, a failure still waits for its retry...
    send(start + write_back.RETRY_FOR - timedelta(minutes=1))
    ack.refresh_from_db()
    assert ack.state == "pending" and ack.failing_since == start
    # ...and the first failure whose retry would fall past them gives up.
    send(start + write_back.RETRY_FOR)
    ack.refresh_from_db()
    assert ack.state == "abandoned" and ack.last_error == "502: Bad Gateway"
    assert ack.attempts == 3 and ack.next_attempt_at is None
    assert send(start + timedelta(days=3)) == 0


def test_a_refusal_fails_at_once_with_githubs_message(hooked_by_token, github):
    deliver("issues", issue_opened())
    github.fail(404, message="Not Found")
    github.problems.clear()
    send()
    (ack,) = WriteBack.objects.all()
    assert ack.state == "failed" and ack.last_error == "404: Not Found" and ack.attempts == 1
    assert ack.next_attempt_at is None
    assert send(timezone.now() + timedelta(days=2)) == 0
    assert write_back.retry_write_back(ack)
    assert send() == 1
    ack.refresh_from_db()
    assert ack.state == "sent"


def test_bad_credentials_are_the_connections_last_error(hooked, github, app_connection):
    deliver("issues", issue_opened())
    github.fail(401, message="Bad credentials", times=2)  # the token mint, then nothing else
    send()
    app_connection.refresh_from_db()
    assert app_connection.last_error == "401: Bad credentials"


def test_a_status_never_goes_before_its_ack(hooked, github, agent):
    todo = deliver("issues", issue_opened())
    todo_transitions.claim_todo(agent, todo.pk)
    github.fail(503, times=1)  # the installation token mint fails: the ack waits
    now = timezone.now()
    send(now)
    assert not github.requests_to("issues/create-comment")
    assert rows(todo)["status"].attempts == 0
    send(now + timedelta(seconds=10))
    order = [seen.operation for seen in github.seen if seen.status in (200, 201)
             and seen.operation.startswith(("reactions/", "issues/"))]
    assert order == ["reactions/create-for-issue", "issues/create-comment"]


def post_status_then_die(todo, agent, send_status):
    """The todo is claimed, and a worker takes its status write-back, posts it with
    ``send_status`` (the client's) and dies before recording it. Returns ``(row, now,
    posted)``: the write-back as the worker left it, when it took it, and the id the source
    gave what it posted."""
    send()
    todo_transitions.claim_todo(agent, todo.pk)
    write_back.absorb_outbox_entries(now=timezone.now())
    now = timezone.now()
    row = write_back.claim_due_write_back(now=now)
    assert row.action == "status"
    half_sent = status_text.StatusUpdate(todo_id=todo.pk, state="claimed", dead=False,
                                         text="half-sent")
    posted = send_status(row.connection, row.target, half_sent, "", now, look_since=None)
    assert send(now + timedelta(seconds=30)) == 0  # its lease still holds
    return row, now, posted


def test_a_worker_killed_mid_send_does_not_post_the_status_twice(hooked_by_token, github, agent):
    todo = deliver("issues", issue_opened())
    row, now, _ = post_status_then_die(todo, agent, github_sender.send_status)
    send(now + write_back.SEND_LEASE + timedelta(seconds=1))
    (comment,) = github.status_comments()
    assert "Being worked on" in comment["body"]
    row.refresh_from_db()
    assert row.state == "sent" and row.external_id == str(comment["id"]) and row.attempts == 2
    (looked,) = github.requests_to("issues/list-comments")
    assert looked.query["since"] == row.created_at.strftime("%Y-%m-%dT%H:%M:%SZ")


def test_a_status_comment_someone_deleted_is_posted_again(hooked, github, agent):
    todo = deliver("issues", issue_opened())
    todo_transitions.claim_todo(agent, todo.pk)
    send()
    github.comments.clear()
    todo_transitions.complete_todo(agent, todo.pk, result={"summary": "ok"})
    send()
    (comment,) = github.status_comments()
    assert "Done" in comment["body"]
    assert rows(todo)["status"].external_id == str(comment["id"])


# -- the check run on a pull request's head commit -----------------------------------------------


def pull_request_opened() -> dict:
    return webhook_example("pull_request", action="opened")


def test_a_pull_request_gets_one_check_run_edited_until_it_succeeds(hooked, github, agent):
    payload = pull_request_opened()
    todo = deliver("pull_request", payload)
    send()
    assert set(rows(todo)) == {"ack"} and not github.check_runs  # nothing before a change
    todo_transitions.claim_todo(agent, todo.pk)
    send()
    (created,) = github.requests_to("checks/create")
    repo = payload["repository"]
    assert created.path == f"/repos/{repo['owner']['login']}/{repo['name']}/check-runs"
    assert created.body["head_sha"] == payload["pull_request"]["head"]["sha"]
    assert created.body["status"] == "in_progress" and "conclusion" not in created.body
    assert created.body["external_id"] == str(todo.pk) and created.body["name"] == "switchboard"
    assert created.body["details_url"] == f"https://sb.example/todos/{todo.pk}/"
    assert created.body["output"]["title"] == "🛠️ Being worked on"
    assert "`agent`" in created.body["output"]["summary"]
    todo_transitions.post_update_todo(agent, todo.pk, text="halfway")
    todo_transitions.complete_todo(agent, todo.pk, result={"summary": "Merged the fix."})
    send()
    (edited,) = github.requests_to("checks/update")
    (run,) = github.check_runs.values()
    assert edited.path.endswith(f"/check-runs/{run['answer']['id']}")
    assert run["answer"]["status"] == "completed" and run["answer"]["conclusion"] == "success"
    assert run["answer"]["output"]["title"] == "✅ Done"
    # What the stand-in answers is a check run as GitHub's description shapes one.
    assert schema_problems("components/schemas/check-run", run["answer"]) == []
    assert "Merged the fix\\." in run["answer"]["output"]["summary"]
    check = rows(todo)["check"]
    assert check.state == "sent" and check.external_id == str(run["answer"]["id"])
    assert check.wanted == check.sent == 3
    # The status comment goes beside it, as on an issue; the command lists all three.
    assert "Done" in github.status_comments()[0]["body"]
    assert {(row["action"], row["state"]) for row in write_backs_listed("--todo", str(todo.pk))} \
        == {("ack", "sent"), ("status", "sent"), ("check", "sent")}
    order = [seen.operation for seen in github.seen if seen.operation.startswith(("reactions/",
                                                                                  "checks/"))]
    assert order[0] == "reactions/create-for-issue"


def end_todo(todo, agent, ending: str) -> None:
    """``todo``, claimed by ``agent``, ends as ``ending``: failed with no attempts left
    ("dead letter") or some ("retrying"), or "cancelled" by an operator."""
    if ending == "cancelled":
        todo_transitions.cancel_todo(todo_transitions.Caller.operator(todo.endpoint, "alice"),
                                     todo.pk, reason="not needed")
    else:
        Todo.objects.filter(pk=todo.pk).update(max_attempts=1 if ending == "dead letter" else 3)
        todo_transitions.fail_todo(agent, todo.pk, error="tests fail")


@pytest.mark.parametrize("ending, conclusion, title", [
    ("dead letter", "failure", "💀 Failed for good (no attempts left)"),
    ("retrying", None, "⚠️ Failed; retrying at"),
    ("cancelled", "cancelled", "🚫 Cancelled"),
])
def test_a_check_run_concludes_as_its_todo_ends(hooked, github, agent, ending, conclusion,
                                                title):
    todo = deliver("pull_request", pull_request_opened())
    todo_transitions.claim_todo(agent, todo.pk)
    send()
    end_todo(todo, agent, ending)
    send()
    (run,) = (found["answer"] for found in github.check_runs.values())
    assert run["conclusion"] == conclusion and run["output"]["title"].startswith(title)
    assert run["status"] == ("completed" if conclusion else "queued")


def test_a_token_connection_writes_no_check_run(hooked_by_token, github, agent):
    todo = deliver("pull_request", pull_request_opened())
    todo_transitions.claim_todo(agent, todo.pk)
    send()
    assert set(rows(todo)) == {"ack", "status"}
    assert not [seen for seen in github.seen if seen.operation.startswith("checks/")]
    assert len(github.status_comments()) == 1


def test_an_issue_writes_no_check_run(hooked, github, agent):
    todo = deliver("issues", issue_opened())
    todo_transitions.claim_todo(agent, todo.pk)
    send()
    assert set(rows(todo)) == {"ack", "status"} and not github.check_runs


def test_a_check_run_waits_for_its_ack(hooked, github, agent):
    todo = deliver("pull_request", pull_request_opened())
    todo_transitions.claim_todo(agent, todo.pk)
    github.fail(503, times=1)  # the installation token mint fails: the ack waits
    now = timezone.now()
    send(now)
    assert rows(todo)["check"].attempts == 0 and not github.check_runs
    send(now + timedelta(seconds=10))
    order = [seen.operation for seen in github.seen if seen.status in (200, 201)
             and seen.operation.startswith(("reactions/", "checks/"))]
    assert order == ["reactions/create-for-issue", "checks/create"]


def test_a_worker_killed_mid_check_run_finds_it_by_its_external_id(hooked, github, agent):
    payload = pull_request_opened()
    todo = deliver("pull_request", payload)
    send()
    todo_transitions.claim_todo(agent, todo.pk)
    write_back.absorb_outbox_entries(now=timezone.now())
    now = timezone.now()
    status = write_back.claim_due_write_back(now=now)  # one send of a todo at a time
    assert status.action == "status" and write_back.send_write_back(status, now=now) == "sent"
    row = write_back.claim_due_write_back(now=now)
    assert row.action == "check"
    # The worker creates the check run and dies before recording it.
    github_sender.send_check_run(
        row.connection, row.target, status_text.status_update(
            Todo.objects.select_related("endpoint").get(pk=todo.pk), now=now),
        "", now, look_since=None)
    send(now + write_back.SEND_LEASE + timedelta(seconds=1))
    (run,) = github.check_runs.values()
    row.refresh_from_db()
    assert row.state == "sent" and row.external_id == str(run["answer"]["id"])
    assert row.attempts == 2 and len(github.requests_to("checks/create")) == 1
    (looked,) = github.requests_to("checks/list-for-ref")
    assert looked.path.endswith(f"/commits/{payload['pull_request']['head']['sha']}/check-runs")
    assert looked.query["check_name"] == "switchboard"
    assert looked.query["app_id"] == str(github.app_id)
    assert len(github.requests_to("checks/update")) == 1


# -- a rate limit holds the connection -----------------------------------------------------------


def test_a_rate_limit_holds_every_write_back_of_the_connection_until_it_lifts(hooked_by_token,
                                                                            github):
    base = issue_opened()
    todos = []
    for n in range(20):
        payload = issue_opened()
        payload["issue"]["number"] = base["issue"]["number"] + n
        todos.append(deliver("issues", payload))
    github.fail(429, headers={"Retry-After": "60"}, message="rate limited")
    before = len(github.seen)
    now = timezone.now()
    assert send(now) == 1  # the first send meets the limit; no other row is tried
    connection = WriteBack.objects.first().connection
    assert connection.held_until == now + timedelta(seconds=60)
    assert set(WriteBack.objects.values_list("next_attempt_at", flat=True)) == {
        now + timedelta(seconds=60)}
    # Within the minute nothing reaches GitHub: neither the held rows nor one made meanwhile
    # (due when the hold ends, as they are).
    late = issue_opened()
    late["issue"]["number"] = base["issue"]["number"] + 20
    deliver("issues", late)
    for seconds in (1, 30, 59):
        assert send(now + timedelta(seconds=seconds)) == 0
    assert len(github.seen) == before + 1 and github.seen[-1].status == 429
    listed = write_backs_listed("--webhook", "gh", "--limit", "1")
    assert listed[0]["held_until"] == (now + timedelta(seconds=60)).isoformat()
    assert listed[0]["next_attempt_at"] == (now + timedelta(seconds=60)).isoformat()
    # When it lifts, every one goes.
    assert send(now + timedelta(seconds=60)) == 21
    assert len(github.requests_to("reactions/create-for-issue")) == 22
    assert set(WriteBack.objects.values_list("state", flat=True)) == {"sent"}


def test_a_hold_only_moves_later_and_only_holds_its_connection(hooked_by_token, github, operator,
                                                               make_webhook):
    connection = hooked_by_token.connection
    other, _ = connections.create_connection(
        name="gh-other", owner=operator, kind="github_token", secret=github.token,
        api_url=github.api_url)
    connections.set_webhook_connection(make_webhook("github", slug="other"), other)
    now = timezone.now()
    assert write_back.hold_connection(connection.pk, until=now + timedelta(seconds=60))
    assert not write_back.hold_connection(connection.pk, until=now + timedelta(seconds=10))
    connection.refresh_from_db()
    assert connection.held_until == now + timedelta(seconds=60)
    deliver("issues", issue_opened())
    deliver("issues", issue_opened(), slug="other")
    assert send(now + timedelta(seconds=1)) == 1
    (sent,) = WriteBack.objects.filter(state="sent")
    assert sent.connection_id == other.pk
    (held,) = WriteBack.objects.filter(state="pending")
    assert held.next_attempt_at == now + timedelta(seconds=60)  # made during the hold


def test_the_claim_skips_a_row_due_before_its_connections_hold_was_set(hooked_by_token, github):
    deliver("issues", issue_opened())
    now = timezone.now()
    write_back.absorb_outbox_entries(now=now)
    # The hold lands after the row was taken in (another worker met the limit meanwhile):
    # the row is due, and only the claim's own check of the hold keeps it back.
    Connection.objects.filter(pk=hooked_by_token.connection_id).update(
        held_until=now + timedelta(seconds=30))
    requests_before = len(github.seen)
    assert write_back.claim_due_write_back(now=now + timedelta(seconds=1)) is None
    assert send(now + timedelta(seconds=29)) == 0 and len(github.seen) == requests_before
    assert send(now + timedelta(seconds=30)) == 1


# -- waking the worker after commit --------------------------------------------------------------


def test_a_commit_wakes_the_embedded_scheduler_or_enqueues_the_task(
        hooked, agent, settings, monkeypatch, django_capture_on_commit_callbacks):
    from ingest import tasks

    enqueued = []
    monkeypatch.setattr(tasks.send_write_backs, "apply_async",
                        lambda **kwargs: enqueued.append(kwargs))
    with django_capture_on_commit_callbacks(execute=True):
        todo = deliver("issues", issue_opened())
    wait_for(lambda: enqueued)  # enqueued off the committing thread
    assert enqueued == [{"retry": False}]
    settings.EMBEDDED = True
    schedule.wait_for_wake(write_back.SWEEP_NAME, 0)  # clear any earlier wake-up
    with django_capture_on_commit_callbacks(execute=True):
        todo_transitions.claim_todo(agent, todo.pk)
    assert schedule.wait_for_wake(write_back.SWEEP_NAME, 0)
    with django_capture_on_commit_callbacks(execute=True):
        todo_transitions.heartbeat_todo(agent, todo.pk)
    assert not schedule.wait_for_wake(write_back.SWEEP_NAME, 0)
    assert len(enqueued) == 1


def test_an_enqueue_never_holds_up_the_commit_and_failures_are_logged(monkeypatch, caplog):
    from kombu.exceptions import OperationalError

    from ingest import tasks

    release, calls = threading.Event(), []

    def hanging_broker(**kwargs):
        calls.append(kwargs)
        release.wait(10)
        raise OperationalError("Redis is down")

    monkeypatch.setattr(tasks.send_write_backs, "apply_async", hanging_broker)
    write_back.dispatch_send()  # returns at once although the broker hangs
    wait_for(lambda: calls)
    write_back.dispatch_send()
    write_back.dispatch_send()  # both collapse into one more enqueue
    release.set()
    wait_for(lambda: "could not enqueue" in caplog.text and len(calls) == 2)


def test_todos_without_write_back_wake_nothing(agent, make_todo, settings, monkeypatch,
                                               django_capture_on_commit_callbacks):
    woken = []
    monkeypatch.setattr(write_back, "dispatch_send", lambda: woken.append(1))
    with django_capture_on_commit_callbacks(execute=True):
        todo = make_todo()
        todo_transitions.claim_todo(agent, todo.pk)
    assert woken == [] and not OutboxEntry.objects.exists()


# -- the living status's text --------------------------------------------------------------------


def test_the_status_escapes_neutralises_mentions_caps_and_shows_no_payload(hooked, agent,
                                                                             github):
    payload = issue_opened()
    payload["issue"]["body"] = "secret-in-payload-0123"
    todo = deliver("issues", payload)
    todo_transitions.claim_todo(agent, todo.pk)
    todo_transitions.complete_todo(agent, todo.pk, result={
        "summary": "@octocat look: <img src=x onerror=alert(1)> **bold** [x](javascript:1)"
                   + "y" * 5000,
        "url": "javascript:alert(1)"})
    body = status_text.render_status(Todo.objects.select_related("endpoint").get(pk=todo.pk),
                                    now=timezone.now())
    assert "@\u200bocto" in body and "@octocat" not in body
    assert "<img" not in body and "&lt;img" in body
    assert "\\*\\*bold\\*\\*" in body and "\\[x\\]\\(javascript" in body
    assert "javascript:alert" not in body.replace("\\(javascript:1", "")
    assert len(body) <= status_text.MAX_STATUS_CHARS
    assert "secret-in-payload-0123" not in body and payload["issue"]["title"] not in body


@pytest.mark.parametrize("url, shown", [
    ("https://github.com/o/r/pull/9", True), ("http://github.com/o/r/pull/9", False),
    ("https://exa mple.com", False), ("https://x.example/<script>", False), (42, False),
    ("https://user:pw@x.example/", False),
])
def test_only_a_plain_https_result_url_is_linked(url, shown):
    assert bool(status_text.safe_result_url(url)) is shown


# -- the loop guard ------------------------------------------------------------------------------


def apps_own_comment(github) -> dict:
    """GitHub's example ``issue_comment.created``, as GitHub sends it for a comment the App
    wrote through an installation token: its author and the delivery's sender are the App's bot
    user, and the comment names the App in ``performed_via_github_app``."""
    payload = webhook_example("issue_comment", action="created")
    bot = {**payload["sender"], "login": f"{github.app_slug}[bot]", "id": 98765, "type": "Bot",
           "html_url": f"https://github.com/apps/{github.app_slug}"}
    payload["sender"] = dict(bot)
    payload["comment"]["user"] = dict(bot)
    payload["comment"]["performed_via_github_app"] = app_object(github)
    payload["comment"]["body"] = "<!-- switchboard:todo:1 -->\n**📥 Queued**"
    payload["installation"] = {"id": INSTALLATION, "node_id": "MDIzOkludGVncmF0aW9u"}
    # What was put in is what GitHub's description says the payload carries there (the
    # examples themselves predate some fields the schema now requires, so only these).
    payload_schema = "components/schemas/webhook-issue-comment-created/properties"
    assert schema_problems(f"{payload_schema}/sender", payload["sender"]) == []
    assert schema_problems(f"{payload_schema}/comment/properties/performed_via_github_app",
                           payload["comment"]["performed_via_github_app"]) == []
    assert schema_problems(f"{payload_schema}/comment/properties/user",
                           payload["comment"]["user"]) == []
    return payload


def test_the_apps_own_comment_makes_no_todo(hooked, github):
    answer_payload = apps_own_comment(github)
    assert deliver("issue_comment", answer_payload) is None
    (record,) = DeliveryRecord.objects.filter(webhook=hooked)
    assert record.outcome == "filtered" and record.reason == "own_write_back"
    assert not Todo.objects.exists()
    # manage.py deliveries says why, as the console does (docs/commands.md#deliveries).
    out = StringIO()
    call_command("deliveries", hooked.slug, "--json", stdout=out)
    assert [row["reason"] for row in json.loads(out.getvalue())["deliveries"]] == [
        "own_write_back"]
    out = StringIO()
    call_command("deliveries", hooked.slug, stdout=out)
    assert "filtered" in out.getvalue() and "reason: own_write_back" in out.getvalue()
    # A person's comment on the same issue is work as ever.
    assert deliver("issue_comment", webhook_example("issue_comment", action="created"))


def test_a_comment_through_the_app_by_another_login_is_still_the_apps(hooked, github):
    payload = apps_own_comment(github)
    payload["sender"]["login"] = "someone-else"  # e.g. a user-to-server token of the App
    assert deliver("issue_comment", payload) is None


def test_the_token_users_own_delivery_makes_no_todo(hooked_by_token, github):
    payload = webhook_example("issue_comment", action="created")
    payload["sender"]["login"] = github.user_login
    assert deliver("issue_comment", payload) is None
    (record,) = DeliveryRecord.objects.all()
    assert record.reason == "own_write_back"


def test_a_webhook_without_a_connection_guards_nothing(make_webhook, endpoint, github):
    make_webhook("github", slug="plain")
    payload = apps_own_comment(github)
    assert deliver("issue_comment", payload, slug="plain") is not None


# -- post_update ---------------------------------------------------------------------------------


def test_post_update_edits_the_status_at_most_every_10_s_latest_wins(hooked_by_token, github,
                                                                     agent):
    todo = deliver("issues", issue_opened())
    todo_transitions.claim_todo(agent, todo.pk)
    start = timezone.now()
    send(start)
    (comment,) = github.status_comments()
    todo_transitions.post_update_todo(agent, todo.pk, text="reading the code")
    send(start + timedelta(seconds=1))  # within 10 s of the last edit: it waits
    assert not github.requests_to("issues/update-comment")
    todo_transitions.post_update_todo(agent, todo.pk, text="found it: an off-by-one @octocat")
    send(start + timedelta(seconds=5))
    assert not github.requests_to("issues/update-comment")
    send(start + timedelta(seconds=11))
    (edited,) = github.requests_to("issues/update-comment")
    assert "found it: an off\\-by\\-one @\u200boctocat" in edited.body["body"]
    assert "reading the code" not in edited.body["body"]
    # A transition is written at once, progress or not.
    todo_transitions.complete_todo(agent, todo.pk, result={"summary": "fixed"})
    send(start + timedelta(seconds=12))
    assert len(github.requests_to("issues/update-comment")) == 2
    assert "Latest from the agent" not in github.status_comments()[0]["body"]


def write_backs_listed(*args) -> list[dict]:
    out = StringIO()
    call_command("write_backs", *args, "--json", stdout=out)
    return json.loads(out.getvalue())["write_backs"]


def test_the_write_backs_command_lists_them(hooked_by_token, github, agent):
    todo = deliver("issues", issue_opened())
    todo_transitions.claim_todo(agent, todo.pk)
    github.fail(422, message="Validation Failed", times=1)
    send()
    out = StringIO()
    call_command("write_backs", "--webhook", "gh", "--json", stdout=out)
    listed = json.loads(out.getvalue())["write_backs"]
    # The ack GitHub refused does not hold the status back.
    assert [(row["action"], row["state"]) for row in listed] == [("status", "sent"),
                                                                 ("ack", "failed")]
    assert listed[1]["last_error"] == "422: Validation Failed"
    assert listed[1]["connection"] == "gh-token" and listed[1]["todo"] == str(todo.pk)
    assert set(listed[0]) == {"id", "todo", "connection", "action", "target", "url", "state",
                              "retrying", "attempts", "last_error", "external_id", "sent_at",
                              "next_attempt_at", "held_until"}
    assert listed[0]["url"].endswith(f"/issues/{todo.payload['issue']['number']}")
    out = StringIO()
    call_command("write_backs", "--todo", str(todo.pk), "--state", "failed", "--json", stdout=out)
    assert len(json.loads(out.getvalue())["write_backs"]) == 1


def test_the_write_backs_command_says_retrying_as_the_console_does(hooked_by_token, github,
                                                                   client, operator):
    todo = deliver("issues", issue_opened())
    github.fail(503, times=None)
    send()
    (ack,) = write_backs_listed("--state", "retrying")
    assert ack["action"] == "ack" and ack["state"] == "pending" and ack["retrying"] is True
    assert write_backs_listed("--state", "failed") == []
    out = StringIO()
    call_command("write_backs", "--todo", str(todo.pk), stdout=out)
    assert " retrying " in out.getvalue() and " pending " not in out.getvalue()
    client.force_login(operator)
    page = client.get(f"/todos/{todo.pk}/").content.decode()
    assert ">retrying</span>" in page
    # A retry under way is still retrying; a send that succeeds ends it.
    WriteBack.objects.filter(pk=ack["id"]).update(state="sending")
    assert [row["id"] for row in write_backs_listed("--state", "retrying")] == [ack["id"]]
    WriteBack.objects.filter(pk=ack["id"]).update(state="pending", next_attempt_at=timezone.now())
    github.recover()
    send()
    assert write_backs_listed("--state", "retrying") == []


def test_a_sent_write_back_moves_the_connections_last_success_at_most_once_a_minute(
        hooked_by_token, github):
    from django.db import connection as db
    from django.test.utils import CaptureQueriesContext

    connection = Connection.objects.get(name="gh-token")
    start = timezone.now()
    Connection.objects.filter(pk=connection.pk).update(
        last_success_at=start - timedelta(minutes=5))

    def deliver_issue(number):
        payload = issue_opened()
        payload["issue"]["number"] = number
        return deliver("issues", payload)

    def last_success():
        return Connection.objects.get(pk=connection.pk).last_success_at

    deliver_issue(101)
    assert send(start) >= 1
    assert last_success() == start
    # Sends within the minute after it write nothing to the connection.
    deliver_issue(102)
    with CaptureQueriesContext(db) as queries:
        assert send(start + timedelta(seconds=30)) >= 1
    assert not [q["sql"] for q in queries.captured_queries
                if q["sql"].startswith(f'UPDATE "{Connection._meta.db_table}"')]
    assert any(q["sql"].startswith('UPDATE "ingest_writeback"') for q in queries.captured_queries)
    assert last_success() == start
    deliver_issue(103)
    send(start + timedelta(seconds=61))
    assert last_success() == start + timedelta(seconds=61)
    # A failed send moves nothing; the page shows the time a send last succeeded.
    github.fail(503, times=None)
    deliver_issue(104)
    send(start + timedelta(minutes=3))
    assert last_success() == start + timedelta(seconds=61)


def test_the_retention_prune_takes_the_write_backs_of_the_todos_it_takes(hooked_by_token, github,
                                                                          agent, settings):
    from ingest import sweeps

    payloads = [issue_opened(), issue_opened()]
    payloads[1]["issue"]["number"] += 1
    old, young = (deliver("issues", payload) for payload in payloads)
    for todo in (old, young):
        todo_transitions.claim_todo(agent, todo.pk)
        todo_transitions.complete_todo(agent, todo.pk)
    send()
    later = timezone.now() + settings.SWITCHBOARD_RETAIN_DONE + timedelta(days=1)
    Todo.objects.filter(pk=young.pk).update(updated_at=later)  # still within retention then
    would = sweeps.prune_history(now=later, dry_run=True)
    assert would["write_backs"] == 2
    assert sweeps.prune_history(now=later)["write_backs"] == 2
    assert set(WriteBack.objects.values_list("todo_id", flat=True)) == {young.pk}


@pytest.mark.parametrize("api_url, target, url", [
    ("https://api.github.com", {"owner": "octo", "repo": "hello", "number": "12"},
     "https://github.com/octo/hello/issues/12"),
    ("https://ghe.example/api/v3", {"owner": "octo", "repo": "hello", "number": "3",
                                    "comment": "77", "comment_path": "issues/comments"},
     "https://ghe.example/octo/hello/issues/3#issuecomment-77"),
    ("https://api.github.com", {"owner": "octo", "repo": "hello", "number": "4",
                                "comment": "9", "comment_path": "pulls/comments"},
     "https://github.com/octo/hello/issues/4#discussion_r9"),
    ("https://api.github.com", {"owner": "../evil", "repo": "hello", "number": "4"}, ""),
])
def test_a_targets_page_is_built_from_the_api_url_and_checked_segments(api_url, target, url):
    connection = Connection(kind="github_token", api_url=api_url)
    assert github_sender.target_url(connection, target) == url


def test_operators_decisions_show_in_the_living_status_with_who_and_why(hooked, github, endpoint):
    Route.objects.filter(webhook=hooked).update(requires_approval=True)
    operator = todo_transitions.Caller.operator(endpoint, "alice")
    approved = deliver("issues", issue_opened())
    send()
    todo_transitions.approve_todo(operator, approved.pk)
    todo_transitions.set_priority_todo(operator, approved.pk, 5)
    send()
    (comment,) = github.status_comments()
    assert "Queued (approved by alice)" in comment["body"] and "priority 5" in comment["body"]

    payload = issue_opened()
    payload["issue"]["number"] += 1
    cancelled = deliver("issues", payload)
    send()
    todo_transitions.approve_todo(operator, cancelled.pk)
    send()
    todo_transitions.cancel_todo(operator, cancelled.pk, reason="a duplicate of @bob's #7")
    send()
    body = next(c["body"] for c in github.status_comments() if f"todo:{cancelled.pk} " in c["body"])
    assert "Cancelled by alice" in body
    assert "Reason: a duplicate of @\u200bbob's \\#7" in body
    assert len(github.status_comments()) == 2  # one each, edited in place


def test_a_rejection_and_an_approval_timeout_say_so(hooked, github, endpoint):
    Route.objects.filter(webhook=hooked).update(requires_approval=True)
    operator = todo_transitions.Caller.operator(endpoint, "alice")
    rejected = deliver("issues", issue_opened())
    todo_transitions.reject_todo(operator, rejected.pk, reason="not ours")
    send()
    (comment,) = github.status_comments()
    assert "Cancelled (rejected by alice)" in comment["body"] and "Reason: not ours" in comment["body"]
    payload = issue_opened()
    payload["issue"]["number"] += 1
    lapsed = deliver("issues", payload)
    Endpoint.objects.filter(pk=endpoint.pk).update(approval_timeout_seconds=60)
    todo_transitions.cancel_stale_approvals(now=timezone.now() + timedelta(minutes=2), limit=10)
    send()
    body = next(c["body"] for c in github.status_comments() if f"todo:{lapsed.pk} " in c["body"])
    assert "Cancelled by switchboard: nobody approved it in time" in body
    assert "Reason" not in body
