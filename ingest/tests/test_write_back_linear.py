"""Linear write-back (docs/write-back.md#linear): agent sessions get a thought, then an activity
per transition; issues and comments get 👀 and one comment edited in place. Every request goes
to a stand-in that validates it against Linear's schema as @linear/sdk ships it
(ingest/tests/linear_standin.py); every delivery's payload is checked against the same schema's
webhook payload types. The worker is driven by hand, as in test_write_back.py, except where the
embedded scheduler's own loop is measured."""

import asyncio
import threading
import time
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from ingest import connections, status_text, write_back
from ingest.models import Connection, DeliveryRecord, WriteBack
from ingest.senders import linear as linear_sender
from ingest.tests import hook_client, signing
from ingest.tests.conftest import SECRETS
from ingest.tests.github_standin import wait_for
from ingest.tests.linear_standin import API_KEY, OAUTH_TOKEN, payload_problems, reset_in
from ingest.tests.test_write_back import (  # noqa: F401 (public_url: a fixture)
    end_todo, post_status_then_die, public_url, rows, send)
from switchboard import schedule
from todos import transitions as todo_transitions
from todos.models import Todo

pytestmark = pytest.mark.django_db
ORGANIZATION = "c0ffee00-0000-4000-8000-000000000001"
PERSON = {"id": "d00d0000-0000-4000-8000-000000000002", "name": "Ada", "email": "ada@example.com",
          "url": "https://linear.app/acme/profiles/ada"}


def make_connection(operator, linear, token=OAUTH_TOKEN, name="lin-app") -> Connection:
    connection, test = connections.create_connection(
        name=name, owner=operator, kind="linear", secret=token, api_url=linear.api_url)
    assert test.ok, test.error
    return connection


@pytest.fixture
def hooked(operator, endpoint, linear, make_webhook):
    """A Linear webhook writing back under an app's OAuth token, one route to ``endpoint``."""
    webhook = make_webhook("linear", slug="lin")
    connections.set_webhook_connection(webhook, make_connection(operator, linear))
    return webhook


def deliver(payload: dict, *, slug="lin") -> Todo | None:
    body = signing.linear_body(payload)
    answer = hook_client.post(slug, body, **signing.linear(SECRETS["linear"], body,
                                                           event=payload["type"]))
    assert answer.status_code == 202, answer.content
    todos = answer.json()["todos"]
    return Todo.objects.get(pk=todos[0]["id"]) if todos else None


# -- payloads in the shapes Linear sends, checked against its schema ----------------------------


def _now_text() -> str:
    return timezone.now().isoformat().replace("+00:00", "Z")


def _issue_child(linear, issue_id) -> dict:
    identifier = linear.issues[issue_id]["identifier"]
    team = {"id": str(uuid.uuid4()), "key": identifier.split("-")[0], "name": "Engineering"}
    return {"id": issue_id, "identifier": identifier, "title": "The export crashes",
            "team": team, "teamId": team["id"],
            "url": f"https://linear.app/acme/issue/{identifier}/the-export-crashes"}


def _user_of(user_id) -> dict:
    return {**PERSON, "id": user_id}


def session_event(linear, *, action="created", prompt_by=None) -> dict:
    """An ``AgentSessionEvent`` as Linear sends an app when someone delegates an issue to it
    (``created``) or prompts it again (``prompted``, with the prompt's activity by
    ``prompt_by``, a person unless given)."""
    issue_id = linear.add_issue()
    session_id = linear.add_session(issue_id)
    now = _now_text()
    session = {"id": session_id, "appUserId": linear.viewer_id, "organizationId": ORGANIZATION,
               "status": "pending", "type": "commentThread", "createdAt": now, "updatedAt": now,
               "creatorId": PERSON["id"], "creator": PERSON, "issueId": issue_id,
               "issue": {**_issue_child(linear, issue_id), "description": "Steps: …"}}
    payload = {"type": "AgentSessionEvent", "action": action, "agentSession": session,
               "appUserId": linear.viewer_id, "oauthClientId": str(uuid.uuid4()),
               "organizationId": ORGANIZATION, "webhookId": str(uuid.uuid4()),
               "createdAt": now, "promptContext": "<issue identifier=\"ENG-42\"/>"}
    if action == "prompted":
        author = prompt_by or PERSON["id"]
        payload["agentActivity"] = {
            "id": str(uuid.uuid4()), "agentSessionId": session_id, "createdAt": now,
            "updatedAt": now, "userId": author, "user": _user_of(author),
            "content": {"type": "prompt", "body": "Also check the CSV export"}}
    assert payload_problems("AgentSessionEventWebhookPayload",
                            {**payload, "webhookTimestamp": 0}) == []
    return payload


