"""Linear, Slack and Sentry deliveries through the real ASGI app (hook_client): each verified as
its sender signs, titled and kinded per source, refused as the others are, logged, redelivered.
Payloads follow each vendor's documented examples (Sentry's sample ``issue`` payload is
Sentry's own; Linear and Slack publish field lists, and their shapes are followed here)."""

import json
import time

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

from ingest import queries, transitions
from ingest.models import DeliveryEvent, DeliveryRecord, Outcome, Webhook
from ingest.tests import signing
from ingest.tests.conftest import SECRETS
from ingest.tests.test_views import post_hook
from todos import transitions as todo_transitions
from todos.models import Todo

pytestmark = pytest.mark.django_db

LINEAR_ISSUE = {
    "action": "create", "type": "Issue", "createdAt": "2026-12-02T12:00:00.000Z",
    "actor": {"id": "u-1", "name": "Ana", "type": "user"},
    "data": {"id": "iss-1", "identifier": "ENG-12", "number": 12, "title": "Fix login",
             "team": {"key": "ENG"}},
    "url": "https://linear.app/acme/issue/ENG-12/fix-login",
    "organizationId": "org-1", "webhookId": "wh-1",
}
LINEAR_AGENT_SESSION = {
    "action": "created", "type": "AgentSessionEvent", "organizationId": "org-1",
    "agentSession": {"id": "ses-1", "issue": {"id": "iss-1", "identifier": "ENG-12",
                                              "title": "Fix login"},
                     "comment": {"body": "@agent please take this"}},
    "promptContext": "<issue identifier=\"ENG-12\">…</issue>",
}
SLACK_MENTION = {
    "token": "XXYYZZ", "team_id": "T123ABC", "api_app_id": "A123ABC",
    "event": {"type": "app_mention", "user": "U061F7AUR", "channel": "C0LAN2Q65",
              "text": "<@U0LAN0Z89> please fix the login bug", "ts": "1515449522.000016"},
    "type": "event_callback", "event_id": "Ev0LAN670R", "event_time": 1515449522,
}
SLACK_URL_VERIFICATION = {"token": "Jhj5dZrVaK7ZwHHjRyZWjbDl", "type": "url_verification",
                          "challenge": "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P"}
# Sentry's documented sample of an issue webhook ("Issues", integration platform webhooks).
SENTRY_ISSUE = {
    "action": "created",
    "actor": {"id": "sentry", "name": "Sentry", "type": "application"},
    "data": {"issue": {
        "annotations": [], "assignedTo": None, "count": "1", "culprit": "?(runner)",
        "firstSeen": "2019-08-19T20:58:37.391000Z", "hasSeen": False, "id": "1170820242",
        "isBookmarked": False, "isPublic": False, "isSubscribed": False,
        "lastSeen": "2019-08-19T20:58:37.391000Z", "level": "error", "logger": None,
        "metadata": {"filename": "/runner", "type": "ReferenceError",
                     "value": "blooopy is not defined"},
        "numComments": 0, "permalink": None, "platform": "javascript",
        "project": {"id": "1", "name": "front-end", "platform": "", "slug": "front-end"},
        "shareId": None, "shortId": "FRONT-END-9", "status": "unresolved", "statusDetails": {},
        "subscriptionDetails": None, "title": "ReferenceError: blooopy is not defined",
        "type": "error", "userCount": 1,
    }},
    "installation": {"uuid": "a8e5d37a-696c-4c54-adb5-b3f28d64c7de"},
}


def body_for(source, payload) -> bytes:
    return signing.linear_body(payload) if source == "linear" else signing.body_of(payload)


def send(webhook, payload=None, *, body=None, meta=None, **signer):
    body = body if body is not None else body_for(webhook.source, payload)
    meta = meta if meta is not None else signing.SIGNERS[webhook.source](
        SECRETS[webhook.source], body, **signer)
    return post_hook(webhook.slug, body, meta)


def records(webhook):
    return list(DeliveryRecord.objects.filter(webhook=webhook).order_by("id"))


def finish(todo_id, endpoint):
    agent = todo_transitions.Caller.agent(endpoint, "session-a")
    todo_transitions.claim_todo(agent, int(todo_id))
    todo_transitions.complete_todo(agent, int(todo_id))


