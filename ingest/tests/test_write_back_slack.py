"""Slack write-back (docs/write-back.md#slack): Events API deliveries of the shapes Slack sends,
written back to a stand-in of Slack's Web API held to slack_sdk's definition of each method
(ingest/tests/slack_standin.py). The worker is driven by hand (``send_due_write_backs``), as
the Celery task or the embedded scheduler would call it."""

import itertools
import json
from datetime import timedelta
from io import StringIO

import pytest
import slack_sdk
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.utils import timezone

from ingest import connections, outbound, status_text, write_back
from ingest.models import Connection, DeliveryRecord
from ingest.senders import slack as slack_sender
from ingest.tests import hook_client, signing
from ingest.tests.conftest import SECRETS
from ingest.tests.test_write_back import (  # noqa: F401 (public_url: a fixture)
    post_status_then_die, public_url, rows, send)
from todos import transitions as todo_transitions
from todos.models import Todo

pytestmark = pytest.mark.django_db
CHANNEL = "C0LAN2Q65"
PERSON = "U061F7AUR"
_event_ids = itertools.count(1)


@pytest.fixture
def hooked(endpoint, slack_connection, make_webhook, slack_api):
    """A Slack webhook writing back under the bot's connection, one route to ``endpoint``;
    the channel exists at the stand-in."""
    webhook = make_webhook("slack", slug="sl")
    connections.set_webhook_connection(webhook, slack_connection)
    slack_api.channels.setdefault(CHANNEL, [])
    return webhook


def envelope(slack_api, event: dict) -> dict:
    """An Events API ``event_callback`` around ``event``, as Slack posts it to the app."""
    return {"token": "XXYYZZ", "team_id": slack_api.team_id, "api_app_id": slack_api.app_id,
            "event": event, "type": "event_callback",
            "event_id": f"Ev0SW{next(_event_ids):06d}",
            "event_time": int(event["event_ts"].split(".")[0]),
            "authorizations": [{"enterprise_id": None, "team_id": slack_api.team_id,
                                "user_id": slack_api.bot_user_id, "is_bot": True,
                                "is_enterprise_install": False}],
            "is_ext_shared_channel": False}


def message_event(slack_api, message: dict, *, kind="message") -> dict:
    """The event Slack sends for a message it holds: the message with its channel."""
    event = {**message, "type": kind, "channel": CHANNEL, "event_ts": message["ts"]}
    if kind == "message":
        event["channel_type"] = "channel"
    return envelope(slack_api, event)


def person_says(slack_api, text="please fix the login bug", *, thread_ts=None,
                kind="message") -> dict:
    message = slack_api.add_message(CHANNEL, user=PERSON, text=text, thread_ts=thread_ts)
    return message_event(slack_api, message, kind=kind)


def deliver(payload: dict, *, slug="sl") -> Todo | None:
    body = signing.body_of(payload)
    answer = hook_client.post(slug, body, **signing.slack(SECRETS["slack"], body))
    assert answer.status_code == 202, answer.content
    todos = answer.json()["todos"]
    return Todo.objects.get(pk=todos[0]["id"]) if todos else None


# -- the connection ------------------------------------------------------------------------------


def test_a_connection_records_the_bots_name_and_ids(slack_connection, slack_api):
    assert slack_connection.identity == "switchboard"
    assert slack_connection.identity_id == "U0SWBOT01/B0SWBOT01//switchboard-test.slack.com"
    assert len(slack_api.requests_to("auth.test")) == 1


def test_add_connection_and_set_connection_take_a_bot_token(operator, slack_api, make_webhook,
                                                           monkeypatch):
    monkeypatch.setenv("SLACK_BOT_TOKEN_FOR_TEST", slack_api.token)
    out = StringIO()
    call_command("add_connection", "slack-bot", "--owner", operator.username, "--kind", "slack",
                 "--token-env", "SLACK_BOT_TOKEN_FOR_TEST", "--api-url", slack_api.api_url,
                 "--json", stdout=out)
    assert json.loads(out.getvalue()) == {
        "name": "slack-bot", "kind": "slack", "api_url": slack_api.api_url, "ok": True,
        "identity": "switchboard", "error": ""}
    assert slack_api.token not in out.getvalue()
    webhook = make_webhook("slack", slug="sl")
    call_command("set_connection", "sl", "slack-bot", stdout=StringIO())
    webhook.refresh_from_db()
    assert webhook.connection.name == "slack-bot"


