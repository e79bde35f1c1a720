"""manage.py seed_demo: the §11 JSON shape, re-runs, and a printed curl that really delivers."""

import json
import subprocess
from datetime import timedelta

import pytest

from endpoints import queries as endpoint_queries
from ingest.models import Route, Webhook
from tests.cli import json_printed_after, run_manage
from todos.models import Todo, Trust

CONTRACT_KEYS = {"operator", "endpoint", "mcp_url", "credential", "webhook", "hook_url", "secret",
                 "mcp_json", "curl"}


@pytest.mark.django_db
def test_seed_demo_json_shape_and_rerun(capsys, settings):
    settings.SWITCHBOARD_PUBLIC_URL = "https://sb.example"
    run = run_manage(capsys, "seed_demo", "--json")
    assert run.code == 0, run.err
    first = run.json()
    assert set(first) == CONTRACT_KEYS
    assert first["mcp_url"] == "https://sb.example/mcp/demo-agent"
    assert first["hook_url"] == "https://sb.example/hooks/demo-hook"
    server = first["mcp_json"]["mcpServers"]["switchboard"]
    # The file meant for committing names the variable; the credential goes in the export.
    assert server == {"type": "http", "url": first["mcp_url"],
                      "headers": {"Authorization": "Bearer ${SWITCHBOARD_TOKEN}"}}
    assert first["credential"] not in json.dumps(first["mcp_json"])
    assert endpoint_queries.find_endpoint_for_credential("demo-agent", first["credential"])
    assert Route.objects.filter(webhook__slug="demo-hook", endpoint__slug="demo-agent",
                                queue="inbox").count() == 1

    # Issue 13.16: a re-run revoked the credential printed before; it reuses it now.
    again = run_manage(capsys, "seed_demo", "--json").json()
    assert again["credential"] == first["credential"]
    assert endpoint_queries.find_endpoint_for_credential("demo-agent", first["credential"])
    assert again["secret"] == first["secret"]
    assert Webhook.objects.count() == 1 and Route.objects.count() == 1
    # --rotate mints a new one and revokes what earlier runs printed (no grace for a demo).
    rotated = run_manage(capsys, "seed_demo", "--rotate", "--json").json()
    assert rotated["credential"] != first["credential"]
    assert endpoint_queries.find_endpoint_for_credential("demo-agent", first["credential"]) is None
    assert endpoint_queries.find_endpoint_for_credential("demo-agent", rotated["credential"])
    assert run_manage(capsys, "seed_demo", "--json").json()["credential"] == rotated["credential"]


@pytest.mark.django_db
def test_seed_demo_mints_anew_when_the_demo_credential_was_rotated_away(capsys):
    from endpoints import transitions as endpoint_transitions
    from endpoints.models import Endpoint

    first = run_manage(capsys, "seed_demo", "--json").json()
    other = endpoint_transitions.rotate_credential(Endpoint.objects.get(slug="demo-agent"),
                                                   grace=timedelta(0))
    again = run_manage(capsys, "seed_demo", "--json").json()
    assert again["credential"] not in (first["credential"], other)
    assert endpoint_queries.find_endpoint_for_credential("demo-agent", again["credential"])


def password_in(text: str) -> str:
    return text.split("(shown only now): ")[1].split(")")[0].split()[0]


@pytest.mark.django_db
def test_seed_demo_operator_can_sign_in_to_the_admin(capsys, client, django_user_model):
    run = run_manage(capsys, "seed_demo", "--json")
    assert run.code == 0 and set(run.json()) == CONTRACT_KEYS  # the password is not a key
    password = password_in(run.err)
    user = django_user_model.objects.get(username="demo")
    assert user.is_staff and not user.is_superuser and user.check_password(password)
    # Through the real sign-in form (client.login() passes no request, which the sign-in
    # throttle refuses).
    assert client.post("/admin/login/", {"username": "demo", "password": password}).status_code == 302
    assert client.get("/admin/").status_code == 200
    endpoints = client.get("/admin/endpoints/endpoint/")
    assert endpoints.status_code == 200 and "demo-agent" in endpoints.content.decode()
    assert "demo-hook" in client.get("/admin/ingest/webhook/").content.decode()

    # A re-run keeps the password (none generated, none printed) and revokes nothing of it.
    again = run_manage(capsys, "seed_demo", "--json")
    assert again.code == 0 and "password" not in again.err
    user.refresh_from_db()
    assert user.check_password(password)


@pytest.mark.django_db
def test_seed_demo_human_output_shows_a_generated_password_and_takes_a_given_one(
        capsys, django_user_model):
    run = run_manage(capsys, "seed_demo", "--operator", "dana")
    assert run.code == 0, run.err
    credential = run.out.split("export SWITCHBOARD_TOKEN=")[1].split()[0]
    assert endpoint_queries.find_endpoint_for_credential("demo-agent", credential)
    printed_json = json_printed_after(run.out, ".mcp.json")
    assert printed_json["mcpServers"]["switchboard"]["headers"] == {
        "Authorization": "Bearer ${SWITCHBOARD_TOKEN}"}
    assert credential not in json.dumps(printed_json)
    assert "claude mcp add --transport http --scope local switchboard " in run.out
    assert "--header 'Authorization: Bearer ${SWITCHBOARD_TOKEN}'" in run.out
    assert 'bearer_token_env_var = "SWITCHBOARD_TOKEN"' in run.out  # Codex's config.toml
    assert json_printed_after(run.out, "settings.json")["mcpServers"]["switchboard"] == {
        "httpUrl": printed_json["mcpServers"]["switchboard"]["url"],
        "headers": {"Authorization": "Bearer ${SWITCHBOARD_TOKEN}"}, "trust": True}
    assert run.out.count(credential) == 1  # only on the export line
    assert django_user_model.objects.get(username="dana").check_password(password_in(run.out))
    run = run_manage(capsys, "seed_demo", "--operator", "erin", "--password", "s3cret-demo-pw",
                     "--endpoint", "erins-agent", "--webhook", "erins-hook")
    assert run.code == 0 and "password (shown only now)" not in run.out + run.err
    erin = django_user_model.objects.get(username="erin")
    assert erin.check_password("s3cret-demo-pw") and erin.is_staff and not erin.is_superuser


@pytest.mark.django_db
def test_seed_demo_refuses_someone_elses_endpoint(capsys):
    from tests.factories import EndpointFactory

    EndpointFactory(slug="demo-agent")
    run = run_manage(capsys, "seed_demo", "--json")
    assert run.code != 0 and "belongs to someone else" in run.err and run.out == ""


@pytest.mark.django_db
def test_seed_demo_help(capsys):
    run = run_manage(capsys, "seed_demo", "--help")
    assert run.code == 0 and "--json" in run.out and "--password" in run.out


@pytest.mark.django_db(transaction=True)
def test_the_printed_curl_delivers_a_signed_todo(capsys, start_daphne, settings):
    server = start_daphne()
    settings.SWITCHBOARD_PUBLIC_URL = server.url
    data = run_manage(capsys, "seed_demo", "--json").json()
    for _ in range(2):  # each paste is a new delivery
        result = subprocess.run(["bash", "-c", data["curl"]], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stderr
        assert '"todos"' in result.stdout, result.stdout
    todos = list(Todo.objects.filter(endpoint__slug="demo-agent").order_by("id"))
    assert len(todos) == 2
    assert all(todo.trust == Trust.SIGNED and todo.queue == "inbox" for todo in todos)
    assert "demo/switchboard#1" in todos[0].title