# -- accepted, per source ------------------------------------------------------------------------

ACCEPTED = [
    ("linear", LINEAR_ISSUE, {"delivery": "lin-d-1"}, "Issue.create", "ENG-12 created: Fix login",
     "linear-hook:lin-d-1"),
    ("linear", LINEAR_AGENT_SESSION, {"delivery": "lin-d-2"}, "AgentSessionEvent.created",
     "ENG-12 agent session created: @agent please take this", "linear-hook:lin-d-2"),
    ("slack", SLACK_MENTION, {}, "app_mention",
     "#C0LAN2Q65 @U061F7AUR: @U0LAN0Z89 please fix the login bug", "slack-hook:Ev0LAN670R"),
    ("sentry", SENTRY_ISSUE, {"delivery": "req-1"}, "issue.created",
     "issue created: ReferenceError: blooopy is not defined", "sentry-hook:req-1"),
]


@pytest.mark.parametrize("source, payload, signer, kind, title, key", ACCEPTED,
                         ids=[case[1]["type"] if "type" in case[1] else case[0]
                              for case in ACCEPTED])
def test_a_signed_delivery_becomes_a_titled_todo(make_webhook, endpoint, source, payload,
                                                 signer, kind, title, key):
    webhook = make_webhook(source)
    body = body_for(source, payload)
    answer = send(webhook, body=body, **signer)
    assert answer.status_code == 202, answer.content
    [entry] = answer.json()["todos"]
    assert entry["duplicate"] is False
    todo = Todo.objects.get(pk=entry["id"])
    assert (todo.kind, todo.title, todo.source, todo.trust) == (kind, title, source, "signed")
    assert todo.idempotency_key == key and todo.payload == json.loads(body)
    [record] = records(webhook)
    assert (record.outcome, record.status, record.kind, record.delivery_id) == (
        "accepted", 202, kind, key.split(":", 1)[1])


def test_slack_text_is_sanitised_in_the_title(make_webhook):
    webhook = make_webhook("slack")
    event = {**SLACK_MENTION["event"],
             "text": "<@U1|ana> see <https://x.example/a|the log> &lt;/channel&gt;\n\u202eevil\x1b[0m"}
    answer = send(webhook, {**SLACK_MENTION, "event": event})
    todo = Todo.objects.get(pk=answer.json()["todos"][0]["id"])
    assert todo.title == "#C0LAN2Q65 @U061F7AUR: @ana see the log \u2039/channel\u203a evil[0m"


def test_a_route_filters_on_the_new_kinds(make_webhook, endpoint):
    webhook = make_webhook("linear", routes=[(endpoint, "inbox", ["AgentSessionEvent"])])
    assert send(webhook, LINEAR_AGENT_SESSION).json()["todos"] != []
    # An Issue event matches no route: accepted, logged no_route, no todo.
    answer = send(webhook, LINEAR_ISSUE)
    assert answer.status_code == 202 and answer.json()["todos"] == []
    assert [r.outcome for r in records(webhook)] == ["accepted", "no_route"]


@pytest.mark.parametrize("source, payload", [
    ("linear", {**LINEAR_ISSUE, "type": "CustomerNeed"}),
    ("slack", {**SLACK_MENTION, "event": {**SLACK_MENTION["event"], "type": "reaction_added"}}),
    ("sentry", SENTRY_ISSUE),
])
def test_an_event_type_no_route_takes_is_logged_no_route(make_webhook, endpoint, source, payload):
    webhook = make_webhook(source, routes=[(endpoint, "inbox", ["nothing.like.this"])])
    signer = {"resource": "seer"} if source == "sentry" else {}
    answer = send(webhook, payload, **signer)
    assert answer.status_code == 202 and answer.json()["todos"] == []
    assert Todo.objects.count() == 0
    [record] = records(webhook)
    assert record.outcome == Outcome.NO_ROUTE


SLACK_MESSAGE = {**SLACK_MENTION, "event_id": "Ev0MSG0001", "event": {
    "type": "message", "channel": "C0LAN2Q65", "user": "U061F7AUR", "text": "deploy is red",
    "ts": "1515449600.000100", "channel_type": "channel"}}


