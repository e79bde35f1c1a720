"""Write-back to GitLab and to Gitea/Forgejo (docs/write-back.md#gitlab,
docs/write-back.md#gitea-and-forgejo): deliveries shaped as each source sends them, sent to a
stand-in held to the source's published description (ingest/tests/gitlab_standin.py,
gitea_standin.py). The worker is driven by hand (``send_due_write_backs``), as in
test_write_back.py, so every test sees exactly when requests leave.

GitLab's payloads follow its webhook events reference
(https://docs.gitlab.com/user/project/integrations/webhook_events/: issue, merge request and
comment events). Gitea's follow its hook payloads (``IssuePayload``, ``IssueCommentPayload``),
their ``issue``, ``comment``, ``repository`` and ``sender`` built as the models of Gitea's
description, so a field Gitea does not send cannot creep in."""

import json
from dataclasses import dataclass
from datetime import timedelta
from io import StringIO

import httpx
import pytest
from django.core.management import call_command
from django.utils import timezone

from ingest import connections, outbound, write_back
from ingest.models import Connection, DeliveryRecord, WriteBack
from ingest.senders import gitea as gitea_sender
from ingest.senders import gitlab as gitlab_sender
from ingest.tests import hook_client, signing
from ingest.tests.conftest import SECRETS
from ingest.tests.gitea_standin import model
from ingest.tests.test_write_back import assert_a_429_waits_as_said, post_status_then_die
from todos import transitions as todo_transitions
from todos.models import Todo

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def public_url(settings):
    settings.SWITCHBOARD_PUBLIC_URL = "https://sb.example"


# -- payloads as each source sends them ----------------------------------------------------------

GITLAB_PROJECT = {"id": 77, "name": "widgets", "path_with_namespace": "acme/tools/widgets",
                  "web_url": "https://gitlab.example/acme/tools/widgets",
                  "namespace": "tools", "default_branch": "main", "visibility_level": 20}


def gitlab_user(username="alice", user_id=4) -> dict:
    return {"id": user_id, "name": username.title(), "username": username,
            "avatar_url": "https://gitlab.example/avatar.png", "email": "[REDACTED]"}


def gitlab_issue(action="open", iid=12, user=None) -> tuple[str, dict]:
    return "Issue Hook", {
        "object_kind": "issue", "event_type": "issue", "user": user or gitlab_user(),
        "project": dict(GITLAB_PROJECT),
        "object_attributes": {"id": 301, "iid": iid, "title": "Widgets crash on save",
                              "description": "Stack trace attached", "state": "opened",
                              "action": action, "project_id": 77, "author_id": 4,
                              "url": "https://gitlab.example/acme/tools/widgets/-/issues/12"},
        "labels": [], "changes": {}, "repository": {"name": "widgets"}}


def gitlab_merge_request(iid=5) -> tuple[str, dict]:
    return "Merge Request Hook", {
        "object_kind": "merge_request", "event_type": "merge_request", "user": gitlab_user(),
        "project": dict(GITLAB_PROJECT),
        "object_attributes": {"id": 99, "iid": iid, "title": "Fix the crash", "state": "opened",
                              "action": "open", "source_branch": "fix", "target_branch": "main",
                              "target_project_id": 77},
        "labels": [], "changes": {}, "repository": {"name": "widgets"}}


def gitlab_note(noteable_type="Issue", note_id=1244, user=None, body="please look") -> tuple:
    subject = ({"issue": {"id": 301, "iid": 12, "title": "Widgets crash on save"}}
               if noteable_type == "Issue" else
               {"merge_request": {"id": 99, "iid": 5, "title": "Fix the crash"}}
               if noteable_type == "MergeRequest" else
               {"commit": {"id": "cfe32cf61b73a0d5e9f13e774abde7ff789b1660"}})
    return "Note Hook", {
        "object_kind": "note", "event_type": "note", "user": user or gitlab_user(),
        "project_id": 77, "project": dict(GITLAB_PROJECT),
        "object_attributes": {"id": note_id, "note": body, "noteable_type": noteable_type,
                              "author_id": (user or gitlab_user())["id"], "project_id": 77,
                              "system": False, "action": "create",
                              "url": "https://gitlab.example/acme/tools/widgets/-/issues/12"
                                     f"#note_{note_id}"},
        "repository": {"name": "widgets"}, **subject}


