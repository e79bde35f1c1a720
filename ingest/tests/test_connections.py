"""Connections (docs/write-back.md#connections): made, sealed, tested against a stand-in of
GitHub held to its published description, attached to webhooks; and the one way requests leave
(ingest/outbound.py)."""

import json
import logging
from datetime import datetime, timedelta, timezone as dt_timezone

import httpx
import jwt
import pytest
from django.core.exceptions import ValidationError
from django.db import connection as db
from django.utils import timezone

from ingest import connections, outbound, transitions
from ingest.models import Connection
from ingest.senders import github as github_sender
from ingest.tests.github_standin import GitHubStandIn, make_app_key
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def test_an_app_connection_is_tested_with_a_jwt_github_accepts_and_knows_its_bot(
        operator, github):
    connection, test = connections.create_connection(
        name="gh-app", owner=operator, kind="github_app", secret=github.app_pem,
        app_id=str(github.app_id), api_url=github.api_url)
    assert test.ok and test.identity == "switchboard-test[bot]"
    connection.refresh_from_db()
    assert connection.identity == "switchboard-test[bot]"
    assert connection.identity_id == str(github.app_id)
    assert connection.last_success_at is not None and connection.is_ok
    (seen,) = github.requests_to("apps/get-authenticated")
    assert seen.status == 200  # the stand-in checked the JWT as GitHub does


def test_a_token_connection_is_the_tokens_user(operator, github):
    _, test = connections.create_connection(
        name="gh-token", owner=operator, kind="github_token", secret=github.token,
        api_url=github.api_url)
    assert test == connections.ConnectionTest(ok=True, identity="octo-operator")
    (seen,) = github.requests_to("users/get-authenticated")
    assert seen.headers["authorization"] == f"Bearer {github.token}"
    assert seen.headers["x-github-api-version"] == github_sender.API_VERSION


def test_an_enterprise_server_api_url_keeps_its_path(operator):
    standin = GitHubStandIn(prefix="/api/v3").start()
    try:
        connection, test = connections.create_connection(
            name="ghes", owner=operator, kind="github_token", secret=standin.token,
            api_url=standin.api_url + "/")
        assert test.ok, test.error
        assert connection.api_url.endswith("/api/v3")
        assert [seen.path for seen in standin.seen] == ["/api/v3/user"]
        assert standin.problems == []
    finally:
        standin.stop()


def test_a_failed_test_keeps_the_connection_and_records_the_sources_message(operator, github):
    connection, test = connections.create_connection(
        name="gh-token", owner=operator, kind="github_token", secret="ghp_revoked0123456789",
        api_url=github.api_url)
    assert not test.ok and test.error == "401: Bad credentials"
    connection.refresh_from_db()
    assert connection.last_error == "401: Bad credentials"
    assert connection.last_error_at is not None and connection.last_success_at is None
    assert not connection.is_ok
    # Fixed at the source: testing again records the success.
    Connection.objects.filter(pk=connection.pk).update(secret=github.token)
    connection.refresh_from_db()
    assert connections.test_connection(connection).ok
    connection.refresh_from_db()
    assert connection.is_ok and connection.last_error == "401: Bad credentials"


def test_an_app_whose_key_github_does_not_know_fails_its_test(operator, github):
    other_pem, _ = make_app_key()
    _, test = connections.create_connection(
        name="gh-app", owner=operator, kind="github_app", secret=other_pem,
        app_id=str(github.app_id), api_url=github.api_url)
    assert not test.ok and test.error.startswith("401:")
    github.problems.clear()  # the stand-in refused it as GitHub would: that was the point


def test_the_secret_is_sealed_at_rest(operator, github):
    connection, _ = connections.create_connection(
        name="gh-app", owner=operator, kind="github_app", secret=github.app_pem,
        app_id=str(github.app_id), api_url=github.api_url)
    with db.cursor() as cursor:
        cursor.execute("SELECT secret FROM ingest_connection WHERE id = %s", [connection.pk])
        (stored,) = cursor.fetchone()
    assert "PRIVATE KEY" not in stored and stored.startswith("gAAAA")
    assert Connection.objects.get(pk=connection.pk).secret == github.app_pem