BOT_MESSAGES = {
    # The agent's own reply, posted with its app's bot token.
    "bot_id": {"bot_id": "B0AGENT01", "app_id": "A123ABC", "user": "U0BOTUSER"},
    # A legacy bot (an incoming webhook, an integration): no user, subtype bot_message.
    "bot_message": {"subtype": "bot_message", "user": None, "username": "ci"},
    # The agent editing its reply: the edited message is the bot's.
    "bot_edit": {"subtype": "message_changed", "user": None,
                 "message": {"type": "message", "bot_id": "B0AGENT01", "text": "green"}},
    "legacy_bot_edit": {"subtype": "message_changed", "user": None,
                        "message": {"type": "message", "subtype": "bot_message", "text": "x"}},
    # The agent deleting its reply.
    "bot_delete": {"subtype": "message_deleted", "user": None,
                   "previous_message": {"type": "message", "bot_id": "B0AGENT01", "text": "x"}},
}


def slack_message(event_id: str, **event) -> dict:
    return {**SLACK_MESSAGE, "event_id": event_id, "event": {**SLACK_MESSAGE["event"], **event}}


@pytest.mark.parametrize("event", BOT_MESSAGES.values(), ids=BOT_MESSAGES.keys())
def test_a_slack_bots_own_message_makes_no_todo(make_webhook, endpoint, event):
    """An agent that answers in the channel its route listens to must not hand itself its own
    reply as new work (and the reply to that, without end)."""
    webhook = make_webhook("slack", routes=[(endpoint, "inbox", ["message"])])
    answer = send(webhook, slack_message("Ev0MSG0001", **event))
    assert answer.status_code == 202 and answer.json()["todos"] == []
    assert Todo.objects.count() == 0
    [record] = records(webhook)
    assert record.outcome == Outcome.FILTERED
    assert record.reason.endswith(f"(a bot's message) on {endpoint.slug}/inbox")
    # A person's message, a person's edit and a person's reply in a thread (its own event,
    # with its own user, beside the thread notice) on the same route are work.
    for event_id, human in (("Ev0MSG0002", {}),
                            ("Ev0MSG0003", {"subtype": "message_changed", "user": None,
                                            "message": {"type": "message", "user": "U061F7AUR",
                                                        "text": "deploy is red again"}}),
                            ("Ev0MSG0004", {"thread_ts": "1515449000.000001",
                                            "parent_user_id": "U0BOTUSER"})):
        answer = send(webhook, slack_message(event_id, **human))
        assert answer.status_code == 202 and len(answer.json()["todos"]) == 1


# Slack's notices about a thread: a message event with no author of its own, carrying the
# thread's first message (U0ALICE's), sent when somebody else (U0MALLORY) replies in it.
THREAD_NOTICES = {
    "message_replied": {"subtype": "message_replied", "hidden": True, "user": None,
                        "message": {"type": "message", "user": "U0ALICE", "text": "the ask",
                                    "thread_ts": "1515449000.000001", "reply_count": 1,
                                    "replies": [{"user": "U0MALLORY", "ts": "1515449600.1"}]}},
    # A reply in the thread of the agent's own message (the notice carries the bot's).
    "bot_thread_notice": {"subtype": "message_replied", "hidden": True, "user": None,
                          "message": {"type": "message", "bot_id": "B0AGENT01",
                                      "user": "U0BOTUSER", "text": "x", "reply_count": 1}},
    "hidden_without_subtype": {"hidden": True, "user": None,
                               "message": {"type": "message", "user": "U0ALICE",
                                           "text": "the ask", "reply_count": 1}},
    "reply_metadata_change": {
        "subtype": "message_changed", "hidden": True, "user": None,
        "message": {"type": "message", "user": "U0ALICE", "text": "the ask", "reply_count": 2,
                    "reply_users": ["U0MALLORY"], "latest_reply": "1515449600.2"},
        "previous_message": {"type": "message", "user": "U0ALICE", "text": "the ask",
                             "reply_count": 1, "reply_users": ["U0MALLORY"],
                             "latest_reply": "1515449600.1"}},
}


