"""What the source hears of threads (docs/write-back.md#threads): a follow-up folded into a live
todo gets the ack's reaction on its own object (the comment, note, message or prompt it came
from), and the living status says how many were folded in, that a cancel was requested, and
that the source stopped the work. Against the stand-ins, the worker driven by hand."""

import copy

import pytest
from django.utils import timezone

from ingest import connections, status_text
from ingest.models import WriteBack
from ingest.tests import test_write_back as gh
from ingest.tests import test_write_back_linear as ln
from ingest.tests import test_write_back_slack as sl
from ingest.tests.test_write_back_forges import forge  # noqa: F401 — a fixture
from ingest.tests.github_standin import webhook_example
from todos import transitions as todo_transitions
from todos.models import OutboxEntry, Todo, Trust

pytestmark = pytest.mark.django_db
public_url = gh.public_url  # an autouse fixture


def fold_followup(todo, kind: str, payload: dict) -> Todo:
    """A follow-up as ingest folds it in (``add_followup``: its row, the todo's count and the
    outbox entry of a todo that writes back, in one statement)."""
    assert todo_transitions.add_followup(
        todo.pk, delivery_event=None, kind=kind, title="a follow-up", actor="reviewer",
        trust=Trust.SIGNED, payload=payload, now=timezone.now())
    return Todo.objects.get(pk=todo.pk)


def followup_rows(todo) -> list[WriteBack]:
    return list(WriteBack.objects.filter(todo_id=todo.pk, action="followup")
                .order_by("followup_seq"))


def comment_on(issue_payload: dict, comment_id: int) -> dict:
    """GitHub's own issue_comment example, about the issue of ``issue_payload``."""
    payload = copy.deepcopy(webhook_example("issue_comment", action="created"))
    payload["repository"] = issue_payload["repository"]
    payload["issue"] = {**payload["issue"], "number": issue_payload["issue"]["number"]}
    payload["comment"] = {**payload["comment"], "id": comment_id}
    payload["installation"] = issue_payload["installation"]
    return payload


def test_a_follow_up_gets_eyes_on_its_own_comment(hooked, github, agent, client, operator):
    issue = gh.issue_opened()
    todo = gh.deliver("issues", issue)
    gh.send()
    fold_followup(todo, "issue_comment.created", comment_on(issue, 9001))
    fold_followup(todo, "issue_comment.created", comment_on(issue, 9002))
    assert gh.send() == 2
    seen = github.requests_to("reactions/create-for-issue-comment")
    assert [request.path.rsplit("/", 3)[-2] for request in seen] == ["9001", "9002"]
    assert all(request.body == {"content": "eyes"} for request in seen)
    rows = followup_rows(todo)
    assert [(row.followup_seq, row.state) for row in rows] == [(1, "sent"), (2, "sent")]
    assert rows[0].target_label.endswith("comment 9001")
    assert len(github.requests_to("reactions/create-for-issue")) == 1  # the todo's own, once
    assert "status" not in gh.rows(todo)  # a follow-up makes no status before a transition
    assert gh.send() == 0  # each follow-up is acked once
    client.force_login(operator)
    page = client.get(f"/todos/{todo.pk}/").content.decode()
    assert "eyes reaction on follow-up 1" in page and "eyes reaction on follow-up 2" in page


def test_an_ack_route_acks_a_follow_up_and_writes_no_status(hooked, github, agent):
    hooked.routes.update(write_back="ack")
    issue = gh.issue_opened()
    todo = gh.deliver("issues", issue)
    todo_transitions.claim_todo(agent, todo.pk)
    fold_followup(todo, "issue_comment.created", comment_on(issue, 9005))
    assert OutboxEntry.objects.count() == 2  # the create and the follow-up
    gh.send()
    assert len(github.requests_to("reactions/create-for-issue-comment")) == 1
    assert not github.requests_to("issues/create-comment")


def test_a_todo_that_writes_nothing_back_acks_no_follow_up(hooked, github, agent):
    hooked.routes.update(write_back="off")
    issue = gh.issue_opened()
    todo = gh.deliver("issues", issue)
    fold_followup(todo, "issue_comment.created", comment_on(issue, 9006))
    assert not OutboxEntry.objects.exists()
    gh.send()
    assert not github.requests_to("reactions/create-for-issue-comment")
    assert not WriteBack.objects.exists()