def entity_event(linear, kind: str, *, actor_id=None, action="create") -> dict:
    """An ``Issue`` or ``Comment`` delivery of a workspace webhook, its ``actor`` a person
    unless given."""
    issue_id = linear.add_issue()
    now = _now_text()
    issue = _issue_child(linear, issue_id)
    if kind == "Issue":
        state = {"id": str(uuid.uuid4()), "name": "Todo", "color": "#e2e2e2", "type": "unstarted"}
        data = {**{k: issue[k] for k in ("id", "identifier", "title", "teamId", "url")},
                "team": issue["team"], "createdAt": now, "updatedAt": now, "number": 42,
                "labelIds": [], "labels": [], "previousIdentifiers": [], "priority": 0,
                "priorityLabel": "No priority", "prioritySortOrder": 0, "sortOrder": 0,
                "reactionData": {}, "releases": [], "state": state, "stateId": state["id"],
                "subscriberIds": [], "description": "It crashes."}
    else:
        author = actor_id or PERSON["id"]
        data = {"id": str(uuid.uuid4()), "body": "@switchboard please look", "createdAt": now,
                "updatedAt": now, "reactionData": {}, "issueId": issue_id, "issue": issue,
                "userId": author, "user": _user_of(author)}
        linear.comments[data["id"]] = {"issueId": issue_id, "body": data["body"],
                                       "userId": author}
    actor_id = actor_id or PERSON["id"]
    payload = {"type": kind, "action": action, "data": data,
               "actor": {**_user_of(actor_id), "type": "user"},
               "organizationId": ORGANIZATION, "webhookId": str(uuid.uuid4()), "createdAt": now,
               "url": issue["url"]}
    assert payload_problems("EntityWebhookPayload", {**payload, "data": {},
                                                     "webhookTimestamp": 0}) == []
    assert payload_problems(f"{kind}WebhookPayload", data) == []
    assert payload_problems("UserActorWebhookPayload", payload["actor"]) == []
    return payload


def session_of(todo) -> str:
    return todo.payload["agentSession"]["id"]


def contents(linear, todo) -> list[dict]:
    return [activity["content"] for activity in linear.activities_of(session_of(todo))]


# -- agent sessions ----------------------------------------------------------------------------


def test_an_agent_session_gets_a_thought_with_the_todos_page(hooked, linear):
    todo = deliver(session_event(linear))
    assert todo.write_back == "status"
    assert send() == 1
    (thought,) = contents(linear, todo)
    assert thought["type"] == "thought"
    assert f"https://sb.example/todos/{todo.pk}/" in thought["body"]
    (seen,) = linear.requests_to("agentActivityCreate")
    assert seen.headers["authorization"] == f"Bearer {OAUTH_TOKEN}"
    ack = rows(todo)["ack"]
    assert ack.state == "sent" and ack.external_id == seen.body["variables"]["input"]["id"]
    assert ack.target_label == "ENG-42 agent session"
    # A person's prompt in the same session is a todo of its own, with a thought of its own.
    deliver(session_event(linear, action="prompted"))
    send()
    assert len(linear.requests_to("agentActivityCreate")) == 2


def test_claim_appends_an_action_and_done_a_response_with_summary_and_url(hooked, linear,
                                                                          agent):
    todo = deliver(session_event(linear))
    send()
    todo_transitions.claim_todo(agent, todo.pk)
    send()
    todo_transitions.complete_todo(agent, todo.pk, result={
        "summary": "Fixed the crash; see the PR.", "url": "https://github.com/o/r/pull/9"})
    send()
    thought, action, response = contents(linear, todo)
    assert action["type"] == "action" and action["parameter"] == f"switchboard todo {todo.pk}"
    assert "Being worked on" in action["result"] and "`agent`" in action["result"]
    assert response["type"] == "response"
    assert "Fixed the crash; see the PR\\." in response["body"]
    assert "<https://github.com/o/r/pull/9>" in response["body"]
    assert len(response["body"]) <= 2000
    status = rows(todo)["status"]
    assert status.state == "sent" and status.external_id in linear.activities
    assert not linear.comments  # a session writes activities, never a comment


