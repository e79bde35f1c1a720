"""add_webhook, add_webhook_route and mint_operator_token: §11 signatures and --json output."""

import dataclasses
import json
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from ingest import queries, senders
from ingest.models import Route, Webhook

pytestmark = pytest.mark.django_db


def run(*args) -> dict:
    out = StringIO()
    call_command(*args, "--json", stdout=out)
    return json.loads(out.getvalue())


def test_add_webhook_mints_and_prints_the_secret_once(operator, settings):
    settings.SWITCHBOARD_PUBLIC_URL = "https://sb.example"
    data = run("add_webhook", "gh", "--owner", operator.username, "--source", "github")
    assert set(data) == {"slug", "hook_url", "secret", "connection"}
    assert data["connection"] is None
    assert data["hook_url"] == "https://sb.example/hooks/gh"
    assert Webhook.objects.get(slug="gh").secret == data["secret"] and len(data["secret"]) >= 32


def test_add_webhook_takes_a_given_secret_and_standard_secrets_are_whsec(operator):
    given = run("add_webhook", "st", "--owner", operator.username, "--source", "standard",
                "--secret", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    assert given["secret"] == "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    minted = run("add_webhook", "st2", "--owner", operator.username, "--source", "standard")
    assert minted["secret"].startswith("whsec_")
    unsigned = run("add_webhook", "open", "--owner", operator.username, "--source", "unsigned")
    assert unsigned["secret"] == ""


@pytest.mark.parametrize("args, message", [
    (["x", "--owner", "nobody", "--source", "github"], "no user"),
    (["x", "--owner", "alice", "--source", "standard", "--secret", "whsec_not base64!!!!"], "base64"),
    (["x", "--owner", "alice", "--source", "github", "--secret", "short"], "16"),
    (["bad slug", "--owner", "alice", "--source", "github"], "slug"),
])
def test_add_webhook_errors(operator, args, message):
    with pytest.raises(CommandError, match=message):
        call_command("add_webhook", *args, stdout=StringIO())


def test_add_webhook_twice_is_an_error(operator):
    run("add_webhook", "gh", "--owner", operator.username, "--source", "github")
    with pytest.raises(CommandError, match="already exists"):
        call_command("add_webhook", "gh", "--owner", operator.username, "--source", "github",
                     stdout=StringIO())


def test_add_webhook_route(operator, endpoint):
    run("add_webhook", "gh", "--owner", operator.username, "--source", "github")
    data = run("add_webhook_route", "gh", endpoint.slug, "--queue", "reviews",
               "--kinds", "pull_request, issues.opened")
    assert data == {"webhook": "gh", "endpoint": endpoint.slug, "queue": "reviews", "priority": 0,
                    "delay_seconds": 0, "requires_approval": False, "write_back": "status",
                    "agent_permissions": {}, "follow_ups": "coalesce", "thread_key": "",
                    "stop": ["issues.closed", "pull_request.closed"]}
    assert Route.objects.get().kinds == ["pull_request", "issues.opened"]
    # A route that exists already: said plainly (no flag is to blame, so none is named).
    with pytest.raises(CommandError) as twice:
        call_command("add_webhook_route", "gh", endpoint.slug, "--queue", "reviews", stdout=StringIO())
    assert str(twice.value) == "Route with this Webhook, Endpoint and Queue already exists."
    with pytest.raises(CommandError, match="no webhook"):
        call_command("add_webhook_route", "nope", endpoint.slug, "--queue", "x", stdout=StringIO())
    with pytest.raises(CommandError, match="no endpoint"):
        call_command("add_webhook_route", "gh", "nope", "--queue", "x", stdout=StringIO())


def test_mint_operator_token(operator):
    data = run("mint_operator_token", operator.username, "--name", "ci")
    assert data["user"] == operator.username and data["token"].startswith("sbo_")
    assert queries.find_operator_for_token(data["token"]) == operator


def test_add_webhook_route_refuses_out_of_scope_queues_and_other_owners(operator):
    from tests.factories import EndpointFactory, UserFactory

    EndpointFactory(slug="narrow", owner=operator, scope=["inbox"])
    EndpointFactory(slug="bobs", owner=UserFactory(username="bob"))
    run("add_webhook", "gh", "--owner", operator.username, "--source", "github")
    with pytest.raises(CommandError, match="outside endpoint narrow's scope"):
        call_command("add_webhook_route", "gh", "narrow", "--queue", "reviews", stdout=StringIO())
    with pytest.raises(CommandError, match="different owners"):
        call_command("add_webhook_route", "gh", "bobs", "--queue", "inbox", stdout=StringIO())
    assert Route.objects.count() == 0


@pytest.mark.parametrize("argv, message", [
    (["nobody"], "no user 'nobody'"),
    (["alice", "--name", "x" * 101], "at most 100"),
])
def test_mint_operator_token_bad_arguments_fail_cleanly(capsys, operator, argv, message):
    from ingest.models import OperatorToken
    from tests.cli import run_manage

    run = run_manage(capsys, "mint_operator_token", *argv, "--json")
    assert run.code != 0 and message in run.err and run.out == ""
    assert OperatorToken.objects.count() == 0


def test_mint_operator_token_refuses_an_inactive_user(capsys, operator):
    from ingest.models import OperatorToken
    from tests.cli import run_manage

    operator.is_active = False
    operator.save()
    run = run_manage(capsys, "mint_operator_token", operator.username, "--json")
    assert run.code != 0 and "inactive" in run.err and run.out == ""
    assert OperatorToken.objects.count() == 0


def test_mint_operator_token_usage_errors_and_help(capsys):
    from tests.cli import run_manage

    missing = run_manage(capsys, "mint_operator_token", "--json")
    assert missing.code == 2 and "user" in missing.err and missing.out == ""
    unknown_flag = run_manage(capsys, "mint_operator_token", "alice", "--bogus")
    assert unknown_flag.code == 2 and "--bogus" in unknown_flag.err
    helped = run_manage(capsys, "mint_operator_token", "--help")
    assert helped.code == 0
    flowing = " ".join(helped.out.split()).lower()  # argparse wraps the help text
    for text in ("usage:", "user", "--name", "--json", "shown only now"):
        assert text in flowing, text


def test_mint_operator_token_human_output_shows_the_token_once(capsys, operator):
    from tests.cli import run_manage

    run = run_manage(capsys, "mint_operator_token", operator.username, "--name", "ci")
    token = run.out.split(": ")[1].split()[0]
    assert run.code == 0 and token.startswith("sbo_")
    assert queries.find_operator_for_token(token) == operator


def test_add_webhook_says_plainly_that_anyone_with_an_unsigned_url_can_create_work(operator):
    human, err = StringIO(), StringIO()
    call_command("add_webhook", "open", "--owner", operator.username, "--source", "unsigned",
                 stdout=human)
    assert "ANYONE WHO KNOWS THIS URL CAN CREATE WORK" in human.getvalue()
    out = StringIO()
    call_command("add_webhook", "open2", "--owner", operator.username, "--source", "unsigned",
                 "--json", stdout=out, stderr=err)
    assert json.loads(out.getvalue())["secret"] == ""
    assert "ANYONE WHO KNOWS THIS URL CAN CREATE WORK" in err.getvalue()


def test_add_webhook_hint_for_a_minted_secret_comes_from_the_sender(operator, monkeypatch):
    with pytest.raises(CommandError) as stripe:
        call_command("add_webhook", "s", "--owner", operator.username, "--source", "stripe")
    assert str(stripe.value).endswith(
        "--secret 'whsec_…' (locally, `stripe listen --forward-to URL` prints one)")
    sender = dataclasses.replace(senders.get_sender("stripe"), secret_example="sk_demo_…",
                                 local_forwarder="demo forward")
    monkeypatch.setitem(senders.SENDERS, "stripe", sender)
    with pytest.raises(CommandError) as replaced:
        call_command("add_webhook", "s", "--owner", operator.username, "--source", "stripe")
    assert str(replaced.value).endswith(
        "--secret 'sk_demo_…' (locally, `demo forward URL` prints one)")


def test_rotate_webhook_secret_asks_the_sender_whether_it_signs(operator, monkeypatch):
    run("add_webhook", "gh", "--owner", operator.username, "--source", "github")
    monkeypatch.setitem(senders.SENDERS, "github",
                        dataclasses.replace(senders.get_sender("github"), signed=False))
    with pytest.raises(CommandError, match="is unsigned; it has no secret to rotate"):
        call_command("rotate_webhook_secret", "gh")