@pytest.mark.parametrize("token", ["xoxp-1-user-token", "xapp-1-A0-app-level", "xoxb- two words"])
def test_only_a_bot_token_makes_a_connection(operator, token):
    with pytest.raises(ValidationError, match="Slack bot token, xoxb-"):
        connections.create_connection(name="sl", owner=operator, kind="slack", secret=token)
    assert not Connection.objects.exists()


def test_a_revoked_token_fails_the_test_with_slacks_word(slack_connection, slack_api):
    slack_api.revoked.add(slack_api.token)
    test = connections.test_connection(slack_connection)
    assert not test.ok and test.error == "auth.test: token_revoked"
    slack_connection.refresh_from_db()
    assert slack_connection.last_error == "auth.test: token_revoked"


# -- the ack and the living status ---------------------------------------------------------------


def test_a_delivery_gets_eyes_on_its_message(hooked, slack_api):
    payload = person_says(slack_api)
    todo = deliver(payload)
    assert todo.write_back == "status"
    assert not slack_api.requests_to("reactions.add")  # nothing inside the delivery
    assert send() == 1
    (seen,) = slack_api.requests_to("reactions.add")
    assert seen.body == {"channel": CHANNEL, "name": "eyes",
                              "timestamp": payload["event"]["ts"]}
    assert slack_api.reactions == [(CHANNEL, payload["event"]["ts"], "eyes",
                                    slack_api.bot_user_id)]
    ack = rows(todo)["ack"]
    assert ack.state == "sent" and ack.attempts == 1
    assert ack.target_label == f"{CHANNEL}: message {payload['event']['ts']}"
    assert "status" not in rows(todo)  # no status before the todo's first change


def test_an_eyes_already_there_counts_as_the_ack(hooked, slack_api):
    payload = person_says(slack_api)
    slack_api.reactions.append((CHANNEL, payload["event"]["ts"], "eyes", slack_api.bot_user_id))
    todo = deliver(payload)
    send()
    assert slack_api.requests_to("reactions.add")[0].answer["error"] == "already_reacted"
    assert rows(todo)["ack"].state == "sent"


def test_one_thread_reply_per_todo_edited_in_place(hooked, slack_api, agent):
    parent = slack_api.add_message(CHANNEL, user="U0OTHER01", text="login is broken")
    payload = person_says(slack_api, "<@U0SWBOT01> can you take this?",
                          thread_ts=parent["ts"], kind="app_mention")
    todo = deliver(payload)
    send()
    todo_transitions.claim_todo(agent, todo.pk)
    send()
    (posted,) = slack_api.requests_to("chat.postMessage")
    # In the thread the mention was made in, under its first message.
    assert posted.body["thread_ts"] == parent["ts"] and posted.body["channel"] == CHANNEL
    assert posted.headers["content-type"].partition(";")[0] == "application/json"
    assert "*🛠️ Being worked on*" in posted.body["text"]
    assert f"<https://sb.example/todos/{todo.pk}/|todo {todo.pk} on switchboard>" in \
        posted.body["text"]
    assert posted.body["metadata"] == {"event_type": "switchboard_status",
                                            "event_payload": {"todo_id": todo.pk}}
    start = timezone.now() + timedelta(seconds=1)
    todo_transitions.post_update_todo(agent, todo.pk, text="found it: a stale session")
    send(start + write_back.PROGRESS_EDIT_INTERVAL)
    todo_transitions.complete_todo(agent, todo.pk, result={
        "summary": "Fixed the session check.", "url": "https://github.com/o/r/pull/9"})
    send(start + write_back.PROGRESS_EDIT_INTERVAL + timedelta(seconds=1))
    edits = slack_api.requests_to("chat.update")
    assert [seen.status for seen in edits] == [200, 200]
    assert "found it: a stale session" in edits[0].body["text"]
    (reply,) = slack_api.replies(CHANNEL, parent["ts"])
    assert reply["text"] == edits[1].body["text"]
    assert "*✅ Done*" in reply["text"] and "Fixed the session check." in reply["text"]
    assert "Result: <https://github.com/o/r/pull/9>" in reply["text"]
    status = rows(todo)["status"]
    assert status.state == "sent" and status.external_id == reply["ts"]
    assert len(slack_api.requests_to("chat.postMessage")) == 1