def test_progress_lines_are_ephemeral_thoughts_and_a_new_claim_an_action(hooked, linear,
                                                                         agent):
    todo = deliver(session_event(linear))
    todo_transitions.claim_todo(agent, todo.pk)
    start = timezone.now()
    send(start)
    for second, line in ((11, "reading the code"), (22, "found it: an off-by-one")):
        todo_transitions.post_update_todo(agent, todo.pk, text=line)
        send(start + timedelta(seconds=second))
    todo_transitions.fail_todo(agent, todo.pk, error="flaky")
    todo_transitions.requeue_todo(todo_transitions.Caller.operator(todo.endpoint, "alice"),
                                  todo.pk)
    send(start + timedelta(seconds=23))
    todo_transitions.claim_todo(agent, todo.pk)
    send(start + timedelta(seconds=24))
    trail = linear.activities_of(session_of(todo))
    assert [(a["content"]["type"], a["ephemeral"]) for a in trail] == [
        ("thought", False), ("action", False), ("thought", True), ("thought", True),
        ("thought", False), ("action", False)]
    assert "found it: an off\\-by\\-one" in trail[3]["content"]["body"]
    assert "Queued" in trail[4]["content"]["body"]  # the operator requeued it


@pytest.mark.parametrize("ending", ["retrying", "dead letter", "cancelled"])
def test_a_failure_dead_letter_or_cancel_appends_an_error(hooked, linear, agent, ending):
    todo = deliver(session_event(linear))
    todo_transitions.claim_todo(agent, todo.pk)
    send()
    end_todo(todo, agent, ending)
    send()
    last = contents(linear, todo)[-1]
    assert last["type"] == "error"
    headline = {"retrying": "Failed; retrying", "dead letter": "Failed for good",
                "cancelled": "Cancelled"}[ending]
    assert headline in last["body"]


def test_no_activity_is_appended_twice_after_a_worker_died_mid_send(hooked, linear, agent):
    todo = deliver(session_event(linear))
    row, now, first_id = post_status_then_die(todo, agent, linear_sender.send_status)
    send(now + write_back.SEND_LEASE + timedelta(seconds=1))
    assert [c["type"] for c in contents(linear, todo)] == ["thought", "action"]
    row.refresh_from_db()
    assert row.state == "sent" and row.external_id == first_id and row.attempts == 2
    (looked,) = linear.requests_to("agentActivity")  # looked for before appending
    assert looked.body["variables"] == {"id": first_id}
    # The next transition is a new activity, and the same after a repeat without the look.
    todo_transitions.complete_todo(agent, todo.pk, result={"summary": "ok"})
    send()
    row.refresh_from_db()
    again = status_text.status_update(Todo.objects.select_related("endpoint").get(pk=todo.pk),
                                      now=now, max_chars=2000)
    repeat = linear_sender.send_status(row.connection, row.target, again, first_id, now, None)
    assert repeat == row.external_id
    assert [c["type"] for c in contents(linear, todo)] == ["thought", "action", "response"]


# -- plain issues and comments --------------------------------------------------------------------


def test_a_plain_issue_gets_eyes_and_one_comment_edited_in_place(hooked, linear, agent):
    payload = entity_event(linear, "Issue")
    todo = deliver(payload)
    send()
    (reaction,) = linear.reactions
    assert reaction["emoji"] == "eyes" and reaction["subject"] == payload["data"]["id"]
    todo_transitions.claim_todo(agent, todo.pk)
    send()
    todo_transitions.post_update_todo(agent, todo.pk, text="found it")
    todo_transitions.complete_todo(agent, todo.pk, result={"summary": "Fixed."})
    send()
    (comment,) = linear.comments_on(payload["data"]["id"])
    assert "Done" in comment["body"] and "Fixed\\." in comment["body"]
    assert len(linear.requests_to("commentCreate")) == 1
    assert len(linear.requests_to("commentUpdate")) == 1
    status = rows(todo)["status"]
    assert status.state == "sent" and linear.comments[status.external_id] is comment
    assert status.target_label == "ENG-42"


def test_a_comment_gets_eyes_on_the_comment_and_a_deleted_status_is_posted_again(hooked, linear,
                                                                                agent):
    payload = entity_event(linear, "Comment")
    todo = deliver(payload)
    todo_transitions.claim_todo(agent, todo.pk)
    send()
    assert linear.reactions[0]["subject"] == payload["data"]["id"]
    issue_id = payload["data"]["issueId"]
    (first,) = linear.comments_on(issue_id)[1:]  # beside the person's own comment
    del linear.comments[rows(todo)["status"].external_id]
    todo_transitions.complete_todo(agent, todo.pk, result={"summary": "ok"})
    send()
    (again,) = linear.comments_on(issue_id)[1:]
    assert "Done" in again["body"] and again is not first
    assert rows(todo)["status"].external_id in linear.comments


