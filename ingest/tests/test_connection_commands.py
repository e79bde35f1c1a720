"""add_connection, test_connection, set_connection, add_webhook --connection (docs/commands.md)
and the connections' admin, against the GitHub stand-in."""

import json
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from ingest.models import Connection, Webhook
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def run(*args) -> dict:
    out = StringIO()
    call_command(*args, "--json", stdout=out, stderr=StringIO())
    return json.loads(out.getvalue())


@pytest.fixture
def pem_file(tmp_path, github):
    path = tmp_path / "app.pem"
    path.write_text(github.app_pem)
    return path


def test_add_connection_reads_the_key_from_a_file_and_never_prints_it(operator, github, pem_file):
    out = StringIO()
    call_command("add_connection", "gh-app", "--owner", operator.username, "--kind",
                 "github_app", "--app-id", str(github.app_id), "--private-key-file",
                 str(pem_file), "--api-url", github.api_url, "--json", stdout=out)
    data = json.loads(out.getvalue())
    assert data == {"name": "gh-app", "kind": "github_app", "api_url": github.api_url,
                    "ok": True, "identity": "switchboard-test[bot]", "error": ""}
    assert "PRIVATE" not in out.getvalue()
    assert Connection.objects.get(name="gh-app").secret == github.app_pem.strip()


def test_add_connection_reads_a_token_from_the_environment(operator, github, monkeypatch):
    monkeypatch.setenv("GH_TOKEN_FOR_TEST", github.token)
    data = run("add_connection", "gh-token", "--owner", operator.username, "--kind",
               "github_token", "--token-env", "GH_TOKEN_FOR_TEST", "--api-url", github.api_url)
    assert data["ok"] and data["identity"] == "octo-operator"
    assert github.token not in json.dumps(data)


def test_add_connection_saves_a_connection_whose_test_fails_and_exits_1(operator, github,
                                                                         tmp_path):
    token = tmp_path / "token"
    token.write_text("ghp_wrong0123456789\n")
    out, err = StringIO(), StringIO()
    with pytest.raises(SystemExit) as exited:
        call_command("add_connection", "gh-token", "--owner", operator.username, "--kind",
                     "github_token", "--token-file", str(token), "--api-url", github.api_url,
                     "--json", stdout=out, stderr=err)
    assert exited.value.code == 1
    data = json.loads(out.getvalue())
    assert data["ok"] is False and data["error"] == "401: Bad credentials"
    assert "was saved, but the test failed: 401: Bad credentials" in err.getvalue()
    assert "manage.py test_connection gh-token" in err.getvalue()
    assert "ghp_wrong" not in out.getvalue() + err.getvalue()
    assert Connection.objects.filter(name="gh-token").exists()


@pytest.mark.parametrize("args, message", [
    (["--kind", "github_token"], "file or an environment variable"),
    (["--kind", "github_token", "--token-env", "NOT_SET_ANYWHERE_42"], "empty or unset"),
    (["--kind", "github_token", "--token-file", "/nonexistent/token"], "cannot read"),
    (["--kind", "github_app", "--app-id", "1", "--token-env", "HOME"], "not a token"),
    (["--kind", "github_token", "--private-key-file", "/etc/hostname"], "github_app"),
    (["--kind", "slack", "--token-env", "HOME"], "a Slack bot token, xoxb-"),
])
def test_add_connection_errors(operator, args, message):
    with pytest.raises(CommandError, match=message):
        call_command("add_connection", "c", "--owner", operator.username, *args,
                     stdout=StringIO())


def test_the_secret_cannot_be_given_on_the_command_line(operator):
    with pytest.raises(CommandError, match="not taken on the command line.*--token-env") as refused:
        call_command("add_connection", "c", "--owner", operator.username, "--kind",
                     "github_token", "--token", "ghp_visible_in_ps", stdout=StringIO())
    assert "ghp_visible_in_ps" not in str(refused.value)
    assert not Connection.objects.exists()