def test_a_message_that_starts_no_thread_gets_its_reply_under_itself(hooked, slack_api, agent):
    payload = person_says(slack_api)
    todo = deliver(payload)
    todo_transitions.claim_todo(agent, todo.pk)
    send()
    (reply,) = slack_api.replies(CHANNEL, payload["event"]["ts"])
    assert reply["thread_ts"] == payload["event"]["ts"]


def test_the_reply_is_mrkdwn_that_pings_nobody_and_pairs_nothing(hooked, slack_api, agent):
    todo = deliver(person_says(slack_api))
    todo_transitions.claim_todo(agent, todo.pk)
    summary = ("<@U0ADMIN01> <!here> <!channel> @here *bold* _it_ ~struck~ `code` a & b "
               "<https://evil.example|click>" + " and more" * 600)
    todo_transitions.complete_todo(agent, todo.pk, result={"summary": summary,
                                                           "url": "https://x.example/a|b"})
    send()
    (posted,) = slack_api.requests_to("chat.postMessage")
    text = posted.body["text"]
    assert "<@" not in text and "<!" not in text and "<https://evil" not in text
    assert "&lt;@\u200bU0ADMIN01&gt; &lt;!here&gt; &lt;!channel&gt;" in text
    assert "@\u200bhere" in text and " a &amp; b " in text
    for pairable in ("*bold*", "_it_", "~struck~", "`code`"):
        assert pairable not in text
    assert "*\u200bbold*\u200b" in text
    assert "Result:" not in text  # "|" would end a Slack link's URL: not a plain URL
    assert len(text) <= 3000


def test_a_reply_someone_deleted_is_posted_again(hooked, slack_api, agent):
    payload = person_says(slack_api)
    todo = deliver(payload)
    todo_transitions.claim_todo(agent, todo.pk)
    send()
    first = rows(todo)["status"].external_id
    slack_api.delete(CHANNEL, first)
    todo_transitions.complete_todo(agent, todo.pk, result={"summary": "ok"})
    send()
    assert slack_api.requests_to("chat.update")[0].answer["error"] == "message_not_found"
    (reply,) = slack_api.replies(CHANNEL, payload["event"]["ts"])
    assert "Done" in reply["text"] and rows(todo)["status"].external_id == reply["ts"] != first


def test_a_worker_killed_mid_send_does_not_post_twice(hooked, slack_api, agent):
    payload = person_says(slack_api)
    todo = deliver(payload)
    row, now, _ = post_status_then_die(todo, agent, slack_sender.send_status)
    # Another todo's status in the same thread is not ours to edit.
    other = status_text.StatusUpdate(todo_id=todo.pk + 1000, state="claimed", dead=False,
                                     text="another todo")
    slack_sender.send_status(row.connection, row.target, other, "", now, look_since=None)
    send(now + write_back.SEND_LEASE + timedelta(seconds=1))
    replies = slack_api.replies(CHANNEL, payload["event"]["ts"])
    assert len(replies) == 2 and "Being worked on" in replies[0]["text"]
    assert replies[1]["text"] == "another todo"
    row.refresh_from_db()
    assert row.state == "sent" and row.external_id == replies[0]["ts"] and row.attempts == 2
    (looked,) = slack_api.requests_to("conversations.replies")
    assert looked.body["oldest"] == f"{row.created_at.timestamp():.6f}"
    assert looked.body["ts"] == payload["event"]["ts"]


# -- failures --------------------------------------------------------------------------------