def test_a_status_comment_a_dead_worker_posted_is_found_not_posted_twice(hooked, linear, agent):
    payload = entity_event(linear, "Issue")
    todo = deliver(payload)
    row, now, _ = post_status_then_die(todo, agent, linear_sender.send_status)
    send(now + write_back.SEND_LEASE + timedelta(seconds=1))
    (comment,) = linear.comments_on(payload["data"]["id"])
    assert "Being worked on" in comment["body"]
    assert len(linear.requests_to("comment")) == 1  # the look, then the edit
    assert len(linear.requests_to("commentUpdate")) == 1


# -- failures -------------------------------------------------------------------------------------


def test_linear_down_for_minutes_delays_nothing_and_everything_arrives_once(hooked, linear,
                                                                           agent):
    linear.fail(503, times=None)
    todo = deliver(session_event(linear))
    issue_todo = deliver(entity_event(linear, "Issue"))
    asked = len(linear.seen)
    for each in (todo, issue_todo):
        todo_transitions.claim_todo(agent, each.pk)
        todo_transitions.complete_todo(agent, each.pk, result={"summary": "ok"})
    assert len(linear.seen) == asked  # transitions never call Linear
    now = timezone.now()
    for minutes in range(0, 5):
        send(now + timedelta(minutes=minutes))
    assert {row.state for row in WriteBack.objects.all()} == {"pending"}
    assert "503" in WriteBack.objects.filter(action="ack").first().last_error
    linear.recover()
    send(now + timedelta(minutes=20))
    send(now + timedelta(minutes=21))
    assert {row.state for row in WriteBack.objects.all()} == {"sent"}
    # The session's claim and completion collapsed into the one send after the outage.
    assert [c["type"] for c in contents(linear, todo)] == ["thought", "response"]
    (comment,) = linear.comments_on(issue_todo.payload["data"]["id"])
    assert "Done" in comment["body"] and len(linear.reactions) == 1


@pytest.mark.parametrize("status", [400, 429])
def test_a_rate_limit_waits_until_linears_window_resets(hooked, linear, status):
    deliver(session_event(linear))
    linear.fail(status, code="RATELIMITED", message="Rate limit exceeded",
                headers={"x-ratelimit-requests-remaining": "0",
                         "x-ratelimit-requests-reset": reset_in(90)})
    now = timezone.now()
    send(now)
    (ack,) = WriteBack.objects.all()
    assert ack.state == "pending" and ack.last_error == "RATELIMITED: Rate limit exceeded"
    assert timedelta(seconds=85) < ack.next_attempt_at - now < timedelta(seconds=95)
    assert send(now + timedelta(seconds=30)) == 0
    assert send(ack.next_attempt_at) == 1
    ack.refresh_from_db()
    assert ack.state == "sent" and len(linear.activities) == 1


def test_an_authentication_error_is_the_connections_last_error(hooked, linear):
    deliver(entity_event(linear, "Issue"))
    linear.fail(400, code="AUTHENTICATION_ERROR", message="Authentication required")
    send()
    (ack,) = WriteBack.objects.all()
    assert ack.state == "failed"
    hooked.connection.refresh_from_db()
    assert hooked.connection.last_error == "AUTHENTICATION_ERROR: Authentication required"


def test_another_refusal_fails_with_linears_message(hooked, linear):
    deliver(entity_event(linear, "Issue"))
    linear.fail(400, code="INVALID_INPUT", message="Argument Validation Error")
    send()
    (ack,) = WriteBack.objects.all()
    assert ack.state == "failed" and ack.last_error == "INVALID_INPUT: Argument Validation Error"


@pytest.mark.parametrize("token, header", [(API_KEY, API_KEY),
                                           (OAUTH_TOKEN, f"Bearer {OAUTH_TOKEN}")])
def test_an_api_key_goes_bare_and_an_oauth_token_as_bearer(operator, linear, token, header):
    connection = make_connection(operator, linear, token=token)
    assert (connection.identity, connection.identity_id) == (linear.viewer_name, linear.viewer_id)
    (asked,) = linear.seen
    assert asked.headers["authorization"] == header and asked.operation == "viewer"


# -- the loop guard -------------------------------------------------------------------------------


