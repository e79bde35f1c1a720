"""Repository tokens for agents (docs/write-back.md#repository-tokens-for-agents), against the
GitHub stand-in held to GitHub's OpenAPI description and the App JWT rules."""

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone

from ingest import repo_tokens, sweeps
from ingest.models import RepoToken, Route
from ingest.senders import github as github_sender
from ingest.tests.github_standin import openapi
from ingest.tests.test_write_back import INSTALLATION, deliver, issue_opened
from todos import transitions as todo_transitions
from todos.models import Todo
from todos.transitions import Refusal

pytestmark = pytest.mark.django_db
GRANT = {"contents": "write", "pull_requests": "write"}


@pytest.fixture
def granted(hooked):
    Route.objects.filter(webhook=hooked).update(agent_permissions=GRANT)
    return hooked


def claimed_issue(agent) -> Todo:
    todo = deliver("issues", issue_opened())
    return todo_transitions.claim_todo(agent, todo.pk)


def mint_requests(github) -> list:
    return github.requests_to("apps/create-installation-access-token")


def test_the_token_is_for_the_todos_repository_only_with_exactly_the_routes_permissions(
        granted, github, agent):
    todo = claimed_issue(agent)
    answer = repo_tokens.get_repo_token(agent, todo.pk)
    repository = todo.payload["repository"]
    assert answer["repository"] == repository["full_name"]
    assert answer["permissions"] == GRANT
    assert answer["token"] in github.installation_tokens
    assert github.installation_tokens[answer["token"]][0] == INSTALLATION
    (request,) = mint_requests(github)
    assert request.path.endswith(f"/app/installations/{INSTALLATION}/access_tokens")
    assert request.body == {"repositories": [repository["name"]], "permissions": GRANT}
    # Kept sealed: the column holds ciphertext, never the token.
    raw = RepoToken.objects.filter(pk__isnull=False).values_list("token", flat=True)
    with connection.cursor() as cursor:
        cursor.execute("SELECT token FROM ingest_repotoken")
        (stored,) = cursor.fetchone()
    assert answer["token"] not in stored and list(raw) == [answer["token"]]


def test_the_lease_reuses_its_token_while_it_has_more_than_5_minutes(granted, github, agent):
    todo = claimed_issue(agent)
    first = repo_tokens.get_repo_token(agent, todo.pk)
    assert repo_tokens.get_repo_token(agent, todo.pk) == first
    assert len(mint_requests(github)) == 1
    RepoToken.objects.update(expires_at=timezone.now() + timedelta(minutes=4))
    fresh = repo_tokens.get_repo_token(agent, todo.pk)
    assert fresh["token"] != first["token"] and len(mint_requests(github)) == 2


def test_a_new_lease_gets_its_own_token(granted, github, agent):
    todo = claimed_issue(agent)
    first = repo_tokens.get_repo_token(agent, todo.pk)
    todo_transitions.release_todo(agent, todo.pk)
    todo_transitions.claim_todo(agent, todo.pk)
    assert repo_tokens.get_repo_token(agent, todo.pk)["token"] != first["token"]


def _complete(agent, todo):
    todo_transitions.complete_todo(agent, todo.pk)


def _fail(agent, todo):
    todo_transitions.fail_todo(agent, todo.pk, error="boom")


def _release(agent, todo):
    todo_transitions.release_todo(agent, todo.pk)