def gitea_user(login="alice", user_id=3) -> dict:
    return model("User", id=user_id, login=login, login_name="", full_name=login.title(),
                 email=f"{login}@noreply.gitea.example", username=login)


def gitea_repository() -> dict:
    return model("Repository", id=41, name="widgets", full_name="acme/widgets",
                 owner=gitea_user("acme", 2), private=False,
                 html_url="https://gitea.example/acme/widgets",
                 permissions={"admin": False, "push": False, "pull": True})


def gitea_issue(action="opened", number=12, sender=None) -> tuple[str, dict]:
    issue = model("Issue", id=501, number=number, title="Widgets crash on save",
                  body="Stack trace attached", user=gitea_user(), state="open")
    return "issues", {"action": action, "number": number, "issue": issue,
                      "repository": gitea_repository(), "sender": sender or gitea_user()}


def gitea_pull_request(number=5) -> tuple[str, dict]:
    pull = model("PullRequest", id=601, number=number, title="Fix the crash", user=gitea_user(),
                 state="open")
    return "pull_request", {"action": "opened", "number": number, "pull_request": pull,
                            "repository": gitea_repository(), "sender": gitea_user()}


def gitea_comment(comment_id=1244, sender=None, body="please look") -> tuple[str, dict]:
    author = sender or gitea_user()
    issue = model("Issue", id=501, number=12, title="Widgets crash on save", user=gitea_user(),
                  state="open")
    comment = model("Comment", id=comment_id, body=body, user=author,
                    created_at="2026-01-01T00:00:00Z", updated_at="2026-01-01T00:00:00Z")
    return "issue_comment", {"action": "created", "issue": issue, "comment": comment,
                             "repository": gitea_repository(), "sender": author,
                             "is_pull": False}


# -- one source at a time ------------------------------------------------------------------------


@dataclass
class Forge:
    """What a test needs of one source: its stand-in, how a delivery is signed, its payloads,
    and the operations its stand-in names."""

    source: str
    standin: object
    slug: str
    ack_op: str
    comment_ack_op: str
    post_op: str
    edit_op: str
    look_op: str

    def deliver(self, event_payload) -> Todo | None:
        event, payload = event_payload
        body = signing.body_of(payload)
        sign = signing.gitlab if self.source == "gitlab" else signing.gitea
        answer = hook_client.post(self.slug, body, **sign(SECRETS[self.source], body,
                                                          event=event))
        assert answer.status_code == 202, answer.content
        todos = answer.json()["todos"]
        return Todo.objects.get(pk=todos[0]["id"]) if todos else None

    def issue(self, **kwargs):
        return (gitlab_issue if self.source == "gitlab" else gitea_issue)(**kwargs)

    def comment(self, **kwargs):
        return (gitlab_note if self.source == "gitlab" else gitea_comment)(**kwargs)

    def own_comment(self):
        """The payload the source sends for the status the token's user wrote: its author
        and the delivery's actor are that user."""
        if self.source == "gitlab":
            return gitlab_note(user=gitlab_user(self.standin.username, self.standin.user_id),
                               body="<!-- switchboard:todo:1 -->\n**📥 Queued**")
        return gitea_comment(sender=gitea_user(self.standin.login, self.standin.user_id),
                             body="<!-- switchboard:todo:1 -->\n**📥 Queued**")

    def statuses(self) -> list[dict]:
        return (self.standin.status_notes() if self.source == "gitlab"
                else self.standin.status_comments())

    def forget_statuses(self):
        (self.standin.notes if self.source == "gitlab" else self.standin.comments).clear()


FORGES = {
    "gitlab": dict(ack_op="ProjectIssueAwardEmojiManager.create",
                   comment_ack_op="ProjectIssueNoteAwardEmojiManager.create",
                   post_op="ProjectIssueNoteManager.create",
                   edit_op="ProjectIssueNoteManager.update",
                   look_op="ProjectIssueNoteManager.list"),
    "gitea": dict(ack_op="issue_post_issue_reaction", comment_ack_op="issue_post_comment_reaction",
                  post_op="issue_create_comment", edit_op="issue_edit_comment",
                  look_op="issue_get_comments"),
}