def test_a_follow_up_about_the_todos_own_object_adds_no_reaction(hooked, github):
    issue = gh.issue_opened()
    todo = gh.deliver("issues", issue)
    edited = copy.deepcopy(issue)
    edited["action"] = "edited"
    fold_followup(todo, "issues.edited", edited)
    gh.send()
    assert followup_rows(todo) == [] and not OutboxEntry.objects.exists()
    assert len(github.requests_to("reactions/create-for-issue")) == 1


def test_a_follow_up_waits_for_the_todos_own_ack(hooked_by_token, github):
    issue = gh.issue_opened()
    todo = gh.deliver("issues", issue)
    fold_followup(todo, "issue_comment.created", comment_on(issue, 9003))
    github.fail(502, times=None, message="Bad Gateway")
    gh.send()
    assert gh.rows(todo)["ack"].state == "pending"
    assert followup_rows(todo)[0].state == "pending" and followup_rows(todo)[0].attempts == 0
    assert not github.requests_to("reactions/create-for-issue-comment")


def test_the_status_counts_follow_ups_and_a_cancel_request(hooked, github, agent):
    issue = gh.issue_opened()
    todo = gh.deliver("issues", issue)
    todo_transitions.claim_todo(agent, todo.pk)
    gh.send()
    fold_followup(todo, "issue_comment.created", comment_on(issue, 9004))
    gh.send()
    (edited,) = github.requests_to("issues/update-comment")
    assert "Follow-ups folded in: 1 later event on this thread passed to the agent." in (
        edited.body["body"])
    todo_transitions.request_cancel(todo.pk, actor="alice", endpoint=todo.endpoint)
    gh.send()
    edited = github.requests_to("issues/update-comment")[-1].body["body"]
    assert "Being worked on · cancel requested" in edited
    assert "A cancel was requested at" in edited and "asked to stop" in edited


@pytest.mark.parametrize("event, action, words", [
    ("pull_request", "opened", "Stopped: the PR was closed"),
    ("issues", "opened", "Stopped: the issue was closed"),
])
def test_a_todo_the_source_stopped_says_so_in_its_status(hooked, github, event, action, words):
    todo = gh.deliver(event, webhook_example(event, action=action))
    Todo.objects.filter(pk=todo.pk).update(thread="octo/app#12")
    assert todo_transitions.stop_thread(todo.endpoint_id, "octo/app#12", webhook_id=hooked.pk,
                                        actor="octocat") == [str(todo.pk)]
    gh.send()
    (comment,) = github.status_comments()
    assert f"🛑 {words}" in comment["body"]
    assert "Reason:" not in comment["body"] and "source\\_closed" not in comment["body"]


def test_a_held_todo_the_source_stopped_says_so_once_it_ends(hooked, github, agent):
    todo = gh.deliver("pull_request", webhook_example("pull_request", action="opened"))
    Todo.objects.filter(pk=todo.pk).update(thread="octo/app#12")
    todo_transitions.claim_todo(agent, todo.pk)
    todo_transitions.stop_thread(todo.endpoint_id, "octo/app#12", webhook_id=hooked.pk,
                                 actor="octocat")
    gh.send()
    (comment,) = github.status_comments()
    assert "Being worked on · cancel requested" in comment["body"]
    # Its holder ends it (the operator's cancel stands in for the agent's own here).
    todo_transitions.cancel_todo(todo_transitions.Caller.operator(todo.endpoint, "x"), todo.pk)
    gh.send()
    (comment,) = github.status_comments()
    assert "🛑 Stopped: the PR was closed" in comment["body"]
    (run,) = (found["answer"] for found in github.check_runs.values())
    assert run["conclusion"] == "cancelled" and run["output"]["title"].startswith("🛑 Stopped")


def test_a_holder_that_ends_a_stopped_todo_with_a_reason_of_its_own_still_reads_stopped(
        hooked, github, agent):
    # The runner cancels with its own words ("the runner stopped the agent"); the source asked.
    todo = gh.deliver("issues", gh.issue_opened())
    Todo.objects.filter(pk=todo.pk).update(thread="octo/app#12")
    todo_transitions.claim_todo(agent, todo.pk)
    todo_transitions.stop_thread(todo.endpoint_id, "octo/app#12", webhook_id=hooked.pk,
                                 actor="octocat")
    todo_transitions.cancel_held_todo(agent, todo.pk, reason="the runner stopped the agent")
    gh.send()
    (comment,) = github.status_comments()
    assert "🛑 Stopped: the issue was closed" in comment["body"]


