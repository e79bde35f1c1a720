"""Threads through the hook (docs/work-control.md#threads): a delivery on a thread whose todo is
live becomes its follow-up (or is dropped, or makes its own todo, per the route's policy); a
delivery that ends the thread stops its todos; real example payloads where the senders publish
them (@octokit/webhooks-examples)."""

import json
import threading

import pytest
from django.core.management import call_command
from django.db import connection, connections

from ingest import queries, transitions
from ingest.models import DeliveryRecord, Route
from tests.processes import DEADLINE_SECONDS
from todos import transitions as todo_transitions
from todos.models import FollowUp, Todo, TodoEvent

from . import signing
from .conftest import SECRETS
from .github_standin import webhook_example
from .test_views import post_hook

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def generous_rate_limits(settings):
    settings.SWITCHBOARD_INGEST_RATE_PER_MINUTE = 10_000
    settings.SWITCHBOARD_INGEST_FAILURES_PER_MINUTE = 10_000


@pytest.fixture
def hook(make_webhook, endpoint):
    """hook(source, **route options): a webhook with one route to ``endpoint``/inbox."""

    def make(source="github", slug=None, **options):
        webhook = make_webhook(source, slug=slug, routes=[])
        transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="inbox",
                                      **options)
        return webhook

    return make


def send(webhook, payload, *, delivery=None, **signer):
    body = (signing.linear_body(payload) if webhook.source == "linear"
            else signing.body_of(payload))
    if delivery is not None:
        signer["delivery"] = delivery
    answer = post_hook(webhook.slug, body,
                       signing.SIGNERS[webhook.source](SECRETS[webhook.source], body, **signer))
    assert answer.status_code == 202, answer.content
    return answer.json()


def github(event, action=None, **changes):
    """An example payload of ``event`` (GitHub publishes no ``issues`` ``closed`` or
    ``reopened`` example: those are its ``opened`` one with the action changed)."""
    try:
        payload = webhook_example(event, action=action)
    except LookupError:
        payload = webhook_example(event, action="opened")
    if action is not None:
        payload["action"] = action
    return {**payload, **changes}


def gh(webhook, event, action=None, delivery=None, **changes):
    return send(webhook, github(event, action, **changes), event=event, delivery=delivery)


def last_record(webhook):
    return DeliveryRecord.objects.filter(webhook=webhook).latest("id")


# -- GitHub, on its own example payloads --------------------------------------------------------


def test_a_comment_on_a_live_issue_becomes_its_follow_up(hook):
    webhook = hook("github")
    opened = gh(webhook, "issues", "opened")
    [todo] = Todo.objects.all()
    assert todo.thread == "Codertocat/Hello-World#1"
    assert todo.thread_live_key == f"{webhook.pk}:Codertocat/Hello-World#1"
    answer = gh(webhook, "issue_comment", "created", delivery="comment-1")
    assert answer["todos"] == [{"id": str(todo.pk), "endpoint": "agent", "queue": "inbox",
                                "duplicate": False, "followup": True}]
    assert answer["delivery"] != opened["delivery"]
    [followup] = FollowUp.objects.filter(todo=todo)
    assert (followup.seq, followup.kind, followup.actor, followup.trust) == (
        1, "issue_comment.created", "Codertocat", "signed")
    assert followup.payload["comment"]["body"]
    assert Todo.objects.count() == 1 and Todo.objects.get().followup_count == 1
    record = last_record(webhook)
    assert (record.outcome, record.todo_ids) == ("accepted", [str(todo.pk)])
    assert f"follow-up of #{todo.pk}" in record.reason


def test_a_redelivery_of_a_follow_up_is_a_duplicate_not_a_second_follow_up(hook):
    webhook = hook("github")
    gh(webhook, "issues", "opened")
    gh(webhook, "issue_comment", "created", delivery="comment-1")
    again = gh(webhook, "issue_comment", "created", delivery="comment-1")
    assert FollowUp.objects.count() == 1
    assert again["todos"] == [] or not any(t.get("followup") for t in again["todos"])