@pytest.fixture(params=["gitlab", "gitea"])
def forge(request, operator, endpoint, make_webhook) -> Forge:
    """A webhook of the source writing back under a token connection to its stand-in."""
    standin = request.getfixturevalue(request.param)
    connection, test = connections.create_connection(
        name=f"{request.param}-token", owner=operator, kind=request.param, secret=standin.token,
        api_url=standin.api_url)
    assert test.ok, test.error
    webhook = make_webhook(request.param, slug=request.param)
    connections.set_webhook_connection(webhook, connection)
    return Forge(request.param, standin, request.param, **FORGES[request.param])


def send(now=None) -> int:
    return write_back.send_due_write_backs(now=now)


def rows(todo) -> dict:
    return {row.action: row for row in WriteBack.objects.filter(todo_id=todo.pk)}


# -- the connection ------------------------------------------------------------------------------


def test_a_connection_records_the_token_users_name_and_id(forge):
    connection = Connection.objects.get()
    login = forge.standin.username if forge.source == "gitlab" else forge.standin.login
    assert (connection.identity, connection.identity_id) == (login, str(forge.standin.user_id))
    (asked,) = forge.standin.requests_to("CurrentUserManager.get" if forge.source == "gitlab"
                                         else "user_get_current")
    # GitLab reads an access token as a bearer; Gitea's description says "token <token>".
    scheme = "Bearer" if forge.source == "gitlab" else "token"
    assert asked.headers["authorization"] == f"{scheme} {forge.standin.token}"


@pytest.mark.parametrize("kind", ["gitlab", "gitea"])
def test_add_connection_and_test_connection_work_end_to_end(operator, kind, request,
                                                            monkeypatch):
    standin = request.getfixturevalue(kind)
    monkeypatch.setenv("FORGE_TOKEN_FOR_TEST", standin.token)
    out = StringIO()
    call_command("add_connection", f"{kind}-conn", "--owner", operator.username, "--kind", kind,
                 "--token-env", "FORGE_TOKEN_FOR_TEST", "--api-url", standin.api_url, "--json",
                 stdout=out)
    data = json.loads(out.getvalue())
    login = standin.username if kind == "gitlab" else standin.login
    assert data == {"name": f"{kind}-conn", "kind": kind, "api_url": standin.api_url,
                    "ok": True, "identity": login, "error": ""}
    assert standin.token not in out.getvalue()
    standin.fail(401, message="Unauthorized")
    out = StringIO()
    with pytest.raises(SystemExit):
        call_command("test_connection", f"{kind}-conn", "--json", stdout=out)
    assert "401" in json.loads(out.getvalue())["error"]


def test_a_gitea_connection_names_its_instance(operator):
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError, match="needs its instance's API URL"):
        connections.create_connection(name="g", owner=operator, kind="gitea", secret="abc")
    fields = connections.check_connection_fields(kind="gitlab", secret="glpat-x", app_id="",
                                                 api_url=None)
    assert fields["api_url"] == "https://gitlab.com/api/v4"


# -- the ack and the living status ---------------------------------------------------------------


def test_a_delivery_gets_eyes_on_its_issue(forge):
    todo = forge.deliver(forge.issue())
    assert todo.write_back == "status"
    assert not forge.standin.requests_to(forge.ack_op)  # nothing inside the delivery
    assert send() == 1
    (seen,) = forge.standin.requests_to(forge.ack_op)
    if forge.source == "gitlab":
        assert seen.path == "/api/v4/projects/77/issues/12/award_emoji"
        assert seen.body == {"name": "eyes"}
        assert rows(todo)["ack"].target_label == "acme/tools/widgets#12"
    else:
        assert seen.path == "/api/v1/repos/acme/widgets/issues/12/reactions"
        assert seen.body == {"content": "eyes"}
        assert rows(todo)["ack"].target_label == "acme/widgets#12"
    assert rows(todo)["ack"].state == "sent"
    assert "status" not in rows(todo)  # no status before the todo's first change


def test_a_comment_gets_eyes_on_the_comment(forge):
    forge.deliver(forge.comment())
    send()
    (seen,) = forge.standin.requests_to(forge.comment_ack_op)
    assert seen.path == ("/api/v4/projects/77/issues/12/notes/1244/award_emoji"
                         if forge.source == "gitlab"
                         else "/api/v1/repos/acme/widgets/issues/comments/1244/reactions")