@pytest.mark.parametrize("notice", THREAD_NOTICES.values(), ids=THREAD_NOTICES.keys())
def test_a_slack_thread_notice_is_nobodys_message_and_makes_no_work_unless_a_route_opts_in(
        make_webhook, endpoint, notice):
    """A reply's notice carries the thread's first message: it is not that author's new
    message, so it makes no work on a route for every message, never passes an actor rule as
    the thread's author, and reaches only a route that names its kind."""
    webhook = make_webhook("slack", routes=[(endpoint, "inbox", ["message"])])
    transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="alice",
                                  kinds=["message", "message.thread_notice"],
                                  actors_allowed=["U0ALICE"])
    answer = send(webhook, slack_message("Ev0NOTE001", **notice))
    assert answer.status_code == 202 and answer.json()["todos"] == [], answer.content
    [record] = records(webhook)
    assert (record.outcome, record.kind) == (Outcome.FILTERED, "message.thread_notice")
    # A route that opts in takes it, as nobody's: it is only a notice.
    transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="threads",
                                  kinds=["message.thread_notice"])
    answer = send(webhook, slack_message("Ev0NOTE002", **notice))
    assert [todo["queue"] for todo in answer.json()["todos"]] == ["threads"]
    assert Todo.objects.get().kind == "message.thread_notice"
    # A person's edit (Slack marks it hidden too) is still the edited message's author's.
    edit = send(webhook, slack_message("Ev0EDIT001", subtype="message_changed", hidden=True,
                                       user=None, message={"type": "message", "user": "U0ALICE",
                                                           "text": "the ask, edited"},
                                       previous_message={"type": "message", "user": "U0ALICE",
                                                         "text": "the ask"}))
    assert sorted(todo["queue"] for todo in edit.json()["todos"]) == ["alice", "inbox"]


def test_a_slack_route_takes_a_bot_it_lists_and_only_the_users_it_lists(
        make_webhook, endpoint, capsys):
    """An alerting bot whose posts are work is listed by its id; --actors on a Slack route
    also narrows people to the user ids listed (anyone in a shared channel could otherwise
    hand the agent work)."""
    webhook = make_webhook("slack", routes=[])
    call_command("add_webhook_route", webhook.slug, endpoint.slug, "--queue", "inbox",
                 "--kinds", "message", "--actors", "B0DATADOG,U061F7AUR")
    alert = send(webhook, slack_message("Ev0ALERT01", bot_id="B0DATADOG", user=None))
    assert alert.status_code == 202 and len(alert.json()["todos"]) == 1
    listed = send(webhook, slack_message("Ev0MSG0010"))
    assert listed.status_code == 202 and len(listed.json()["todos"]) == 1
    stranger = send(webhook, slack_message("Ev0MSG0011", user="U0STRANGER"))
    assert stranger.status_code == 202 and stranger.json()["todos"] == []
    agent_reply = send(webhook, slack_message("Ev0MSG0012", bot_id="B0AGENT01"))
    assert agent_reply.status_code == 202 and agent_reply.json()["todos"] == []
    assert [(r.outcome, r.reason) for r in records(webhook)][2:] == [
        ("filtered", f"filtered U0STRANGER (no role) on {endpoint.slug}/inbox"),
        ("filtered", f"filtered B0AGENT01 (a bot's message) on {endpoint.slug}/inbox")]
    with pytest.raises(CommandError, match="slack payloads carry no role"):
        call_command("add_webhook_route", webhook.slug, endpoint.slug, "--queue", "inbox",
                     "--author-association", "OWNER")


# -- refusals ------------------------------------------------------------------------------------

NEW_SOURCES = ["linear", "slack", "sentry"]
PAYLOADS = {"linear": LINEAR_ISSUE, "slack": SLACK_MENTION, "sentry": SENTRY_ISSUE}
SIGNATURE_HEADER = {"linear": "HTTP_LINEAR_SIGNATURE", "slack": "HTTP_X_SLACK_SIGNATURE",
                    "sentry": "HTTP_SENTRY_HOOK_SIGNATURE"}