def _lapse(agent, todo):
    Todo.objects.filter(pk=todo.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    todo_transitions.return_lapsed_leases(now=timezone.now(), limit=10)


def _override(agent, todo):
    operator = todo_transitions.Caller.operator(todo.endpoint, "operator")
    todo_transitions.fail_todo(operator, todo.pk, error="stop",
                               overriding=todo_transitions.HeldLease.of(
                                   Todo.objects.get(pk=todo.pk)))


@pytest.mark.parametrize("end_lease", [_complete, _fail, _release, _lapse, _override])
def test_the_token_is_revoked_when_the_lease_ends(granted, github, agent, end_lease):
    todo = claimed_issue(agent)
    token = repo_tokens.get_repo_token(agent, todo.pk)["token"]
    assert sweeps.revoke_ended_agent_tokens()["repo_tokens"] == 0  # the lease still runs
    end_lease(agent, todo)
    assert sweeps.revoke_ended_agent_tokens()["repo_tokens"] == 1
    assert github.revoked_tokens == [token]
    assert token not in github.installation_tokens
    assert RepoToken.objects.get().revoked_at is not None
    assert sweeps.revoke_ended_agent_tokens()["repo_tokens"] == 0
    assert github.requests_to("apps/revoke-installation-access-token")[0].status == 204


def test_a_revocation_github_refuses_is_kept_and_retried(granted, github, agent):
    todo = claimed_issue(agent)
    repo_tokens.get_repo_token(agent, todo.pk)
    _complete(agent, todo)
    github.fail(503)
    assert sweeps.revoke_ended_agent_tokens()["repo_tokens"] == 0
    row = RepoToken.objects.get()
    assert row.revoked_at is None and row.revoke_error
    assert sweeps.revoke_ended_agent_tokens()["repo_tokens"] == 1


def test_an_expired_token_is_only_stamped(granted, github, agent):
    todo = claimed_issue(agent)
    repo_tokens.get_repo_token(agent, todo.pk)
    RepoToken.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    assert sweeps.revoke_ended_agent_tokens()["repo_tokens"] == 1
    assert github.revoked_tokens == []


def test_refused_without_agent_permissions_on_the_route(hooked, github, agent):
    todo = claimed_issue(agent)
    with pytest.raises(Refusal) as refused:
        repo_tokens.get_repo_token(agent, todo.pk)
    assert refused.value.code == "verb_not_allowed" and "--agent-permissions" in refused.value.message
    assert mint_requests(github) == []


def test_refused_for_a_todo_of_no_app_connection(endpoint, agent, make_todo, github):
    todo = todo_transitions.claim_todo(agent, make_todo().pk)
    with pytest.raises(Refusal) as refused:
        repo_tokens.get_repo_token(agent, todo.pk)
    assert refused.value.code == "verb_not_allowed" and "GitHub App" in refused.value.message


def test_only_the_lease_holder_gets_one(granted, github, agent, endpoint):
    todo = claimed_issue(agent)
    other = todo_transitions.Caller.agent(endpoint, "session-b")
    with pytest.raises(Refusal) as refused:
        repo_tokens.get_repo_token(other, todo.pk)
    assert refused.value.code == "lease_lost"
    with pytest.raises(Refusal) as refused:
        repo_tokens.get_repo_token(agent, todo.pk, lease_id="not-the-lease")
    assert refused.value.code == "lease_lost"
    assert mint_requests(github) == []


def test_the_permission_names_and_levels_are_githubs():
    request = openapi()["paths"]["/app/installations/{installation_id}/access_tokens"]["post"]
    schema = request["requestBody"]["content"]["application/json"]["schema"]
    name = schema["properties"]["permissions"]["$ref"].rsplit("/", 1)[1]
    properties = openapi()["components"]["schemas"][name]["properties"]
    assert github_sender.APP_PERMISSION_LEVELS == {
        permission: tuple(spec["enum"]) for permission, spec in properties.items()}


@pytest.mark.parametrize("text, problem", [
    ("contents:push", "contents takes read or write"), ("repo:write", "not a GitHub App permission"),
    ("contents", r"contents needs a level: write it as contents:read\|write"),
    ("workflows:read", "workflows takes write"),
    ("organization_administration:write", "organization, account or enterprise permission"),
    ("members:read", "repository permissions only"), ("profile:write", "repository permissions"),
    ("enterprise_custom_properties_for_organizations:read", "repository permissions only"),
    ("contents:read,contents:write", "named twice")])
def test_bad_agent_permissions_are_named(text, problem):
    # Organization and account permissions are refused: one repository does not narrow them.
    with pytest.raises(ValueError, match=problem):
        github_sender.parse_agent_permissions(text)


def test_add_webhook_route_takes_agent_permissions(make_webhook, endpoint):
    make_webhook("github", slug="gh", routes=[])
    out = StringIO()
    call_command("add_webhook_route", "gh", endpoint.slug, "--queue", "work",
                 "--agent-permissions", "contents:write,pull_requests:write,repository_projects:admin",
                 "--json", stdout=out)
    printed = json.loads(out.getvalue())
    assert printed["agent_permissions"] == {"contents": "write", "pull_requests": "write",
                                            "repository_projects": "admin"}
    assert Route.objects.get(queue="work").agent_permissions == printed["agent_permissions"]
    with pytest.raises(CommandError, match="--agent-permissions: 'repo' is not"):
        call_command("add_webhook_route", "gh", endpoint.slug, "--queue", "more",
                     "--agent-permissions", "repo:write")
    make_webhook("gitlab", slug="gl", routes=[])
    with pytest.raises(CommandError, match="only a GitHub webhook"):
        call_command("add_webhook_route", "gl", endpoint.slug, "--queue", "more",
                     "--agent-permissions", "contents:read")
    assert not Route.objects.filter(queue="more").exists()


def test_an_agent_with_only_its_todo_token_gets_the_repository_token(granted, github, endpoint):
    from channels_push.tests.conftest import McpDriver
    from endpoints import transitions as endpoint_transitions

    runner = McpDriver(endpoint.slug, endpoint_transitions._issue_credential(endpoint))
    runner.initialize()
    todo = deliver("issues", issue_opened())
    claimed = runner.call("claim", {"todo_id": str(todo.pk)})["result"]["structuredContent"]
    agent = McpDriver(endpoint.slug, claimed["todo_token"])
    agent.initialize()
    answer = agent.call("repo_token", {"todo_id": str(todo.pk)})["result"]
    assert answer["isError"] is False
    assert answer["structuredContent"]["permissions"] == GRANT
    assert agent.call("complete", {"todo_id": str(todo.pk)})["result"]["isError"] is False
    assert sweeps.revoke_ended_agent_tokens() == {"todo_tokens": 1, "repo_tokens": 1}
    assert github.revoked_tokens == [answer["structuredContent"]["token"]]


def test_the_todo_page_shows_both_tokens_issued_and_revoked_never_their_values(
        granted, github, agent, client, operator):
    todo = claimed_issue(agent)
    todo_token = todo_transitions.issue_todo_token(todo)
    token = repo_tokens.get_repo_token(agent, todo.pk)["token"]
    _complete(agent, todo)
    sweeps.revoke_ended_agent_tokens()
    client.force_login(operator)
    html = client.get(f"/todos/{todo.pk}/").content.decode()
    history = html.split('id="history"')[1]
    for action in ("todo token issued", "todo token revoked", "repository token issued",
                   "repository token revoked"):
        assert f"<td>{action}</td>" in history, action
    assert "pull_requests" in history and todo.payload["repository"]["full_name"] in history
    assert token not in html and todo_token not in html and todo_token[4:20] not in html


def test_the_retention_prune_takes_the_tokens_with_their_todo(granted, github, agent, endpoint):
    from channels_push.models import McpSession
    from todos.models import TodoToken

    todo = claimed_issue(agent)
    todo_transitions.issue_todo_token(todo)
    repo_tokens.get_repo_token(agent, todo.pk)
    McpSession.objects.create(endpoint=endpoint, todo_token=TodoToken.objects.get(),
                              protocol_version="2025-11-25", created_at=timezone.now(),
                              last_seen_at=timezone.now())
    _complete(agent, todo)
    sweeps.revoke_ended_agent_tokens()
    pruned = sweeps.prune_history(now=timezone.now() + timedelta(days=400), pause_seconds=0)
    assert pruned["done_todos"] == 1 and pruned["mcp_sessions"] == 1
    assert not Todo.objects.exists()
    assert not TodoToken.objects.exists() and not RepoToken.objects.exists()


def test_a_route_whose_grant_changed_gets_a_new_token(granted, github, agent):
    todo = claimed_issue(agent)
    first = repo_tokens.get_repo_token(agent, todo.pk)
    Route.objects.update(agent_permissions={"contents": "read"})
    narrower = repo_tokens.get_repo_token(agent, todo.pk)
    assert narrower["token"] != first["token"] and narrower["permissions"] == {"contents": "read"}
    assert mint_requests(github)[-1].body["permissions"] == {"contents": "read"}