def test_a_merge_or_pull_request_gets_eyes(forge):
    forge.deliver(gitlab_merge_request() if forge.source == "gitlab" else gitea_pull_request())
    send()
    if forge.source == "gitlab":
        (seen,) = forge.standin.requests_to("ProjectMergeRequestAwardEmojiManager.create")
        assert seen.path == "/api/v4/projects/77/merge_requests/5/award_emoji"
    else:  # a pull request is an issue of the same index
        (seen,) = forge.standin.requests_to("issue_post_issue_reaction")
        assert seen.path == "/api/v1/repos/acme/widgets/issues/5/reactions"


def test_a_note_on_a_merge_request_gets_eyes_on_the_note(gitlab, operator, endpoint,
                                                         make_webhook):
    forge = gitlab_forge(gitlab, operator, make_webhook)
    forge.deliver(gitlab_note("MergeRequest", note_id=88))
    send()
    (seen,) = gitlab.requests_to("ProjectMergeRequestNoteAwardEmojiManager.create")
    assert seen.path == "/api/v4/projects/77/merge_requests/5/notes/88/award_emoji"


def gitlab_forge(gitlab, operator, make_webhook) -> Forge:
    connection, _ = connections.create_connection(
        name="gl", owner=operator, kind="gitlab", secret=gitlab.token, api_url=gitlab.api_url)
    webhook = make_webhook("gitlab", slug="gitlab")
    connections.set_webhook_connection(webhook, connection)
    return Forge("gitlab", gitlab, "gitlab", **FORGES["gitlab"])


def test_an_emoji_already_there_counts_as_done(forge):
    payload = forge.issue()
    forge.deliver(payload)
    send()
    # Another todo from the same issue (a second route, a redelivery once done): its ack finds
    # the emoji there already.
    Todo.objects.update(state="done")
    forge.deliver(forge.issue(action="reopen" if forge.source == "gitlab" else "reopened"))
    send()
    assert [row.state for row in WriteBack.objects.filter(action="ack")] == ["sent", "sent"]
    assert len(forge.standin.requests_to(forge.ack_op)) == 2
    awarded = forge.standin.awards if forge.source == "gitlab" else forge.standin.reactions
    assert len(awarded) == 1


def test_one_status_per_todo_edited_in_place_to_the_final_result(forge, agent):
    todo = forge.deliver(forge.issue())
    send()
    todo_transitions.claim_todo(agent, todo.pk)
    send()
    (posted,) = forge.standin.requests_to(forge.post_op)
    assert "Being worked on" in posted.body["body"] and "`agent`" in posted.body["body"]
    assert f"https://sb.example/todos/{todo.pk}/" in posted.body["body"]
    todo_transitions.post_update_todo(agent, todo.pk, text="found it")
    send(timezone.now() + timedelta(seconds=11))
    todo_transitions.complete_todo(agent, todo.pk, result={
        "summary": "Fixed the crash; see the MR.", "url": "https://gitlab.example/acme/mr/9"})
    send(timezone.now() + timedelta(seconds=22))
    edits = forge.standin.requests_to(forge.edit_op)
    assert len(edits) == 2 and "found it" in edits[0].body["body"]
    (status,) = forge.statuses()  # exactly one status object at the source
    assert status["body"] == edits[-1].body["body"]
    assert "Done" in status["body"] and "Fixed the crash; see the MR\\." in status["body"]
    assert "<https://gitlab.example/acme/mr/9>" in status["body"]
    row = rows(todo)["status"]
    assert row.state == "sent" and row.external_id == str(status["id"])
    if forge.source == "gitlab":
        assert edits[-1].method == "PUT" and edits[-1].path.endswith(f"/notes/{status['id']}")
    else:
        assert edits[-1].method == "PATCH"
        assert edits[-1].path.endswith(f"/issues/comments/{status['id']}")


def test_a_status_someone_deleted_is_posted_again(forge, agent):
    todo = forge.deliver(forge.issue())
    todo_transitions.claim_todo(agent, todo.pk)
    send()
    forge.forget_statuses()
    todo_transitions.complete_todo(agent, todo.pk, result={"summary": "ok"})
    send()
    (status,) = forge.statuses()
    assert "Done" in status["body"] and rows(todo)["status"].external_id == str(status["id"])


