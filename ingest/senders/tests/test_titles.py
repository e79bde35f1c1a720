"""Kinds and one-line titles per source and common event."""

import pytest

from ingest import senders

REPO = {"repository": {"full_name": "octo/repo"}}


@pytest.mark.parametrize("source, event, payload, kind, title", [
    ("github", "issues", {**REPO, "action": "opened", "issue": {"number": 12, "title": "Crash"}},
     "issues.opened", "octo/repo#12 opened: Crash"),
    ("github", "pull_request", {**REPO, "action": "closed", "number": 5,
                                "pull_request": {"number": 5, "title": "Add\nthing"}},
     "pull_request.closed", "octo/repo#5 pull request closed: Add thing"),
    ("github", "push", {**REPO, "ref": "refs/heads/main", "pusher": {"name": "ana"},
                        "commits": [{}, {}]},
     "push", "octo/repo: ana pushed 2 commits to main"),
    ("github", "issue_comment", {**REPO, "action": "created", "issue": {"number": 3, "title": "Q"},
                                 "comment": {"user": {"login": "bo"}}},
     "issue_comment.created", "octo/repo#3 comment created by bo: Q"),
    ("github", "check_run", {**REPO, "action": "completed",
                             "check_run": {"name": "ci", "conclusion": "failure"}},
     "check_run.completed", "octo/repo check ci completed: failure"),
    ("gitea", "issues", {**REPO, "action": "opened", "issue": {"number": 1, "title": "Hi"}},
     "issues.opened", "octo/repo#1 opened: Hi"),
    ("gitea", "push", {**REPO, "ref": "refs/heads/dev", "pusher": {"login": "cy"},
                       "commits": [{}]},
     "push", "octo/repo: cy pushed 1 commit to dev"),
    ("gitlab", "Issue Hook", {"project": {"path_with_namespace": "g/p"},
                              "object_attributes": {"iid": 4, "title": "Bug", "action": "open"}},
     "issue.open", "g/p#4 open: Bug"),
    ("gitlab", "Push Hook", {"project": {"path_with_namespace": "g/p"}, "ref": "refs/heads/main",
                             "user_username": "di", "total_commits_count": 3},
     "push", "g/p: di pushed 3 commits to main"),
    ("stripe", "", {"type": "invoice.paid", "data": {"object": {"id": "in_1"}}},
     "invoice.paid", "Stripe invoice.paid: in_1"),
    ("standard", "", {"type": "user.created"}, "user.created", "hook: user.created"),
    ("standard", "", {"no": "type"}, "", "hook: delivery"),
])
def test_kind_and_title(source, event, payload, kind, title):
    assert senders.derive_kind(source, event, payload) == kind
    assert senders.derive_title(source, kind, payload, webhook_slug="hook") == title


@pytest.mark.parametrize("payload", [{}, {"issue": "not a dict"}, {"repository": [1]},
                                     {"commits": "x", "pusher": None, "action": 7}])
def test_odd_payloads_still_get_a_title(payload):
    for source, event in [("github", "issues"), ("github", "push"), ("gitlab", "Merge Request Hook"),
                          ("stripe", "")]:
        kind = senders.derive_kind(source, event, payload)
        title = senders.derive_title(source, kind, payload, webhook_slug="h")
        assert title and "\n" not in title