def refused_once(webhook, answer, status, outcome):
    assert answer.status_code == status, answer.content
    if status == 401:  # the sender reads the code the delivery log keeps
        assert answer.json()["error"]["code"] == outcome
    assert Todo.objects.count() == 0 and DeliveryEvent.objects.count() == 0
    [record] = records(webhook)
    assert (record.outcome, record.status) == (outcome, status)
    return record


@pytest.mark.parametrize("source", NEW_SOURCES)
def test_a_wrong_signature_is_401_bad_signature(make_webhook, source):
    webhook = make_webhook(source)
    body = body_for(source, PAYLOADS[source])
    meta = signing.SIGNERS[source]("not-the-secret-0123456789", body)
    record = refused_once(webhook, send(webhook, body=body, meta=meta), 401, "bad_signature")
    assert "mismatch" in record.reason


@pytest.mark.parametrize("source", NEW_SOURCES)
def test_a_missing_signature_header_is_401(make_webhook, source):
    webhook = make_webhook(source)
    body = body_for(source, PAYLOADS[source])
    meta = signing.SIGNERS[source](SECRETS[source], body)
    del meta[SIGNATURE_HEADER[source]]
    answer = send(webhook, body=body, meta=meta)
    record = refused_once(webhook, answer, 401, "bad_signature")
    assert "missing" in answer.json()["error"]["message"] and "missing" in record.reason


@pytest.mark.parametrize("source", NEW_SOURCES)
def test_signed_malformed_json_is_400_malformed(make_webhook, source):
    webhook = make_webhook(source)
    body = b'{"type": "Issue", "action": "create", '
    answer = send(webhook, body=body)
    refused_once(webhook, answer, 400, "malformed")
    assert answer.json()["error"]["code"] == "malformed_body"


@pytest.mark.parametrize("skew_ms", [-120_000, 120_000])
def test_linear_stale_body_timestamp_is_401_stale_timestamp(make_webhook, frozen_now, skew_ms):
    webhook = make_webhook("linear")
    body = signing.linear_body(LINEAR_ISSUE, at_ms=int(frozen_now.timestamp()) * 1000 + skew_ms)
    answer = send(webhook, body=body)
    refused_once(webhook, answer, 401, "stale_timestamp")
    assert "60 s" in answer.json()["error"]["message"]


# JSON integers have no size limit: 10**400 parses, and dividing it by 1000 overflowed a float.
@pytest.mark.parametrize("stamp", ["1" + "0" * 400, "-1", "9007199254740992", "1e300"])
def test_a_linear_timestamp_out_of_range_is_400_naming_the_field(make_webhook, stamp):
    webhook = make_webhook("linear")
    body = json.dumps(LINEAR_ISSUE)[:-1].encode() + f', "webhookTimestamp": {stamp}}}'.encode()
    answer = send(webhook, body=body)
    assert answer.status_code == 400, answer.content
    assert answer.json()["error"]["code"] == "bad_timestamp"
    assert "webhookTimestamp" in answer.json()["error"]["message"]
    record = refused_once(webhook, answer, 400, "malformed")
    assert "webhookTimestamp" in record.reason


def test_linear_body_without_its_timestamp_is_401(make_webhook):
    webhook = make_webhook("linear")
    answer = send(webhook, body=signing.body_of(LINEAR_ISSUE))
    refused_once(webhook, answer, 401, "bad_signature")
    assert "webhookTimestamp" in answer.json()["error"]["message"]


@pytest.mark.parametrize("skew", [-301, 301])
def test_slack_stale_request_timestamp_is_401_stale_timestamp(make_webhook, frozen_now, skew):
    webhook = make_webhook("slack")
    answer = send(webhook, SLACK_MENTION, timestamp=int(frozen_now.timestamp()) + skew)
    refused_once(webhook, answer, 401, "stale_timestamp")