def test_a_worker_killed_mid_send_does_not_post_the_status_twice(forge, agent):
    todo = forge.deliver(forge.issue())
    sender = gitlab_sender if forge.source == "gitlab" else gitea_sender
    row, now, _ = post_status_then_die(todo, agent, sender.send_status)
    send(now + write_back.SEND_LEASE + timedelta(seconds=1))
    (status,) = forge.statuses()
    assert "Being worked on" in status["body"] and "half-sent" not in status["body"]
    row.refresh_from_db()
    assert row.state == "sent" and row.external_id == str(status["id"]) and row.attempts == 2
    (looked,) = forge.standin.requests_to(forge.look_op)
    if forge.source == "gitlab":  # the newest notes, one page
        assert looked.query == {"order_by": "updated_at", "sort": "desc", "per_page": "100"}
    else:  # those changed since the write-back was made
        assert looked.query == {"since": row.created_at.strftime("%Y-%m-%dT%H:%M:%SZ")}


# -- refusals and rate limits --------------------------------------------------------------------


def test_a_429_with_retry_after_waits_as_long_as_the_source_says(forge):
    forge.deliver(forge.issue())
    assert_a_429_waits_as_said(forge.standin, 90)


def test_gitlabs_ratelimit_reset_dates_a_429_without_retry_after():
    now = timezone.now().replace(microsecond=0)
    reset = now + timedelta(minutes=2)
    answer = httpx.Response(429, headers={"RateLimit-Remaining": "0",
                                          "RateLimit-Reset": str(int(reset.timestamp()))},
                            json={"message": "Retry later"})
    failed = outbound.classify(answer, now=now)
    assert failed.retryable and failed.retry_at == reset
    assert failed.message == "429: Retry later"


@pytest.mark.parametrize("status", [403, 404])
def test_a_refusal_fails_at_once_with_the_sources_message(forge, status):
    forge.deliver(forge.issue())
    forge.standin.fail(status, message="Forbidden" if status == 403 else "Not Found")
    send()
    (ack,) = WriteBack.objects.all()
    said = {(403, "gitlab"): "403 Forbidden", (404, "gitlab"): "404 Not Found"}.get(
        (status, forge.source), "Forbidden" if status == 403 else "Not Found")
    assert ack.state == "failed" and ack.last_error == f"{status}: {said}"
    assert ack.attempts == 1 and ack.next_attempt_at is None


def test_names_from_a_payload_that_are_not_names_or_numbers_write_nothing(forge):
    event, payload = forge.issue()
    if forge.source == "gitlab":
        payload["project"]["id"] = "../../admin"
    else:
        payload["repository"]["name"] = ".."
    todo = forge.deliver((event, payload))
    assert todo is not None  # the work still arrives
    assert send() == 0 and not WriteBack.objects.exists()
    requests = [seen for seen in forge.standin.seen if seen.operation not in (
        "CurrentUserManager.get", "user_get_current")]
    assert requests == []


@pytest.mark.parametrize("source, event_payload", [
    ("gitlab", ("Push Hook", {"object_kind": "push", "user_username": "alice",
                              "project": GITLAB_PROJECT, "ref": "refs/heads/main",
                              "total_commits_count": 1})),
    ("gitlab", gitlab_note("Commit")),
    ("gitea", ("push", {"ref": "refs/heads/main", "commits": [], "sender": {"login": "a"}})),
])
def test_an_event_with_nothing_to_react_to_has_no_target(source, event_payload):
    event, payload = event_payload
    kind = {"Push Hook": "push", "Note Hook": "note.create"}.get(event, event)
    client = (gitlab_sender if source == "gitlab" else gitea_sender).SENDER.write_back
    assert client.find_target(kind, payload) is None


# -- the loop guard ------------------------------------------------------------------------------


def test_the_token_users_own_comment_makes_no_todo(forge):
    assert forge.deliver(forge.own_comment()) is None
    (record,) = DeliveryRecord.objects.all()
    assert record.outcome == "filtered" and record.reason == "own_write_back"
    assert not Todo.objects.exists()
    # A person's comment on the same issue is work as ever.
    assert forge.deliver(forge.comment()) is not None


def test_the_own_identity_is_matched_by_id_too(forge):
    # A renamed bot user keeps its id: the payload's login is stale, the id is not.
    event, payload = forge.own_comment()
    actor = payload["user"] if forge.source == "gitlab" else payload["sender"]
    actor["username" if forge.source == "gitlab" else "login"] = "renamed-bot"
    assert forge.deliver((event, payload)) is None


# -- the target's web page -----------------------------------------------------------------------