def test_a_delivery_that_became_a_follow_up_is_redelivered_from_the_follow_up(hook):
    webhook = hook("github")
    gh(webhook, "issues", "opened")
    gh(webhook, "issue_comment", "created", delivery="comment-1")
    record = last_record(webhook)
    [followup] = FollowUp.objects.all()
    _, routes = queries.find_webhook_with_routes(webhook.slug)
    arrival = transitions.redeliver(record, operator=webhook.owner, routes=routes)
    # A redelivery makes its own todo even on a live thread.
    [(todo, created)] = arrival.todos
    assert created and (todo.kind, todo.payload, todo.trust) == (
        "issue_comment.created", followup.payload, "signed")
    assert todo.thread == "Codertocat/Hello-World#1"
    assert arrival.record.redelivered_from_id == record.pk
    # Pruned (no todo, no follow-up of it left): the message stays.
    FollowUp.objects.filter(pk=followup.pk).delete()
    with pytest.raises(ValueError, match="pruned"):
        transitions.redeliver(record, operator=webhook.owner, routes=routes)


def test_reviews_and_review_comments_join_their_pull_request(hook):
    webhook = hook("github")
    gh(webhook, "pull_request", "opened")
    gh(webhook, "pull_request_review", "submitted")
    gh(webhook, "pull_request_review_comment", "created")
    [todo] = Todo.objects.all()
    assert todo.thread == "Codertocat/Hello-World#2"
    assert list(FollowUp.objects.filter(todo=todo).order_by("seq").values_list("seq", "kind")) == [
        (1, "pull_request_review.submitted"), (2, "pull_request_review_comment.created")]


@pytest.mark.parametrize("merged", [False, True])
def test_closing_the_pull_request_cancels_its_unheld_todo_and_makes_none(hook, merged):
    webhook = hook("github")
    gh(webhook, "pull_request", "opened")
    [todo] = Todo.objects.all()
    closed = github("pull_request", "closed")
    closed["pull_request"] = {**closed["pull_request"], "merged": merged}
    answer = send(webhook, closed, event="pull_request")
    assert answer["stopped"] == [str(todo.pk)] and answer["todos"] == []
    todo.refresh_from_db()
    assert todo.state == "cancelled"
    event = TodoEvent.objects.get(todo=todo, action="cancel")
    assert (event.actor, event.detail["reason"]) == (f"webhook:{webhook.slug}", "source_closed")
    assert Todo.objects.count() == 1
    record = last_record(webhook)
    assert (record.outcome, record.todo_ids) == ("stopped", [str(todo.pk)])


def test_closing_the_issue_asks_the_holder_to_stop_and_reopening_starts_anew(hook, agent):
    webhook = hook("github")
    gh(webhook, "issues", "opened")
    [todo] = Todo.objects.all()
    todo_transitions.claim_todo(agent, todo.pk)
    answer = gh(webhook, "issues", "closed")
    assert answer["stopped"] == [str(todo.pk)]
    todo.refresh_from_db()
    assert todo.state == "claimed" and todo.cancel_requested_at is not None
    # Asked to stop: it takes no follow-ups; a comment now makes a todo of its own.
    gh(webhook, "issue_comment", "created")
    assert Todo.objects.count() == 2 and not FollowUp.objects.exists()
    second = Todo.objects.latest("id")
    todo_transitions.complete_todo(agent, todo.pk)
    todo_transitions.cancel_todo(todo_transitions.Caller.operator(todo.endpoint, "alice"),
                                 second.pk)
    gh(webhook, "issues", "reopened")
    third = Todo.objects.latest("id")
    assert third.pk not in (todo.pk, second.pk) and third.state == "pending"
    assert third.thread == "Codertocat/Hello-World#1" and third.kind == "issues.reopened"