def test_a_429_waits_as_long_as_retry_after_says(hooked, slack_api):
    todo = deliver(person_says(slack_api))
    slack_api.fail(429, headers={"Retry-After": "30"})
    now = timezone.now()
    send(now)
    ack = rows(todo)["ack"]
    assert ack.state == "pending" and ack.last_error == "429: ratelimited"
    assert ack.next_attempt_at == now + timedelta(seconds=30)
    assert send(now + timedelta(seconds=29)) == 0
    assert send(now + timedelta(seconds=30)) == 1
    ack.refresh_from_db()
    assert ack.state == "sent"


@pytest.mark.parametrize("error", ["invalid_auth", "not_authed", "token_revoked",
                                   "account_inactive"])
def test_a_refused_token_is_the_connections_last_error(hooked, slack_api, slack_connection,
                                                       error):
    todo = deliver(person_says(slack_api))
    slack_api.refuse(error)
    send()
    ack = rows(todo)["ack"]
    assert ack.state == "failed" and ack.last_error == f"reactions.add: {error}"
    slack_connection.refresh_from_db()
    assert slack_connection.last_error == f"reactions.add: {error}"


@pytest.mark.parametrize("error, state", [
    ("internal_error", "pending"), ("fatal_error", "pending"),
    ("service_unavailable", "pending"), ("request_timeout", "pending"),
    ("not_in_channel", "failed"), ("is_archived", "failed"),
])
def test_slacks_errors_retry_or_fail_by_what_they_mean(hooked, slack_api, slack_connection,
                                                       error, state):
    todo = deliver(person_says(slack_api))
    slack_api.refuse(error)
    now = timezone.now()
    send(now)
    ack = rows(todo)["ack"]
    assert (ack.state, ack.last_error) == (state, f"reactions.add: {error}")
    if state == "pending":
        assert ack.next_attempt_at == now + write_back.FIRST_BACKOFF
    slack_connection.refresh_from_db()
    assert slack_connection.last_error == ""


def test_a_source_that_is_down_is_written_to_once_it_is_back(hooked, slack_api, agent):
    slack_api.fail(503, message="service_unavailable", times=None)
    todo = deliver(person_says(slack_api))
    todo_transitions.claim_todo(agent, todo.pk)
    todo_transitions.complete_todo(agent, todo.pk, result={"summary": "ok"})
    now = timezone.now()
    for minutes in range(0, 3):
        send(now + timedelta(minutes=minutes))
    assert rows(todo)["ack"].last_error == "503: service_unavailable"
    slack_api.recover()
    send(now + timedelta(minutes=20))
    send(now + timedelta(minutes=21))
    assert {row.state for row in rows(todo).values()} == {"sent"}
    assert len(slack_api.reactions) == 1
    (reply,) = slack_api.replies(CHANNEL, todo.payload["event"]["ts"])
    assert "Done" in reply["text"]


# -- the loop guard, with the shapes Slack sends for the bot's own messages -------------------


def own_reply_events(slack_api, hooked, agent) -> dict:
    """What Slack sends back after switchboard wrote its status: the reply as posted, the
    reply edited (``message_changed``), the eyes reaction, and a legacy ``bot_message``."""
    todo = deliver(person_says(slack_api))
    todo_transitions.claim_todo(agent, todo.pk)
    send()
    before = dict(slack_api.replies(CHANNEL, todo.payload["event"]["ts"])[0])
    todo_transitions.complete_todo(agent, todo.pk, result={"summary": "ok"})
    send()
    after = dict(slack_api.replies(CHANNEL, todo.payload["event"]["ts"])[0])
    now_ts = slack_api.next_ts()
    return {
        "reply": message_event(slack_api, before),
        "edit": envelope(slack_api, {
            "type": "message", "subtype": "message_changed", "hidden": True,
            "message": after, "channel": CHANNEL, "previous_message": before,
            "event_ts": now_ts, "ts": now_ts, "channel_type": "channel"}),
        "eyes": envelope(slack_api, {
            "type": "reaction_added", "user": slack_api.bot_user_id, "reaction": "eyes",
            "item_user": PERSON, "event_ts": now_ts,
            "item": {"type": "message", "channel": CHANNEL, "ts": todo.payload["event"]["ts"]}}),
        "bot_message": envelope(slack_api, {
            "type": "message", "subtype": "bot_message", "text": "📥 Queued", "ts": now_ts,
            "bot_id": slack_api.bot_id, "username": "switchboard", "channel": CHANNEL,
            "event_ts": now_ts, "channel_type": "channel"}),
    }


