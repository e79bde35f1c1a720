"""Thread keys and stops per sender (docs/work-control.md#threads), on the senders' own example
payloads where they publish them (@octokit/webhooks-examples)."""

import pytest

from ingest import threads
from ingest.senders import get_sender
from ingest.tests.github_standin import webhook_example


def key(source, kind, payload):
    return get_sender(source).thread_key(kind, payload)


def ends(source, kind, payload):
    return get_sender(source).ends_thread(kind, payload)


@pytest.mark.parametrize("event, action, expected", [
    ("issues", "opened", "Codertocat/Hello-World#1"),
    ("issue_comment", "created", "Codertocat/Hello-World#1"),
    ("pull_request", "opened", "Codertocat/Hello-World#2"),
    ("pull_request_review", "submitted", "Codertocat/Hello-World#2"),
    ("pull_request_review_comment", "created", "Codertocat/Hello-World#2"),
])
def test_github_keys_an_issue_or_pull_request_and_its_comments_and_reviews(event, action,
                                                                           expected):
    assert key("github", f"{event}.{action}", webhook_example(event, action=action)) == expected


def test_github_check_run_is_threaded_only_when_it_names_one_pull_request():
    run = webhook_example("check_run", action="created")
    assert key("github", "check_run.created", run) == (
        f"Codertocat/Hello-World#{run['check_run']['pull_requests'][0]['number']}")
    run["check_run"]["pull_requests"] = []
    assert key("github", "check_run.created", run) == ""
    assert key("github", "push", webhook_example("push")) == ""


def test_github_stops_on_closed_issues_and_pull_requests_merged_or_not():
    closed = webhook_example("pull_request", action="closed")
    assert closed["pull_request"]["merged"] is False and ends("github", "pull_request.closed",
                                                               closed)
    merged = {**closed, "pull_request": {**closed["pull_request"], "merged": True}}
    assert ends("github", "pull_request.closed", merged)
    assert ends("github", "issues.closed", {**webhook_example("issues", action="opened"),
                                            "action": "closed"})
    assert not ends("github", "issues.reopened", webhook_example("issues", action="reopened"))
    assert not ends("github", "issue_comment.created",
                    webhook_example("issue_comment", action="created"))


def test_gitea_keys_issues_pull_requests_and_their_reviews():
    repo = {"full_name": "octo/app"}
    assert key("gitea", "issues.opened", {"issue": {"number": 3}, "repository": repo}) == "octo/app#3"
    assert key("gitea", "issue_comment.created",
               {"issue": {"number": 3}, "repository": repo}) == "octo/app#3"
    assert key("gitea", "pull_request_approved", {"number": 4, "pull_request": {"number": 4},
                                                  "repository": repo}) == "octo/app#4"
    assert key("gitea", "push", {"repository": repo}) == ""
    assert ends("gitea", "pull_request.closed", {}) and ends("gitea", "issues.closed", {})


GITLAB_PROJECT = {"id": 7, "path_with_namespace": "group/app"}


@pytest.mark.parametrize("kind, payload, expected", [
    ("issue.open", {"object_attributes": {"iid": 5}}, "group/app#5"),
    ("merge_request.update", {"object_attributes": {"iid": 9}}, "group/app!9"),
    ("note", {"object_attributes": {"noteable_type": "MergeRequest", "id": 1},
              "merge_request": {"iid": 9}}, "group/app!9"),
    ("note", {"object_attributes": {"noteable_type": "Issue", "id": 1},
              "issue": {"iid": 5}}, "group/app#5"),
    ("note", {"object_attributes": {"noteable_type": "Commit", "id": 1}}, ""),
    ("push", {}, ""),
])
def test_gitlab_keys_issues_with_hash_and_merge_requests_with_bang(kind, payload, expected):
    assert key("gitlab", kind, {**payload, "project": GITLAB_PROJECT}) == expected


def test_gitlab_stops_on_closed_issues_and_closed_or_merged_merge_requests():
    for kind in ("issue.close", "merge_request.close", "merge_request.merge"):
        assert ends("gitlab", kind, {})
    assert not ends("gitlab", "merge_request.reopen", {})