def test_an_agents_own_cancel_names_no_session_id_at_the_source(hooked, github, agent):
    todo = gh.deliver("issues", gh.issue_opened())
    todo_transitions.claim_todo(agent, todo.pk)
    todo_transitions.cancel_held_todo(agent, todo.pk, reason="not mine to do")
    gh.send()
    (comment,) = github.status_comments()
    assert "Cancelled by its agent" in comment["body"]
    assert agent.actor not in comment["body"] and "not mine to do" not in comment["body"]


def test_an_operators_cancel_still_names_them_and_their_reason(hooked, github, agent):
    todo = gh.deliver("issues", gh.issue_opened())
    todo_transitions.claim_todo(agent, todo.pk)
    operator = todo_transitions.Caller.operator(todo.endpoint, "alice")
    todo_transitions.cancel_todo(operator, todo.pk, reason="duplicate")
    gh.send()
    (comment,) = github.status_comments()
    assert "Cancelled by alice" in comment["body"] and "Reason: duplicate" in comment["body"]


@pytest.mark.parametrize("source, kind, payload, subject", [
    ("github", "issue_comment.created", {"issue": {"pull_request": {"url": "x"}}}, "PR"),
    ("gitea", "issues.opened", {"issue": {}}, "issue"),
    ("gitlab", "note", {"object_attributes": {"noteable_type": "MergeRequest"}}, "MR"),
    ("gitlab", "issue.open", {}, "issue"),
    ("linear", "AgentSessionEvent.created", {}, "agent session"),
    ("slack", "message", {}, "thread"),
])
def test_what_a_thread_is_about_reads_as_people_call_it(source, kind, payload, subject):
    assert status_text.thread_subject(source, kind, payload) == subject


@pytest.fixture
def slack_hooked(endpoint, slack_connection, make_webhook, slack_api):
    webhook = make_webhook("slack", slug="sl")
    connections.set_webhook_connection(webhook, slack_connection)
    slack_api.channels.setdefault(sl.CHANNEL, [])
    return webhook


def test_a_slack_follow_up_gets_eyes_on_its_own_reply(slack_hooked, slack_api):
    first = sl.person_says(slack_api)
    todo = sl.deliver(first)
    reply = sl.person_says(slack_api, "also the empty case", thread_ts=first["event"]["ts"])
    fold_followup(todo, "message", reply)
    gh.send()
    reacted = [(ts, name) for _, ts, name, _ in slack_api.reactions]
    assert reacted == [(first["event"]["ts"], "eyes"), (reply["event"]["ts"], "eyes")]
    assert followup_rows(todo)[0].state == "sent"


def test_a_linear_prompt_folded_in_gets_a_thought_of_its_own(operator, endpoint, linear,
                                                             make_webhook):
    webhook = make_webhook("linear", slug="lin")
    connections.set_webhook_connection(webhook, ln.make_connection(operator, linear))
    created = ln.session_event(linear)
    todo = ln.deliver(created)
    prompted = ln.session_event(linear, action="prompted")
    prompted["agentSession"] = created["agentSession"]
    prompted["agentActivity"]["agentSessionId"] = created["agentSession"]["id"]
    fold_followup(todo, "AgentSessionEvent.prompted", prompted)
    gh.send()
    thoughts = [content["body"] for content in ln.contents(linear, todo)]
    assert len(thoughts) == 2 and thoughts[0].startswith("Queued for an agent")
    assert thoughts[1].startswith("Passed to the agent working on")
    assert f"https://sb.example/todos/{todo.pk}/" in thoughts[1]
    assert followup_rows(todo)[0].target["prompt"] == prompted["agentActivity"]["id"]


def test_a_note_or_comment_folded_in_gets_eyes_on_itself(forge):
    todo = forge.deliver(forge.issue())
    _, comment = forge.comment(note_id=1300) if forge.source == "gitlab" else forge.comment(
        comment_id=1300)
    fold_followup(todo, "note" if forge.source == "gitlab" else "issue_comment.created", comment)
    gh.send()
    (seen,) = forge.standin.requests_to(forge.comment_ack_op)
    assert seen.path == ("/api/v4/projects/77/issues/12/notes/1300/award_emoji"
                         if forge.source == "gitlab"
                         else "/api/v1/repos/acme/widgets/issues/comments/1300/reactions")
    assert len(forge.standin.requests_to(forge.ack_op)) == 1  # the todo's own
    assert followup_rows(todo)[0].state == "sent"