def test_skip_drops_a_delivery_while_the_thread_is_live(hook):
    webhook = hook("github", follow_ups="skip")
    gh(webhook, "issues", "opened")
    [todo] = Todo.objects.all()
    answer = gh(webhook, "issue_comment", "created")
    assert answer["todos"] == [] and "stopped" not in answer
    assert Todo.objects.count() == 1 and not FollowUp.objects.exists()
    record = last_record(webhook)
    assert record.outcome == "coalesced" and f"#{todo.pk}" in record.reason
    assert record.todo_ids == [str(todo.pk)]


def test_new_makes_every_delivery_its_todo_and_a_stop_still_ends_them_all(hook):
    webhook = hook("github", follow_ups="new")
    gh(webhook, "issues", "opened")
    gh(webhook, "issue_comment", "created")
    todos = list(Todo.objects.order_by("id"))
    assert len(todos) == 2 and {t.thread for t in todos} == {"Codertocat/Hello-World#1"}
    assert all(t.thread_live_key is None for t in todos)
    answer = gh(webhook, "issues", "closed")
    assert answer["stopped"] == [str(t.pk) for t in todos]
    assert set(Todo.objects.values_list("state", flat=True)) == {"cancelled"}


def test_no_stop_and_extra_stop_kinds(hook):
    webhook = hook("github", stop=False)
    gh(webhook, "issues", "opened")
    answer = gh(webhook, "issues", "closed")
    assert answer["todos"][0].get("followup") is True
    assert Todo.objects.get().state == "pending"
    labeled = hook("github", slug="labels", stop_kinds=["issues.labeled"])
    gh(labeled, "issues", "opened")
    assert gh(labeled, "issues", "labeled")["stopped"]


def test_a_stop_with_nothing_live_is_logged_stopped_and_makes_nothing(hook):
    webhook = hook("github")
    answer = gh(webhook, "issues", "closed")
    assert (answer["todos"], answer["stopped"]) == ([], [])
    assert not Todo.objects.exists() and last_record(webhook).outcome == "stopped"


def test_a_stop_reaches_only_that_webhooks_todos(hook):
    first, second = hook("github", slug="one"), hook("github", slug="two")
    gh(first, "issues", "opened")
    gh(second, "issues", "opened")
    gh(first, "issues", "closed")
    states = dict(Todo.objects.values_list("delivery_event__webhook__slug", "state"))
    assert states == {"one": "cancelled", "two": "pending"}


def test_a_route_template_sets_the_thread(hook):
    webhook = hook("github", thread_key="{repository.owner.login}")
    gh(webhook, "issues", "opened")
    gh(webhook, "pull_request", "opened")
    assert Todo.objects.get().thread == "Codertocat" and FollowUp.objects.count() == 1
    other = hook("github", slug="missing", thread_key="{nothing.here}")
    gh(other, "issues", "opened")
    assert Todo.objects.filter(delivery_event__webhook=other).get().thread is None


def test_an_actor_the_route_does_not_trust_adds_no_follow_up(hook):
    webhook = hook("github", actors_allowed=["Codertocat"])
    gh(webhook, "issues", "opened")
    comment = github("issue_comment", "created")
    comment["sender"] = {**comment["sender"], "login": "stranger"}
    comment["comment"] = {**comment["comment"], "user": {"login": "stranger"}}
    send(webhook, comment, event="issue_comment")
    assert not FollowUp.objects.exists() and last_record(webhook).outcome == "filtered"


# -- the other senders --------------------------------------------------------------------------


def test_gitlab_notes_join_their_merge_request_and_a_merge_stops_it(hook):
    webhook = hook("gitlab")
    project = {"id": 7, "path_with_namespace": "group/app"}
    mr = {"object_kind": "merge_request", "project": project,
          "object_attributes": {"iid": 9, "title": "Fix", "action": "open"}}
    send(webhook, mr)
    note = {"object_kind": "note", "project": project, "merge_request": {"iid": 9},
            "object_attributes": {"noteable_type": "MergeRequest", "id": 4, "note": "nit"}}
    assert send(webhook, note, event="Note Hook")["todos"][0]["followup"] is True
    [todo] = Todo.objects.all()
    assert todo.thread == "group/app!9"
    merged = {**mr, "object_attributes": {**mr["object_attributes"], "action": "merge"}}
    assert send(webhook, merged)["stopped"] == [str(todo.pk)]