def test_a_stale_linear_request_spends_the_senders_failure_budget_not_the_webhooks(
        make_webhook, settings):
    settings.SWITCHBOARD_INGEST_RATE_PER_MINUTE = 2
    settings.SWITCHBOARD_INGEST_FAILURES_PER_MINUTE = 1000
    webhook = make_webhook("linear")
    stale = signing.linear_body(LINEAR_ISSUE, at_ms=int(time.time() * 1000) - 120_000)
    for _ in range(5):
        assert send(webhook, body=stale).status_code == 401
    # The webhook's own budget (2 a minute) is untouched by the five refusals.
    assert send(webhook, LINEAR_ISSUE).status_code == 202
    assert send(webhook, {**LINEAR_ISSUE, "n": 2}).status_code == 202


# -- Slack: the url_verification handshake and retries -------------------------------------------


def test_slack_url_verification_is_answered_with_its_challenge_and_logged(make_webhook):
    webhook = make_webhook("slack")
    answer = send(webhook, SLACK_URL_VERIFICATION)
    assert answer.status_code == 200, answer.content
    assert answer.json() == {"challenge": SLACK_URL_VERIFICATION["challenge"]}
    assert Todo.objects.count() == 0 and DeliveryEvent.objects.count() == 0
    [record] = records(webhook)
    assert (record.outcome, record.status, record.kind, record.delivery_event_id) == (
        "accepted", 200, "url_verification", None)
    assert "challenge answered" in record.reason
    # Nothing to redeliver: it made no todo.
    with pytest.raises(ValueError):
        transitions.redeliver(record, operator=webhook.owner, routes=[])


def test_slack_url_verification_needs_a_valid_signature(make_webhook):
    webhook = make_webhook("slack")
    body = signing.body_of(SLACK_URL_VERIFICATION)
    answer = send(webhook, body=body, meta=signing.slack("not-the-secret-0123456789", body))
    assert answer.status_code == 401
    assert SLACK_URL_VERIFICATION["challenge"].encode() not in answer.content


@pytest.mark.parametrize("challenge", [None, "", 7, "x" * 201, "a\nb"])
def test_slack_url_verification_without_a_usable_challenge_is_400(make_webhook, challenge):
    webhook = make_webhook("slack")
    answer = send(webhook, {**SLACK_URL_VERIFICATION, "challenge": challenge})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "malformed_body"


def test_a_slack_retry_of_a_live_todo_is_a_duplicate(make_webhook, endpoint):
    webhook = make_webhook("slack")
    body = signing.body_of(SLACK_MENTION)
    stamp = int(time.time())
    first = send(webhook, body=body, timestamp=stamp - 4)
    (todo,) = first.json()["todos"]
    # Slack retries an unanswered request with a fresh timestamp and signature, same event_id.
    retry = send(webhook, body=body, timestamp=stamp, retry=1, retry_reason="http_timeout")
    assert retry.status_code == 202
    assert retry.json()["todos"] == [{**todo, "duplicate": True}]
    assert Todo.objects.count() == 1
    duplicate = records(webhook)[-1]
    assert (duplicate.outcome, duplicate.reason) == ("duplicate", "slack retry 1 (http_timeout)")
    # The accepted request again, byte for byte (same timestamp and signature): a duplicate,
    # even once the todo is done.
    finish(todo["id"], endpoint)
    again = send(webhook, body=body, timestamp=stamp - 4)
    assert again.status_code == 202 and again.json()["todos"][0]["duplicate"] is True
    assert Todo.objects.count() == 1


# -- replays and redeliveries --------------------------------------------------------------------


def test_a_linear_body_under_another_delivery_id_is_a_replay(make_webhook):
    webhook = make_webhook("linear")
    body = signing.linear_body(LINEAR_ISSUE)
    assert send(webhook, body=body, delivery="lin-1").status_code == 202
    replay = send(webhook, body=body, delivery="lin-2")
    assert replay.status_code == 409 and replay.json()["error"]["code"] == "replay"
    # The same request again (same delivery id): a duplicate, never a second todo.
    again = send(webhook, body=body, delivery="lin-1")
    assert again.status_code == 202 and again.json()["todos"][0]["duplicate"] is True
    assert Todo.objects.count() == 1


def test_a_sentry_redelivery_with_its_request_id_returns_the_live_todo(make_webhook):
    webhook = make_webhook("sentry")
    first = send(webhook, SENTRY_ISSUE, delivery="req-9").json()["todos"][0]
    again = send(webhook, SENTRY_ISSUE, delivery="req-9")
    assert again.json()["todos"] == [{**first, "duplicate": True}]
    assert Todo.objects.get().idempotency_key == "sentry-hook:req-9"


