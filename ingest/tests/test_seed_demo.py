"""manage.py seed_demo: the §11 JSON shape, re-runs, and a printed curl that really delivers."""

import subprocess

import pytest

from endpoints import queries as endpoint_queries
from ingest.models import Route, Webhook
from tests.cli import run_manage
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
    assert server == {"type": "http", "url": first["mcp_url"],
                      "headers": {"Authorization": f"Bearer {first['credential']}"}}
    assert endpoint_queries.find_endpoint_for_credential("demo-agent", first["credential"])
    assert Route.objects.filter(webhook__slug="demo-hook", endpoint__slug="demo-agent",
                                queue="inbox").count() == 1

    again = run_manage(capsys, "seed_demo", "--json").json()
    assert again["credential"] != first["credential"]  # fresh; the old one keeps its grace
    assert again["secret"] == first["secret"]
    assert Webhook.objects.count() == 1 and Route.objects.count() == 1


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