def test_gitea_comment_follows_up_and_closing_stops(hook):
    webhook = hook("gitea")
    issue = {"action": "opened", "issue": {"number": 3, "title": "Bug"},
             "repository": {"full_name": "octo/app"}}
    send(webhook, issue)
    comment = {**issue, "action": "created", "comment": {"id": 1, "body": "more"}}
    assert send(webhook, comment, event="issue_comment")["todos"][0]["followup"] is True
    assert send(webhook, {**issue, "action": "closed"})["stopped"]


SESSION = {"id": "5f0c9a7e-1111-2222-3333-444455556666",
           "issue": {"identifier": "ENG-12", "title": "Login"}}


def test_linear_agent_session_prompts_follow_up_and_its_stop_signal_stops(hook):
    webhook = hook("linear")
    created = {"type": "AgentSessionEvent", "action": "created", "agentSession": SESSION}
    send(webhook, created)
    prompted = {**created, "action": "prompted",
                "agentActivity": {"content": {"type": "prompt", "body": "also the logout"}}}
    assert send(webhook, prompted)["todos"][0]["followup"] is True
    [todo] = Todo.objects.all()
    assert todo.thread == SESSION["id"]
    stop = {**prompted, "agentActivity": {"content": {"type": "prompt", "body": "stop"},
                                          "signal": "stop"}}
    assert send(webhook, stop)["stopped"] == [str(todo.pk)]
    assert Todo.objects.get().state == "cancelled" and FollowUp.objects.count() == 1


def test_slack_replies_in_a_thread_follow_up_its_mention(hook):
    webhook = hook("slack")
    mention = {"type": "event_callback", "event_id": "Ev1", "event": {
        "type": "app_mention", "channel": "C1", "ts": "100.1", "user": "U1", "text": "fix it"}}
    send(webhook, mention)
    reply = {"type": "event_callback", "event_id": "Ev2", "event": {
        "type": "app_mention", "channel": "C1", "ts": "100.5", "thread_ts": "100.1",
        "user": "U1", "text": "and this"}}
    assert send(webhook, reply)["todos"][0]["followup"] is True
    elsewhere = {"type": "event_callback", "event_id": "Ev3", "event": {
        "type": "app_mention", "channel": "C1", "ts": "200.1", "user": "U1", "text": "other"}}
    send(webhook, elsewhere)
    assert sorted(Todo.objects.values_list("thread", flat=True)) == ["C1:100.1", "C1:200.1"]


def test_sentry_resolving_the_issue_stops_it(hook):
    webhook = hook("sentry")
    issue = {"action": "created", "data": {"issue": {"id": "42", "title": "Boom"}}}
    send(webhook, issue)
    assert send(webhook, {**issue, "action": "resolved"})["stopped"]
    assert Todo.objects.get().state == "cancelled"


def test_a_source_without_threads_makes_a_todo_each_time(hook):
    webhook = hook("standard")
    for n in range(2):
        send(webhook, {"type": "invoice.paid", "n": n})
    assert list(Todo.objects.values_list("thread", flat=True)) == [None, None]


# -- the operator's hand-over and the route's settings ------------------------------------------