SESSION = {"id": "5f0c9a7e-1111-2222-3333-444455556666", "issue": {"identifier": "ENG-12"}}


def test_linear_keys_an_agent_session_by_its_id_else_the_issue():
    created = {"type": "AgentSessionEvent", "action": "created", "agentSession": SESSION}
    prompted = {**created, "action": "prompted",
                "agentActivity": {"content": {"type": "prompt", "body": "also this"}}}
    assert key("linear", "AgentSessionEvent.created", created) == SESSION["id"]
    assert key("linear", "AgentSessionEvent.prompted", prompted) == SESSION["id"]
    assert key("linear", "Issue.create", {"data": {"identifier": "ENG-12"}}) == "ENG-12"
    assert key("linear", "Comment.create", {"data": {"issue": {"identifier": "ENG-12"}}}) == "ENG-12"
    assert not ends("linear", "AgentSessionEvent.prompted", prompted)
    stop = {**prompted, "agentActivity": {"content": {"type": "prompt", "body": "stop"},
                                          "signal": "stop"}}
    assert ends("linear", "AgentSessionEvent.prompted", stop)


@pytest.mark.parametrize("state, stops", [("completed", True), ("canceled", True),
                                          ("started", False)])
def test_linear_stops_when_the_issue_is_moved_to_a_closed_state(state, stops):
    payload = {"data": {"identifier": "ENG-12", "state": {"type": state}}}
    assert ends("linear", "Issue.update", payload) is stops


def test_slack_keys_a_thread_by_channel_and_its_first_message():
    top = {"event": {"type": "app_mention", "channel": "C1", "ts": "100.1"}}
    reply = {"event": {"type": "message", "channel": "C1", "ts": "100.5", "thread_ts": "100.1"}}
    edit = {"event": {"type": "message", "subtype": "message_changed", "channel": "C1",
                      "message": {"ts": "100.5", "thread_ts": "100.1", "user": "U1"}}}
    assert key("slack", "app_mention", top) == key("slack", "message", reply) == "C1:100.1"
    assert key("slack", "message", edit) == "C1:100.1"
    assert get_sender("slack").ends_thread is None


def test_sentry_keys_the_issue_and_stops_when_it_is_resolved_or_ignored():
    issue = {"action": "created", "data": {"issue": {"id": "1170820242"}}}
    assert key("sentry", "issue.created", issue) == "1170820242"
    assert key("sentry", "event_alert.triggered",
               {"data": {"event": {"issue_id": "1170820242"}}}) == "1170820242"
    assert ends("sentry", "issue.resolved", issue) and ends("sentry", "issue.ignored", issue)
    assert not ends("sentry", "issue.assigned", issue)


@pytest.mark.parametrize("source", ["stripe", "standard", "unsigned"])
def test_sources_without_threads_have_no_key(source):
    assert get_sender(source).thread_key is None


@pytest.mark.parametrize("template, problem", [
    ("{repository.full_name}#{issue.number}", None),
    ("static", "name at least one"),
    ("{a.}", r"\{a\.\} is not a placeholder"),
    ("{issue..number}", r"\{issue\.\.number\} is not a placeholder"),
    ("{a}}", "brace"),
    ("x{a b}", "is not a placeholder"),
    ("{a}{", "brace"),
    ("{a}\n", "printable"),
])
def test_route_templates_are_checked(template, problem):
    if problem is None:
        threads.check_template(template)
    else:
        with pytest.raises(ValueError, match=problem):
            threads.check_template(template)


def test_a_template_takes_payload_fields_and_a_missing_one_gives_no_key():
    payload = {"repository": {"full_name": "o/r"}, "issue": {"number": 7},
               "labels": [{"name": "bug"}], "flag": True}
    assert threads.render_template("{repository.full_name}#{issue.number}", payload) == "o/r#7"
    assert threads.render_template("{labels.0.name}", payload) == "bug"
    assert threads.render_template("{issue.title}", payload) == ""
    assert threads.render_template("{flag}", payload) == ""
    assert threads.render_template("{issue}", payload) == ""


def test_keys_are_cut_and_printable():
    assert threads.clean("a\x00b\n c" + "x" * 400) == ("ab c" + "x" * 400)[:300]
    assert threads.clean("\x00") is None
