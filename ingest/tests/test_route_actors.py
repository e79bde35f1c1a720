"""Who may trigger work (docs/work-control.md#who-may-trigger-work): a route's ``actors`` and
``author_associations``, checked against real signed deliveries through the hook; a delivery
whose actor qualifies for no route creates nothing and is logged ``filtered``."""

import pytest
from django.core.exceptions import ValidationError
from django.test import Client

from ingest import actors, senders, transitions
from ingest.models import DeliveryRecord, Outcome, Route
from tests.cli import run_manage
from tests.factories import EndpointFactory
from todos.models import Todo

from .conftest import SECRETS
from .test_views import deliver

pytestmark = pytest.mark.django_db


def github_issue(login, association, *, author=None, action="opened"):
    return {"action": action, "sender": {"login": login},
            "issue": {"number": 12, "title": "Run the migration", "author_association": association,
                      "user": {"login": author or login}},
            "repository": {"full_name": "octo/repo"}}


def github_comment(login, association):
    return {"action": "created", "sender": {"login": login},
            "comment": {"body": "@agent please fix", "author_association": association,
                        "user": {"login": login}},
            "issue": {"number": 12, "title": "Bug", "author_association": "OWNER",
                      "user": {"login": "octocat"}},
            "repository": {"full_name": "octo/repo"}}


@pytest.fixture
def trusted_hook(make_webhook, endpoint):
    def make(source="github", **rules):
        webhook = make_webhook(source, routes=[])
        transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="inbox", **rules)
        return webhook
    return make


def last_record(webhook):
    return DeliveryRecord.objects.filter(webhook=webhook).order_by("-id").first()


def test_a_github_outsider_creates_nothing_and_is_logged_filtered(trusted_hook):
    webhook = trusted_hook(author_associations=["OWNER", "MEMBER", "COLLABORATOR"])
    answer = deliver(webhook, github_issue("stranger", "NONE"))
    assert answer.status_code == 202, answer.content
    assert answer.json()["todos"] == []
    assert not Todo.objects.exists()
    record = last_record(webhook)
    assert record.outcome == Outcome.FILTERED
    assert "stranger" in record.reason and "agent/inbox" in record.reason


def test_a_github_member_creates_the_todo(trusted_hook):
    webhook = trusted_hook(author_associations=["OWNER", "MEMBER", "COLLABORATOR"])
    answer = deliver(webhook, github_issue("teammate", "MEMBER"))
    assert len(answer.json()["todos"]) == 1
    assert last_record(webhook).outcome == Outcome.ACCEPTED


def test_a_comment_counts_the_comment_authors_role_not_the_issues(trusted_hook):
    webhook = trusted_hook(author_associations=["OWNER"])
    # The issue is the owner's, the comment a stranger's: the stranger triggered it.
    answer = deliver(webhook, github_comment("stranger", "NONE"), event="issue_comment")
    assert answer.json()["todos"] == [] and last_record(webhook).outcome == Outcome.FILTERED


def test_a_role_on_an_object_the_sender_did_not_write_does_not_count(trusted_hook):
    webhook = trusted_hook(author_associations=["OWNER"])
    # Someone labels the owner's issue: the OWNER association is the issue author's.
    payload = github_issue("stranger", "OWNER", author="octocat", action="labeled")
    assert deliver(webhook, payload).json()["todos"] == []


def test_listed_logins_qualify_case_insensitively_whatever_their_role(trusted_hook):
    webhook = trusted_hook(actors_allowed=["Release-Bot"], author_associations=["OWNER"])
    payload = github_issue("release-bot", "NONE", author="octocat", action="labeled")
    assert len(deliver(webhook, payload).json()["todos"]) == 1


def test_only_the_filtered_route_is_skipped(make_webhook, endpoint, operator):
    other = EndpointFactory(slug="other", owner=operator)
    webhook = make_webhook("github", routes=[])
    transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="inbox",
                                  author_associations=["OWNER"])
    transitions.add_webhook_route(webhook=webhook, endpoint=other, queue="triage")
    todos = deliver(webhook, github_issue("stranger", "NONE")).json()["todos"]
    assert [(t["endpoint"], t["queue"]) for t in todos] == [("other", "triage")]
    record = last_record(webhook)
    assert record.outcome == Outcome.ACCEPTED and "filtered stranger" in record.reason


def test_gitea_counts_the_senders_repository_permissions_on_comments(trusted_hook):
    webhook = trusted_hook("gitea", author_associations=["OWNER", "COLLABORATOR"])
    base = {"action": "created", "comment": {"body": "go"}, "issue": {"number": 3, "title": "x"}}
    pusher = {**base, "sender": {"login": "dev", "username": "dev"},
              "repository": {"full_name": "o/r", "permissions": {"admin": False, "push": True,
                                                                 "pull": True}}}
    reader = {**base, "sender": {"login": "anon"},
              "repository": {"full_name": "o/r", "permissions": {"admin": False, "push": False,
                                                                 "pull": True}}}
    assert len(deliver(webhook, pusher, event="issue_comment").json()["todos"]) == 1
    assert deliver(webhook, reader, event="issue_comment").json()["todos"] == []
    assert last_record(webhook).outcome == Outcome.FILTERED