@pytest.mark.parametrize("kind, secret, app_id, api_url, field", [
    ("github_app", "not a pem", "1", None, "secret"),
    ("github_app", "PEM", "", None, "app_id"),
    ("github_app", "PEM", "12a", None, "app_id"),
    ("github_token", "ghp_x y", "", None, "secret"),
    ("github_token", "ghp_ok0123456789", "7", None, "app_id"),
    ("github_token", "ghp_ok0123456789", "", "http://github.example.com/api/v3", "api_url"),
    ("github_token", "ghp_ok0123456789", "", "https://user:pw@github.example.com", "api_url"),
    ("github_token", "ghp_ok0123456789", "", "https://github.example.com/?x=1", "api_url"),
    ("gitlab", "glpat-01234 56789", "", None, "secret"),
    ("gitea", "token0123456789", "", None, "api_url"),  # no default: the instance's own
    ("gitea", "token0123456789", "", "http://gitea.example/api/v1", "api_url"),
    ("linear", "lin_api_0123 456789", "", None, "secret"),
    ("slack", "xoxp-1-a-user-token", "", None, "secret"),  # a person's, not the bot's
    ("nonsense", "x", "", None, "kind"),
])
def test_a_connection_that_cannot_work_is_refused_naming_the_field(
        operator, kind, secret, app_id, api_url, field):
    secret = make_app_key()[0] if secret == "PEM" else secret
    with pytest.raises(ValidationError) as refused:
        connections.create_connection(name="c", owner=operator, kind=kind, secret=secret,
                                      app_id=app_id, api_url=api_url)
    assert field in refused.value.message_dict
    assert not Connection.objects.exists()


def test_plain_http_goes_only_to_loopback_and_only_where_the_settings_allow(settings):
    assert outbound.check_api_url("http://127.0.0.1:9/api/v3/") == "http://127.0.0.1:9/api/v3"
    with pytest.raises(ValueError):
        outbound.check_api_url("http://10.0.0.5/api/v3")
    settings.SWITCHBOARD_WRITE_BACK_LOOPBACK_HTTP = False
    with pytest.raises(ValueError):
        outbound.check_api_url("http://127.0.0.1:9")
    assert outbound.check_api_url("https://ghe.example.com/api/v3") == \
        "https://ghe.example.com/api/v3"


def test_the_app_jwt_is_rs256_from_the_app_for_at_most_ten_minutes():
    pem, public_key = make_app_key()
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt_timezone.utc)
    token = github_sender.app_jwt("4242", pem, now)
    assert jwt.get_unverified_header(token)["alg"] == "RS256"
    claims = jwt.decode(token, public_key, algorithms=["RS256"],
                        options={"verify_exp": False, "verify_iat": False})
    assert claims["iss"] == "4242"
    assert claims["exp"] - claims["iat"] <= 600
    assert claims["iat"] <= now.timestamp() and claims["exp"] > now.timestamp()


def test_installation_tokens_are_reused_until_five_minutes_before_they_expire(
        app_connection, github):
    now = timezone.now()
    github.token_lifetime = timedelta(minutes=6)
    first = github_sender.installation_token(app_connection, 77, now)
    assert github_sender.installation_token(app_connection, 77, now) == first
    assert len(github.requests_to("apps/create-installation-access-token")) == 1
    # A minute later the six-minute token is inside the margin: a new one is minted.
    later = github_sender.installation_token(app_connection, 77, now + timedelta(minutes=1,
                                                                                 seconds=1))
    assert later != first
    # Each installation has its own.
    assert github_sender.installation_token(app_connection, 78, now) not in (first, later)
    minted = github.requests_to("apps/create-installation-access-token")
    assert [seen.path.split("/")[3] for seen in minted] == ["77", "77", "78"]


def test_the_token_for_a_delivery_is_its_installations(app_connection, github):
    payload = {"installation": {"id": 99}}
    token = github_sender.connection_token(app_connection, payload, timezone.now())
    assert github.installation_tokens[token][0] == 99
    with pytest.raises(outbound.SourceError, match="installation"):
        github_sender.connection_token(app_connection, {}, timezone.now())
    with pytest.raises(outbound.SourceError):
        github_sender.connection_token(app_connection, {"installation": {"id": "../1"}},
                                       timezone.now())


def test_no_token_or_key_reaches_a_log_line(operator, github, caplog):
    caplog.set_level(logging.DEBUG)
    app, _ = connections.create_connection(
        name="gh-app", owner=operator, kind="github_app", secret=github.app_pem,
        app_id=str(github.app_id), api_url=github.api_url)
    installation = github_sender.installation_token(app, 5, timezone.now())
    connections.create_connection(name="gh-token", owner=operator, kind="github_token",
                                  secret=github.token, api_url=github.api_url)
    text = caplog.text + json.dumps([record.__dict__ for record in caplog.records], default=str)
    assert "write-back request" in caplog.text  # there are log lines, just no secrets in them
    for secret in (github.token, installation, "PRIVATE KEY", "Bearer"):
        assert secret not in text


# -- the one way out: ingest/outbound.py ---------------------------------------------------------


@pytest.fixture
def answering(monkeypatch):
    """Route outbound's requests to ``handler(request) -> httpx.Response``."""

    def install(handler):
        monkeypatch.setattr(outbound, "_client", httpx.Client(
            transport=httpx.MockTransport(handler), follow_redirects=False))

    return install


NOW = datetime(2026, 3, 1, 12, 0, tzinfo=dt_timezone.utc)