def test_test_connection_records_and_prints_and_exits_1_on_failure(operator, app_connection,
                                                                   github):
    assert run("test_connection", "gh-app") == {"name": "gh-app", "ok": True,
                                                 "identity": "switchboard-test[bot]",
                                                 "error": ""}
    github.fail(503, times=None)
    out, err = StringIO(), StringIO()
    with pytest.raises(SystemExit) as exited:
        call_command("test_connection", "gh-app", "--json", stdout=out, stderr=err)
    assert exited.value.code == 1
    assert json.loads(out.getvalue())["error"] == "503: Service Unavailable"
    assert "503" in err.getvalue()
    assert Connection.objects.get(name="gh-app").last_error == "503: Service Unavailable"
    with pytest.raises(CommandError, match="no connection"):
        call_command("test_connection", "nope", stdout=StringIO())


def test_add_webhook_and_set_connection_attach_a_connection(operator, app_connection):
    data = run("add_webhook", "gh", "--owner", operator.username, "--source", "github",
               "--connection", "gh-app")
    assert data["connection"] == "gh-app"
    assert Webhook.objects.get(slug="gh").connection == app_connection
    assert run("set_connection", "gh", "none") == {"webhook": "gh", "connection": None}
    assert Webhook.objects.get(slug="gh").connection is None
    assert run("set_connection", "gh", "gh-app") == {"webhook": "gh", "connection": "gh-app"}
    run("add_webhook", "gl", "--owner", operator.username, "--source", "gitlab")
    with pytest.raises(CommandError, match="takes gitlab"):
        call_command("set_connection", "gl", "gh-app", stdout=StringIO())
    UserFactory(username="bob")
    with pytest.raises(CommandError, match="different owners"):
        call_command("add_webhook", "bobs", "--owner", "bob", "--source", "github",
                     "--connection", "gh-app", stdout=StringIO())
    assert not Webhook.objects.filter(slug="bobs").exists()
    for args, message in ((["gh", "nope"], "no connection"), (["nope", "none"], "no webhook")):
        with pytest.raises(CommandError, match=message):
            call_command("set_connection", *args, stdout=StringIO())


# -- admin ---------------------------------------------------------------------------------------


@pytest.fixture
def admin_client(client, django_user_model):
    boss = django_user_model.objects.create_superuser("boss", "boss@example.com", "pw")
    client.force_login(boss)
    return client


def test_adding_a_connection_in_admin_tests_it_and_never_shows_the_secret(
        admin_client, operator, github):
    answer = admin_client.post("/admin/ingest/connection/add/", {
        "name": "gh-app", "owner": operator.pk, "kind": "github_app", "api_url": github.api_url,
        "app_id": str(github.app_id), "new_secret": github.app_pem}, follow=True)
    assert answer.status_code == 200
    connection = Connection.objects.get(name="gh-app")
    assert connection.identity == "switchboard-test[bot]"
    assert connection.secret == github.app_pem.strip()
    assert "writes back as switchboard-test[bot]" in answer.content.decode()
    page = admin_client.get(f"/admin/ingest/connection/{connection.pk}/change/").content.decode()
    assert "PRIVATE KEY" not in page and "switchboard-test[bot]" in page
    # Saved again without a new secret: the key stays, and it is tested again.
    admin_client.post(f"/admin/ingest/connection/{connection.pk}/change/", {
        "name": "gh-app", "owner": operator.pk, "api_url": github.api_url,
        "app_id": str(github.app_id), "new_secret": ""})
    assert Connection.objects.get(pk=connection.pk).secret == github.app_pem.strip()
    assert len(github.requests_to("apps/get-authenticated")) == 2