def test_gitea_permissions_on_a_close_are_the_posters_and_do_not_count(trusted_hook):
    webhook = trusted_hook("gitea", author_associations=["OWNER"])
    closed = {"action": "closed", "sender": {"login": "anon"}, "issue": {"number": 3, "title": "x"},
              "repository": {"full_name": "o/r", "permissions": {"admin": True}}}
    assert deliver(webhook, closed).json()["todos"] == []


def test_gitlab_trusts_listed_usernames(trusted_hook):
    webhook = trusted_hook("gitlab", actors_allowed=["maintainer"])
    mr = {"object_kind": "merge_request", "project": {"path_with_namespace": "grp/proj"},
          "object_attributes": {"iid": 7, "title": "Fix it", "action": "open"}}
    assert len(deliver(webhook, {**mr, "user": {"username": "maintainer"}}).json()["todos"]) == 1
    assert deliver(webhook, {**mr, "user": {"username": "someone"}}).json()["todos"] == []
    assert last_record(webhook).outcome == Outcome.FILTERED


def test_a_payload_without_an_actor_qualifies_for_no_filtered_route(trusted_hook):
    webhook = trusted_hook(actors_allowed=["octocat"])
    assert deliver(webhook, {"action": "opened", "issue": {"number": 1, "title": "x"},
                             "repository": {"full_name": "o/r"}}).json()["todos"] == []


@pytest.mark.parametrize("source,rules,field", [
    ("gitlab", {"author_associations": ["OWNER"]}, "author_associations"),  # GitLab has no roles
    ("stripe", {"actors_allowed": ["someone"]}, "actors"),
    ("github", {"author_associations": ["BOSS"]}, "author_associations"),
    ("github", {"actors_allowed": ["two words"]}, "actors"),
])
def test_rules_that_cannot_apply_are_refused_naming_the_field(make_webhook, endpoint, source,
                                                              rules, field):
    webhook = make_webhook(source, routes=[])
    with pytest.raises(ValidationError) as refused:
        transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="inbox", **rules)
    assert field in refused.value.message_dict
    assert not Route.objects.filter(webhook=webhook).exists()


def test_add_webhook_route_command_takes_actors_and_roles(capsys, make_webhook, endpoint):
    webhook = make_webhook("github", routes=[])
    run = run_manage(capsys, "add_webhook_route", webhook.slug, endpoint.slug, "--queue", "inbox",
                     "--actors", "alice,bob", "--author-association", "owner,MEMBER", "--json")
    assert run.code == 0, run.err
    assert run.json() == {"webhook": webhook.slug, "endpoint": endpoint.slug, "queue": "inbox",
                          "priority": 0, "delay_seconds": 0, "requires_approval": False,
                          "write_back": "status", "agent_permissions": {},
                          "follow_ups": "coalesce", "thread_key": "",
                          "stop": ["issues.closed", "pull_request.closed"]}
    route = Route.objects.get(webhook=webhook)
    assert (route.actors, route.author_associations) == (["alice", "bob"], ["MEMBER", "OWNER"])
    run = run_manage(capsys, "add_webhook_route", webhook.slug, endpoint.slug, "--queue", "other",
                     "--author-association", "BOSS")
    assert run.code != 0 and "--author-association:" in run.err  # names the flag


@pytest.mark.parametrize("flag", ["--actors", "--author-association"])
@pytest.mark.parametrize("value", ["", " , "])
def test_an_empty_actor_rule_is_refused_not_taken_as_anyone(capsys, make_webhook, endpoint, flag,
                                                              value):
    webhook = make_webhook("github", routes=[])
    run = run_manage(capsys, "add_webhook_route", webhook.slug, endpoint.slug, "--queue", "inbox",
                     flag, value)
    assert run.code != 0 and f"{flag} is empty" in run.err
    assert not Route.objects.filter(webhook=webhook).exists()


def test_the_webhook_page_shows_the_rule_and_the_filtered_outcome(trusted_hook, operator):
    webhook = trusted_hook(author_associations=["OWNER"])
    deliver(webhook, github_issue("stranger", "NONE"))
    browser = Client()
    browser.force_login(operator)
    page = browser.get(f"/todos/webhooks/{webhook.slug}/").content.decode()
    assert "only from OWNER" in page
    assert 'data-outcome="filtered"' in page and "filtered stranger" in page


def test_event_actor_reads_each_source():
    assert senders.event_actor("github", "pull_request_review.submitted", {
        "sender": {"login": "a"}, "review": {"author_association": "collaborator",
                                             "user": {"login": "A"}},
        "pull_request": {"author_association": "NONE", "user": {"login": "b"}},
    }) == actors.Actor("a", frozenset({"COLLABORATOR"}))
    assert senders.event_actor("gitlab", "push", {"user_username": "pusher"}).login == "pusher"
    assert senders.event_actor("github", "push", "not a dict") == actors.Actor("")