@pytest.mark.parametrize("shape", ["reply", "edit", "eyes", "bot_message"])
def test_the_bots_own_write_back_makes_no_todo(hooked, slack_api, agent, shape):
    payload = own_reply_events(slack_api, hooked, agent)[shape]
    todos_before = Todo.objects.count()
    assert deliver(payload) is None
    record = DeliveryRecord.objects.filter(webhook=hooked).order_by("-id").first()
    assert record.outcome == "filtered" and record.reason == "own_write_back"
    assert Todo.objects.count() == todos_before


def test_another_bot_and_a_person_in_the_thread_are_not_the_connections(hooked, slack_api,
                                                                         agent):
    events = own_reply_events(slack_api, hooked, agent)
    other_bot = dict(events["reply"], event_id="Ev0OTHERBOT")
    other_bot["event"] = {**events["reply"]["event"], "bot_id": "B0DATADOG", "app_id": "A0DD",
                          "user": "U0DATADOG", "bot_profile": {"id": "B0DATADOG",
                                                               "app_id": "A0DD"}}
    deliver(other_bot)
    record = DeliveryRecord.objects.filter(webhook=hooked).order_by("-id").first()
    assert record.reason != "own_write_back"
    thread = events["reply"]["event"]["thread_ts"]
    assert deliver(person_says(slack_api, "thanks! one more thing", thread_ts=thread))


def test_a_connection_with_an_app_id_guards_that_apps_messages(slack_connection, slack_api):
    Connection.objects.filter(pk=slack_connection.pk).update(
        identity_id="U0SWBOT01/B0SWBOT01/A0SWAPP01/switchboard-test.slack.com")
    slack_connection.refresh_from_db()
    event = {"type": "message", "text": "x", "ts": "1515449600.000200", "channel": CHANNEL,
             "bot_profile": {"id": "B0OTHERBOT", "app_id": "A0SWAPP01"}, "bot_id": "B0OTHERBOT"}
    assert slack_sender.is_own_write_back(slack_connection, "message", {"event": event})
    event["bot_profile"]["app_id"] = "A0ELSE"
    assert not slack_sender.is_own_write_back(slack_connection, "message", {"event": event})


# -- what a delivery is about --------------------------------------------------------------------


MESSAGE = {"type": "message", "user": PERSON, "text": "hi", "ts": "1515449600.000100",
           "channel": CHANNEL}


@pytest.mark.parametrize("event, target", [
    (MESSAGE, {"channel": CHANNEL, "ts": "1515449600.000100", "thread_ts": "1515449600.000100"}),
    ({**MESSAGE, "thread_ts": "1515449500.000001"},
     {"channel": CHANNEL, "ts": "1515449600.000100", "thread_ts": "1515449500.000001"}),
    ({**MESSAGE, "type": "app_mention"},
     {"channel": CHANNEL, "ts": "1515449600.000100", "thread_ts": "1515449600.000100"}),
    # An edit: the edited message, in its thread.
    ({"type": "message", "subtype": "message_changed", "channel": CHANNEL, "hidden": True,
      "ts": "1515449700.000001",
      "message": {**MESSAGE, "text": "hi!", "thread_ts": "1515449500.000001"},
      "previous_message": {**MESSAGE, "thread_ts": "1515449500.000001"}},
     {"channel": CHANNEL, "ts": "1515449600.000100", "thread_ts": "1515449500.000001"}),
    ({"type": "message", "subtype": "message_deleted", "channel": CHANNEL, "hidden": True,
      "ts": "1515449700.000001", "deleted_ts": MESSAGE["ts"], "previous_message": MESSAGE},
     None),
    ({"type": "message", "subtype": "message_replied", "channel": CHANNEL, "hidden": True,
      "ts": "1515449700.000001", "message": {**MESSAGE, "reply_count": 1}}, None),
    ({**MESSAGE, "subtype": "channel_join"}, None),
    ({"type": "reaction_added", "user": PERSON, "reaction": "eyes",
      "item": {"type": "message", "channel": CHANNEL, "ts": MESSAGE["ts"]}}, None),
    ({**MESSAGE, "channel": "../chat.delete"}, None),
    ({**MESSAGE, "ts": "1515449600.000100&name=x"}, None),
    ({**MESSAGE, "subtype": ["file_share"]}, None),
])
def test_find_target_reads_the_message_and_its_thread(event, target):
    found = slack_sender.find_target("message", {"type": "event_callback", "event": event})
    assert (found[0] if found else None) == target