@pytest.mark.parametrize("status, headers, retryable, retry_at", [
    (429, {"retry-after": "30"}, True, NOW + timedelta(seconds=30)),
    (403, {"retry-after": "Sun, 01 Mar 2026 12:02:00 GMT"}, True, NOW + timedelta(minutes=2)),
    (403, {"x-ratelimit-remaining": "0",
           "x-ratelimit-reset": str(int((NOW + timedelta(minutes=7)).timestamp()))},
     True, NOW + timedelta(minutes=7)),
    (429, {}, True, None),
    (502, {}, True, None),
    (503, {"retry-after": "5"}, True, None),  # a 5xx retries with backoff whatever it says
    (403, {"x-ratelimit-remaining": "12"}, False, None),
    (404, {}, False, None),
    (422, {}, False, None),
])
def test_answers_are_classified_for_the_outbox(answering, status, headers, retryable, retry_at):
    answering(lambda request: httpx.Response(status, headers=headers,
                                             json={"message": "the source said so"}))
    with pytest.raises(outbound.SourceError) as failed:
        outbound.send("https://api.github.com", "GET", "/x", token="t", now=NOW)
    assert failed.value.retryable is retryable
    assert failed.value.retry_at == retry_at
    assert failed.value.message == f"{status}: the source said so"


def test_a_network_error_is_retryable_and_names_no_token(answering):
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    answering(refuse)
    with pytest.raises(outbound.SourceError) as failed:
        outbound.send("https://api.github.com", "GET", "/x", token="sekrit-token")
    assert failed.value.retryable and "sekrit" not in failed.value.message


def test_redirects_are_followed_only_within_the_api_url(answering):
    seen = []

    def moved(request):
        seen.append(str(request.url))
        if request.url.path == "/api/v3/repos/old/name/issues/1/comments":
            return httpx.Response(
                301, headers={"location": "/api/v3/repos/new/name/issues/1/comments"})
        if request.url.path == "/api/v3/repos/evil/issues":
            return httpx.Response(302, headers={"location": "https://evil.example/steal"})
        if request.url.path == "/api/v3/escape":
            return httpx.Response(302, headers={"location": "/elsewhere"})
        return httpx.Response(201, json={"id": 1})

    answering(moved)
    answer = outbound.send("https://ghe.example.com/api/v3", "POST",
                           "/repos/old/name/issues/1/comments", token="t", json={"body": "x"})
    assert answer.status == 201 and seen[-1].endswith("/repos/new/name/issues/1/comments")
    for path in ("/repos/evil/issues", "/escape"):
        with pytest.raises(outbound.SourceError, match="refused") as failed:
            outbound.send("https://ghe.example.com/api/v3", "GET", path, token="t")
        assert not failed.value.retryable
    assert not any("evil.example" in url or url.endswith("/elsewhere") for url in seen)


@pytest.mark.parametrize("value", ["../x", "a/b", "", ".", "..", "a b", "x" * 101, 5, None,
                                   "%2e%2e"])
def test_a_name_from_a_payload_that_is_no_name_is_refused(value):
    with pytest.raises(outbound.SourceError):
        outbound.name_segment(value)


@pytest.mark.parametrize("value", ["1e3", -1, 0, True, "12 ", "١٢", 2**63, 1.5])
def test_a_number_from_a_payload_that_is_no_id_is_refused(value):
    with pytest.raises(outbound.SourceError):
        outbound.number_segment(value)


def test_names_and_numbers_that_are_fine_pass():
    assert outbound.name_segment(".github") == ".github"
    assert outbound.name_segment("Hello-World_2.0") == "Hello-World_2.0"
    assert outbound.number_segment("42") == "42" and outbound.number_segment(7) == "7"


# -- webhooks and their connection ---------------------------------------------------------------


def test_a_webhook_writes_back_only_under_its_sources_and_owners_connection(
        operator, app_connection):
    webhook, _ = transitions.create_webhook(slug="gh", owner=operator, source="github",
                                            connection=app_connection)
    assert webhook.connection == app_connection
    gitlab, _ = transitions.create_webhook(slug="gl", owner=operator, source="gitlab")
    with pytest.raises(ValidationError, match="takes gitlab"):
        connections.set_webhook_connection(gitlab, app_connection)
    other, _ = transitions.create_webhook(slug="theirs", owner=UserFactory(username="bob"),
                                          source="github")
    with pytest.raises(ValidationError, match="different owners"):
        connections.set_webhook_connection(other, app_connection)
    with pytest.raises(ValidationError):
        transitions.create_webhook(slug="theirs-2", owner=UserFactory(username="carol"),
                                   source="github", connection=app_connection)
    connections.set_webhook_connection(webhook, None)
    webhook.refresh_from_db()
    assert webhook.connection is None