@pytest.mark.parametrize("kind, api_url, target, url", [
    ("gitlab", "https://gitlab.com/api/v4",
     {"project": "77", "path": "acme/tools/widgets", "noun": "issues", "iid": "12"},
     "https://gitlab.com/acme/tools/widgets/-/issues/12"),
    ("gitlab", "https://git.example/gitlab/api/v4",
     {"project": "77", "path": "acme/widgets", "noun": "merge_requests", "iid": "5",
      "note": "88"},
     "https://git.example/gitlab/acme/widgets/-/merge_requests/5#note_88"),
    ("gitlab", "https://gitlab.com/api/v4",
     {"project": "77", "path": "acme/../x", "noun": "issues", "iid": "12"}, ""),
    ("gitlab", "https://gitlab.com/api/v4",
     {"project": "77", "path": "acme/w", "noun": "../admin", "iid": "12"}, ""),
    ("gitea", "https://codeberg.org/api/v1",
     {"owner": "acme", "repo": "widgets", "number": "12", "comment": "1244"},
     "https://codeberg.org/acme/widgets/issues/12#issuecomment-1244"),
    ("gitea", "https://git.example/gitea/api/v1",
     {"owner": "acme", "repo": "widgets", "number": "5"},
     "https://git.example/gitea/acme/widgets/issues/5"),
    ("gitea", "https://codeberg.org/api/v1",
     {"owner": "acme", "repo": "widgets", "number": "-1"}, ""),
])
def test_a_targets_page_is_built_from_the_api_url_and_checked_segments(kind, api_url, target,
                                                                      url):
    sender = gitlab_sender if kind == "gitlab" else gitea_sender
    assert sender.target_url(Connection(kind=kind, api_url=api_url), target) == url


def test_find_target_names_the_page_people_open(forge):
    event, payload = forge.comment()
    kind = "note.create" if forge.source == "gitlab" else "issue_comment.created"
    client = (gitlab_sender if forge.source == "gitlab" else gitea_sender).SENDER.write_back
    target, label = client.find_target(kind, payload)
    url = client.target_url(Connection.objects.get(), target)
    if forge.source == "gitlab":
        assert label == "acme/tools/widgets#12 note 1244"
        web = forge.standin.api_url.removesuffix("/api/v4")
        assert url == f"{web}/acme/tools/widgets/-/issues/12#note_1244"
    else:
        assert label == "acme/widgets#12 comment 1244"
        web = forge.standin.api_url.removesuffix("/api/v1")
        assert url == f"{web}/acme/widgets/issues/12#issuecomment-1244"


@pytest.mark.parametrize("kind, method, path, body, broken", [
    ("gitlab", "POST", "/projects/77/issues/12/award_emoji", {"name": "eyes", "emoji": "x"},
     "no attribute 'emoji'"),
    ("gitlab", "POST", "/projects/77/issues/12/notes", {}, "body is missing"),
    ("gitlab", "PUT", "/projects/77/issues/12/notes/abc", {"body": "x"}, "is not an integer"),
    ("gitlab", "GET", "/projects/77/issues/12/notes?since=2026-01-01", None,
     "no query parameter 'since'"),
    ("gitlab", "PATCH", "/projects/77/issues/12/notes/5", {"body": "x"}, "no such operation"),
    ("gitea", "POST", "/repos/acme/widgets/issues/12/reactions", {"content": 5},
     "('content',)"),
    ("gitea", "POST", "/repos/acme/widgets/issues/12/comments", {"text": "x"},
     "has no field 'text'"),
    ("gitea", "PATCH", "/repos/acme/widgets/issues/comments/abc", {"body": "x"},
     "is not an integer"),
    ("gitea", "GET", "/repos/acme/widgets/issues/12/comments?since=yesterday", None,
     "is not a date-time"),
    ("gitea", "PUT", "/repos/acme/widgets/issues/comments/5", {"body": "x"}, "no such operation"),
])
def test_the_standins_refuse_what_the_sources_description_does_not_allow(
        kind, method, path, body, broken, request):
    standin = request.getfixturevalue(kind)
    answer = httpx.request(method, standin.api_url + path, json=body,
                           headers={"Authorization": f"Bearer {standin.token}"})
    assert answer.status_code in (404, 422)
    assert any(broken in problem for problem in standin.problems), standin.problems
    standin.problems.clear()