@pytest.mark.parametrize("identity_id, url", [
    ("U0SWBOT01/B0SWBOT01//acme.slack.com",
     "https://acme.slack.com/archives/C0LAN2Q65/p1515449500000001"),
    ("U0SWBOT01/B0SWBOT01", ""),  # no workspace host recorded: no link
    ("U0SWBOT01/B0SWBOT01//evil.example/x", ""),
])
def test_the_threads_page_is_built_from_the_workspace_host(identity_id, url):
    connection = Connection(kind="slack", api_url="https://slack.com/api",
                            identity_id=identity_id)
    target = {"channel": CHANNEL, "ts": "1515449600.000100", "thread_ts": "1515449500.000001"}
    assert slack_sender.target_url(connection, target) == url


# -- the stand-in's judge ----------------------------------------------------------------------


def test_the_stand_in_refuses_what_slack_sdk_would_not_send(slack_api):
    slack_api.channels[CHANNEL] = []

    def refused(method, **kwargs) -> str:
        with pytest.raises(slack_sender.SlackError) as raised:
            answer = outbound.send(slack_api.api_url, "POST", f"/{method}",
                                   token=slack_api.token, **kwargs)
            raise slack_sender.SlackError(method, answer.body["error"])
        assert raised.value.error in ("invalid_arguments", "unknown_method")
        problems, slack_api.problems[:] = " | ".join(slack_api.problems), []
        return problems

    assert "no parameter 'colour'" in refused(
        "chat.postMessage", json={"channel": CHANNEL, "text": "x", "colour": "red"})
    assert "required 'channel' missing" in refused("chat.postMessage", json={"text": "x"})
    assert "unfurl_links='no' is not bool" in refused(
        "chat.postMessage", json={"channel": CHANNEL, "text": "x", "unfurl_links": "no"})
    assert "metadata is not slack_sdk's Metadata" in refused(
        "chat.postMessage", json={"channel": CHANNEL, "text": "x",
                                  "metadata": {"event_type": "x"}})
    assert "the WebClient sends a form, not 'application/json'" in refused(
        "reactions.add", json={"channel": CHANNEL, "name": "eyes", "timestamp": "1.000001"})
    assert "the WebClient sends JSON" in refused(
        "chat.update", form={"channel": CHANNEL, "ts": "1.000001", "text": "x"})
    assert "limit='many' is not int" in refused(
        "conversations.replies", form={"channel": CHANNEL, "ts": "1.1", "limit": "many"})
    assert "no such operation in slack_sdk's WebClient" in refused(
        "chat.postMesage", json={"channel": CHANNEL, "text": "x"})


def test_slack_sdks_own_client_passes_the_stand_in(slack_api):
    # The judge agrees with the SDK it is read from: its own WebClient's requests pass.
    client = slack_sdk.WebClient(token=slack_api.token, base_url=slack_api.api_url + "/")
    slack_api.channels[CHANNEL] = []
    posted = client.chat_postMessage(channel=CHANNEL, text="hi", unfurl_links=False,
                                     metadata={"event_type": "x", "event_payload": {"n": 1}})
    client.reactions_add(channel=CHANNEL, name="eyes", timestamp=posted["ts"])
    client.chat_update(channel=CHANNEL, ts=posted["ts"], text="hello")
    replies = client.conversations_replies(channel=CHANNEL, ts=posted["ts"], limit=10,
                                           include_all_metadata=True)
    assert client.auth_test()["bot_id"] == slack_api.bot_id
    assert replies["messages"][0]["text"] == "hello"
    assert slack_api.problems == []