@pytest.mark.parametrize("source", NEW_SOURCES)
def test_an_accepted_delivery_is_redelivered_by_an_operator(make_webhook, source):
    webhook = make_webhook(source)
    send(webhook, PAYLOADS[source])
    [record] = records(webhook)
    _, routes = queries.find_webhook_with_routes(webhook.slug)
    arrival = transitions.redeliver(record, operator=webhook.owner, routes=routes)
    [(todo, created)] = arrival.todos
    original = Todo.objects.exclude(pk=todo.pk).get()
    assert created and todo.trust == original.trust == "signed"  # a redelivery keeps its trust
    assert (todo.title, todo.kind, todo.payload) == (original.title, original.kind,
                                                     original.payload)
    assert arrival.record.pk != record.pk


@pytest.mark.parametrize("source", NEW_SOURCES)
def test_the_previous_secret_verifies_during_rotation(make_webhook, source):
    webhook = make_webhook(source)
    new = transitions.rotate_webhook_secret(webhook, secret=f"{source}-rotated-secret-0123456789")
    assert send(webhook, PAYLOADS[source]).status_code == 202  # signed with the old secret
    body = body_for(source, {**PAYLOADS[source], "n": 2})
    answer = send(webhook, body=body, meta=signing.SIGNERS[source](new, body))
    assert answer.status_code == 202
    transitions.drop_previous_webhook_secrets(Webhook.objects.filter(pk=webhook.pk))
    body = body_for(source, {**PAYLOADS[source], "n": 3})
    assert send(webhook, body=body).status_code == 401


# -- commands ------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", NEW_SOURCES)
def test_add_webhook_takes_the_new_sources_with_the_senders_secret(operator, capsys, source):
    secret = f"{source}-vendor-secret-0123456789"
    call_command("add_webhook", f"{source}-cmd", "--owner", operator.username, "--source", source,
                 "--secret", secret, "--json")
    printed = json.loads(capsys.readouterr().out)
    assert printed["secret"] == secret and printed["hook_url"].endswith(f"/hooks/{source}-cmd")
    webhook = Webhook.objects.get(slug=f"{source}-cmd")
    assert (webhook.source, webhook.secret) == (source, secret)


def test_rotate_webhook_secret_installs_the_senders_new_secret(make_webhook, capsys):
    webhook = make_webhook("slack")
    call_command("rotate_webhook_secret", webhook.slug, "--secret",
                 "slack-regenerated-secret-0123456789", "--json")
    assert json.loads(capsys.readouterr().out)["secret"] == "slack-regenerated-secret-0123456789"
    webhook.refresh_from_db()
    assert (webhook.secret, webhook.previous_secret) == ("slack-regenerated-secret-0123456789",
                                                         SECRETS["slack"])


@pytest.mark.parametrize("source", NEW_SOURCES)
def test_rotate_webhook_secret_will_not_mint_a_secret_the_sender_cannot_use(make_webhook, source):
    webhook = make_webhook(source)
    with pytest.raises(CommandError, match="--secret"):
        call_command("rotate_webhook_secret", webhook.slug)
    webhook.refresh_from_db()
    assert (webhook.secret, webhook.previous_secret) == (SECRETS[source], "")


@override_settings(SWITCHBOARD_INGEST_RATE_PER_MINUTE=1000)
def test_hook_query_count_is_pinned_for_the_new_sources(make_webhook, django_assert_num_queries):
    """As for every source: the lookup, then the delivery (one statement on PostgreSQL inside
    the test's savepoint), then the doorbell's read — nothing else before the answer."""
    from django.db import connection

    for source in NEW_SOURCES:
        webhook = make_webhook(source)
        body = body_for(source, PAYLOADS[source])
        meta = signing.SIGNERS[source](SECRETS[source], body)
        with django_assert_num_queries(4 if connection.vendor == "postgresql" else 10):
            assert post_hook(webhook.slug, body, meta).status_code == 202
