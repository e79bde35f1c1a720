import pytest
from django.test import Client
from django.utils import timezone

from ingest import transitions
from tests.factories import EndpointFactory

SECRETS = {
    "github": "gh-secret-for-tests-0123456789",
    "gitea": "gitea-secret-for-tests-0123456789",
    "gitlab": "gitlab-token-for-tests-0123456789",
    "stripe": "whsec_stripe_secret_for_tests_0123456789",
    # The Standard Webhooks reference vector's key.
    "standard": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
    "linear": "lin_wh_secret_for_tests_0123456789abcdef",
    # The signing secret of Slack's worked example ("Verifying requests from Slack").
    "slack": "8f742231b10e8888abcd99yyyzzz85a5",
    "sentry": "sentry-client-secret-for-tests-0123456789abcdef",
    "unsigned": "",
}


@pytest.fixture(autouse=True)
def forget_found_slugs():
    """The hook's in-process memory of slugs it found (which pass an address block)."""
    from ingest import hook

    hook._found_slugs.clear()
    yield
    hook._found_slugs.clear()


@pytest.fixture
def frozen_now(monkeypatch):
    """The server's clock held at a whole second for the test: a signed timestamp ``skew``
    seconds away is exactly that far from the hook's "now", however long a loaded machine takes
    to deliver the request (a stamp taken from the running clock drifts toward the tolerance
    while it travels). ``int(frozen_now.timestamp())`` is the stamp to sign from."""
    now = timezone.now().replace(microsecond=0)
    monkeypatch.setattr(timezone, "now", lambda: now)
    return now


@pytest.fixture
def client():
    return Client()


@pytest.fixture
def make_webhook(operator, endpoint):
    """make_webhook(source, slug=…, routes=[(endpoint, queue, kinds)…]) with one route to
    ``endpoint``/inbox by default."""

    def make(source="github", *, slug=None, routes=None, secret=None):
        webhook, _ = transitions.create_webhook(
            slug=slug or f"{source}-hook", owner=operator, source=source,
            secret=SECRETS[source] if secret is None else secret,
        )
        for target, queue, kinds in routes if routes is not None else [(endpoint, "inbox", None)]:
            transitions.add_webhook_route(webhook=webhook, endpoint=target, queue=queue, kinds=kinds)
        return webhook

    return make


@pytest.fixture
def other_endpoints(operator):
    return [EndpointFactory(slug=f"agent-{n}", owner=operator) for n in range(2)]


def serve(standin, refused: str):
    """``standin`` (a source's stand-in, ingest/tests/standin_server.py) serving one test,
    which fails with ``refused`` if any request broke a rule of the source's description."""
    standin.start()
    yield standin
    standin.stop()
    assert standin.problems == [], refused


@pytest.fixture
def github():
    """A stand-in of GitHub's API held to its published description
    (ingest/tests/github_standin.py)."""
    from ingest.senders import github as github_sender
    from ingest.tests.github_standin import GitHubStandIn

    github_sender.forget_installation_tokens()
    yield from serve(GitHubStandIn(), "requests GitHub's description refuses")
    github_sender.forget_installation_tokens()


@pytest.fixture
def app_connection(operator, github):
    """A github_app connection of ``operator`` to the stand-in, tested."""
    from ingest import connections

    connection, test = connections.create_connection(
        name="gh-app", owner=operator, kind="github_app", secret=github.app_pem,
        app_id=str(github.app_id), api_url=github.api_url)
    assert test.ok, test.error
    return connection


@pytest.fixture
def gitlab():
    """A stand-in of GitLab's API held to python-gitlab's resource definitions and GitLab's
    REST reference (ingest/tests/gitlab_standin.py)."""
    from ingest.tests.gitlab_standin import GitLabStandIn

    yield from serve(GitLabStandIn(), "requests GitLab's description refuses")


@pytest.fixture
def gitea():
    """A stand-in of Gitea's API held to its published description
    (ingest/tests/gitea_standin.py)."""
    from ingest.tests.gitea_standin import GiteaStandIn

    yield from serve(GiteaStandIn(), "requests Gitea's description refuses")


@pytest.fixture
def hooked(operator, endpoint, app_connection, make_webhook):
    """A GitHub webhook writing back under the App connection, one route to ``endpoint``."""
    from ingest import connections

    webhook = make_webhook("github", slug="gh")
    connections.set_webhook_connection(webhook, app_connection)
    return webhook


@pytest.fixture
def hooked_by_token(operator, endpoint, github, make_webhook):
    """The same webhook writing back under a token connection: for tests that move the clock,
    which an App's JWT (checked against the stand-in's real clock) would not survive."""
    from ingest import connections

    connection, test = connections.create_connection(
        name="gh-token", owner=operator, kind="github_token", secret=github.token,
        api_url=github.api_url)
    assert test.ok
    webhook = make_webhook("github", slug="gh")
    connections.set_webhook_connection(webhook, connection)
    return webhook


@pytest.fixture
def slack_api():
    """A stand-in of Slack's Web API held to slack_sdk's definition of each method
    (ingest/tests/slack_standin.py)."""
    from ingest.tests.slack_standin import SlackStandIn

    yield from serve(SlackStandIn(), "requests slack_sdk's WebClient would not send")


@pytest.fixture
def linear():
    """A stand-in of Linear's GraphQL API held to Linear's schema as @linear/sdk ships it
    (ingest/tests/linear_standin.py)."""
    from ingest.tests.linear_standin import LinearStandIn

    yield from serve(LinearStandIn(), "requests Linear's schema refuses")


@pytest.fixture
def slack_connection(operator, slack_api):
    """A slack connection of ``operator`` to the stand-in, tested."""
    from ingest import connections

    connection, test = connections.create_connection(
        name="slack-bot", owner=operator, kind="slack", secret=slack_api.token,
        api_url=slack_api.api_url)
    assert test.ok, test.error
    return connection