def test_a_hand_over_keeps_its_thread(client, operator, endpoint):
    client.force_login(operator)
    answer = client.post(f"/api/v1/endpoints/{endpoint.slug}/todos", json.dumps(
        {"queue": "inbox", "title": "look", "thread": " octo/app#12 "}),
        content_type="application/json")
    assert answer.status_code in (200, 201), answer.content
    todo = Todo.objects.get()
    assert (todo.thread, todo.thread_live_key) == ("octo/app#12", None)
    bad = client.post(f"/api/v1/endpoints/{endpoint.slug}/todos", json.dumps(
        {"queue": "inbox", "title": "look", "thread": 12}), content_type="application/json")
    assert bad.status_code == 400 and "thread" in bad.json()["error"]["message"]


def test_add_webhook_route_prints_the_effective_thread_settings(make_webhook, endpoint, capsys):
    make_webhook("github", slug="gh", routes=[])
    make_webhook("stripe", slug="pay", routes=[])
    call_command("add_webhook_route", "gh", endpoint.slug, "--queue", "inbox", "--json")
    out = json.loads(capsys.readouterr().out)
    assert (out["follow_ups"], out["thread_key"], out["stop"]) == (
        "coalesce", "", ["issues.closed", "pull_request.closed"])
    call_command("add_webhook_route", "pay", endpoint.slug, "--queue", "inbox", "--json",
                 "--stop-kinds", "charge.refunded", "--follow-ups", "skip",
                 "--thread-key", "{data.object.id}")
    out = json.loads(capsys.readouterr().out)
    assert (out["follow_ups"], out["thread_key"], out["stop"]) == (
        "skip", "{data.object.id}", ["charge.refunded"])
    make_webhook("stripe", slug="pay2", routes=[])
    call_command("add_webhook_route", "pay2", endpoint.slug, "--queue", "inbox", "--json",
                 "--no-stop")
    out = json.loads(capsys.readouterr().out)
    assert (out["follow_ups"], out["stop"]) == ("new", False)


def test_a_bad_thread_key_template_is_refused_naming_the_flag(make_webhook, endpoint):
    from django.core.management.base import CommandError

    make_webhook("github", slug="gh", routes=[])
    with pytest.raises(CommandError, match="--thread-key"):
        call_command("add_webhook_route", "gh", endpoint.slug, "--queue", "inbox",
                     "--thread-key", "{a}}")


def test_stop_kinds_on_a_route_that_never_stops_are_refused(make_webhook, endpoint):
    from django.core.management.base import CommandError

    make_webhook("github", slug="gh", routes=[])
    with pytest.raises(CommandError, match="--stop-kinds.*--no-stop"):
        call_command("add_webhook_route", "gh", endpoint.slug, "--queue", "inbox",
                     "--no-stop", "--stop-kinds", "issues.labeled")
    assert not Route.objects.exists()


# -- exact under concurrency (PostgreSQL) -------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "postgresql", reason="concurrency: PostgreSQL")
def test_sixteen_deliveries_on_one_thread_at_once_make_one_todo_and_fifteen_follow_ups(hook):
    webhook = hook("github")
    count = 16
    barrier, answers, errors = threading.Barrier(count), [None] * count, []

    def deliver(i):
        try:
            comment = github("issue_comment", "created")
            comment["comment"] = {**comment["comment"], "id": 1000 + i}
            body = signing.body_of(comment)
            meta = signing.github(SECRETS["github"], body, event="issue_comment",
                                  delivery=f"d-{i}")
            barrier.wait(timeout=DEADLINE_SECONDS)
            answers[i] = post_hook(webhook.slug, body, meta)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=deliver, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert [answer.status_code for answer in answers] == [202] * count
    [todo] = Todo.objects.all()
    assert sorted(FollowUp.objects.filter(todo=todo).values_list("seq", flat=True)) == list(
        range(1, count))
    assert Todo.objects.get().followup_count == count - 1
    bodies = [answer.json()["todos"] for answer in answers]
    assert all(len(t) == 1 and t[0]["id"] == str(todo.pk) for t in bodies)
    assert sum(1 for t in bodies if t[0].get("followup")) == count - 1
    assert DeliveryRecord.objects.filter(webhook=webhook, outcome="accepted").count() == count