@pytest.mark.parametrize("named_as", ["actor", "author under its OAuth client"])
def test_the_apps_own_comment_makes_no_todo(hooked, linear, named_as):
    payload = entity_event(linear, "Comment", actor_id=linear.viewer_id)
    if named_as != "actor":
        payload["actor"] = {"id": str(uuid.uuid4()), "name": "switchboard",
                            "type": "oauthClient"}
        assert payload_problems("OauthClientActorWebhookPayload", payload["actor"]) == []
    assert deliver(payload) is None
    (record,) = DeliveryRecord.objects.filter(webhook=hooked)
    assert record.outcome == "filtered" and record.reason == "own_write_back"
    assert deliver(entity_event(linear, "Comment")) is not None  # a person's is work


def test_a_persons_change_to_an_issue_is_work(hooked, linear):
    payload = entity_event(linear, "Issue", action="update")
    payload["data"]["creatorId"] = linear.viewer_id  # even on an issue the app opened
    assert deliver(payload) is not None


def test_a_session_prompted_by_the_apps_own_activity_makes_no_todo(hooked, linear):
    assert deliver(session_event(linear, action="prompted", prompt_by=linear.viewer_id)) is None
    assert DeliveryRecord.objects.get().reason == "own_write_back"
    assert deliver(session_event(linear, action="prompted")) is not None


# -- what is written back on, and its page --------------------------------------------------------


@pytest.mark.parametrize("kind, change", [
    ("Issue.remove", {}),  # nothing left to write on
    ("Comment.create", {"issueId": None}),  # a comment on a project update, not an issue
    ("Comment.create", {"issueId": "../../graphql"}),  # not a Linear id
    ("Project.create", {}),
])
def test_what_has_nothing_to_write_back_on_gets_nothing(linear, kind, change):
    kind_type, _, action = kind.partition(".")
    payload = entity_event(linear, "Comment" if kind_type == "Project" else kind_type)
    payload["data"].update(change)
    assert linear_sender.find_target(kind, payload) is None
    assert linear_sender.find_target("AgentSessionEvent.created", {"agentSession": {
        "id": "not-an-id"}}) is None



@pytest.mark.parametrize("issue, url", [
    ({"identifier": "ENG-42", "team": {"key": "ENG"},
      "url": "https://linear.app/acme/issue/ENG-42/the-export"},
     "https://linear.app/acme/issue/ENG-42"),
    ({"identifier": "ENG-42", "team": {"key": "OPS"},
      "url": "https://linear.app/acme/issue/ENG-42/x"}, ""),
    ({"identifier": "ENG-42", "url": "https://evil.example/acme/issue/ENG-42/x"}, ""),
    ({"identifier": "ENG-42\" onclick", "url": "https://linear.app/acme/issue/ENG-42/x"}, ""),
    ({"identifier": "ENG-42", "url": "https://linear.app/../issue/ENG-42/x"}, ""),
])
def test_a_targets_page_is_built_on_linear_app_from_checked_parts(issue, url):
    target = {"issue": str(uuid.uuid4()), "comment": "", **linear_sender._issue_page(issue)}
    assert linear_sender.target_url(Connection(kind="linear"), target) == url


# -- how soon the thought follows the 202, on the embedded default ------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_thought_follows_the_202_within_linears_10_s_on_the_embedded_default(
        operator, endpoint, linear, make_webhook, settings, capsys):
    """The embedded scheduler's own loop (switchboard/scheduler.run_every, woken after the
    delivery's commit) sends the thought: how long after the 202 it reaches Linear."""
    from switchboard import scheduler

    settings.EMBEDDED = True
    webhook = make_webhook("linear", slug="lin")
    connections.set_webhook_connection(webhook, make_connection(operator, linear))
    entry = next(e for e in schedule.SWEEPS if e.name == write_back.SWEEP_NAME)
    loop = asyncio.new_event_loop()
    task = loop.create_task(scheduler.run_every(write_back.send_due_write_backs,
                                                entry.every.total_seconds(), entry))

    def run():
        try:
            loop.run_until_complete(task)
        except asyncio.CancelledError:
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        delays = []
        for _ in range(5):
            before = len(linear.requests_to("agentActivityCreate"))
            deliver(session_event(linear))
            answered = time.monotonic()
            wait_for(lambda: len(linear.requests_to("agentActivityCreate")) > before,
                     timeout=10, interval=0.005)
            delays.append(time.monotonic() - answered)
    finally:
        loop.call_soon_threadsafe(task.cancel)
        thread.join(10)
    assert max(delays) < 5  # the promise; Linear marks the agent unresponsive after 10 s
    with capsys.disabled():
        print(f"\n202 -> thought, embedded default: max {max(delays) * 1000:.0f} ms, "
              f"median {sorted(delays)[2] * 1000:.0f} ms over {len(delays)}")