def test_admin_refuses_a_connection_that_cannot_work(admin_client, operator):
    answer = admin_client.post("/admin/ingest/connection/add/", {
        "name": "bad", "owner": operator.pk, "kind": "github_app", "api_url": "",
        "app_id": "12", "new_secret": "not a key"})
    assert answer.status_code == 200 and "not a PEM private key" in answer.content.decode()
    assert not Connection.objects.exists()


def test_the_test_action_tests_again(admin_client, app_connection, github):
    github.fail(500, times=1, message="Server Error")
    admin_client.post("/admin/ingest/connection/", {
        "action": "test_selected", "_selected_action": [app_connection.pk]}, follow=True)
    app_connection.refresh_from_db()
    assert app_connection.last_error == "500: Server Error"


def test_a_staff_operator_sees_and_picks_only_their_own_connections(client, operator,
                                                                    app_connection):
    from django.contrib.auth.models import Permission

    carol = UserFactory(username="carol", is_staff=True)
    carol.user_permissions.set(Permission.objects.filter(content_type__app_label="ingest"))
    client.force_login(carol)
    assert client.get(f"/admin/ingest/connection/{app_connection.pk}/change/").status_code == 302
    assert "gh-app" not in client.get("/admin/ingest/connection/").content.decode()
    page = client.get("/admin/ingest/webhook/add/").content.decode()
    assert "gh-app" not in page


def test_the_webhook_admin_refuses_a_connection_of_another_source(admin_client, operator,
                                                                  app_connection):
    answer = admin_client.post("/admin/ingest/webhook/add/", {
        "slug": "gl", "owner": operator.pk, "source": "gitlab", "active": "on",
        "connection": app_connection.pk, "new_secret": "",
        "routes-TOTAL_FORMS": "0", "routes-INITIAL_FORMS": "0"})
    assert answer.status_code == 200 and "takes gitlab" in answer.content.decode()
    assert not Webhook.objects.filter(slug="gl").exists()


def test_add_webhook_route_takes_what_the_source_hears(operator, endpoint, app_connection):
    run("add_webhook", "gh", "--owner", operator.username, "--source", "github",
        "--connection", "gh-app")
    data = run("add_webhook_route", "gh", endpoint.slug, "--queue", "inbox", "--write-back", "ack")
    assert data["write_back"] == "ack"
    with pytest.raises(CommandError):
        call_command("add_webhook_route", "gh", endpoint.slug, "--queue", "other",
                     "--write-back", "loud", stdout=StringIO(), stderr=StringIO())


def test_the_connection_admin_refuses_moving_a_connection_its_webhooks_write_back_under(
        admin_client, operator, app_connection, github):
    run("add_webhook", "gh", "--owner", operator.username, "--source", "github",
        "--connection", "gh-app")
    bob = UserFactory(username="bob")
    answer = admin_client.post(f"/admin/ingest/connection/{app_connection.pk}/change/", {
        "name": "gh-app", "owner": bob.pk, "api_url": github.api_url,
        "app_id": str(github.app_id), "new_secret": ""})
    assert answer.status_code == 200
    assert "webhooks of another owner write back under connection gh-app: gh;" in (
        answer.content.decode())
    assert Connection.objects.get(pk=app_connection.pk).owner == operator
    # Once no webhook writes back under it, it may move.
    run("set_connection", "gh", "none")
    answer = admin_client.post(f"/admin/ingest/connection/{app_connection.pk}/change/", {
        "name": "gh-app", "owner": bob.pk, "api_url": github.api_url,
        "app_id": str(github.app_id), "new_secret": ""})
    assert answer.status_code == 302
    assert Connection.objects.get(pk=app_connection.pk).owner == bob


def test_the_connection_admin_names_every_kinds_default_api_url(admin_client):
    from ingest import senders

    page = admin_client.get("/admin/ingest/connection/add/").content.decode()
    for kind, spec in senders.CONNECTION_SPECS.items():
        assert f"{kind}: {spec.default_api_url or 'none'}" in page
    assert "https://gitlab.com/api/v4" in page and "https://slack.com/api" in page
