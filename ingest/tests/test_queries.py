"""read_secret (the agent verb's read) and token lookup."""

import pytest
from django.test import override_settings

from ingest import queries, transitions
from ingest.models import OperatorSecret
from tests.factories import EndpointFactory, UserFactory
from todos.transitions import Caller, Refusal

pytestmark = pytest.mark.django_db


@pytest.fixture
def handed(endpoint, operator):
    todo, _ = transitions.hand_over_todo(
        endpoint=endpoint, operator=operator, queue="reviews", title="deploy",
        secret_values={"token": "value-1", "other": "value-2"},
    )
    return todo


def ref_of(todo, name="token"):
    return todo.payload["secrets"][name]["$secret"]


def test_read_secret_returns_the_value_to_the_caller_holding_the_lease(endpoint, handed):
    from todos import transitions as todo_transitions

    caller = Caller.agent(endpoint, "session-1")
    with pytest.raises(Refusal) as refusal:
        queries.read_secret(caller, ref_of(handed))
    assert refusal.value.code == "lease_lost"
    todo_transitions.claim_todo(caller, handed.pk)
    with pytest.raises(Refusal) as refusal:
        queries.read_secret(Caller.agent(endpoint, "session-2"), ref_of(handed))
    assert refusal.value.code == "lease_lost"
    assert queries.read_secret(caller, ref_of(handed)) == {"ref": ref_of(handed), "value": "value-1"}
    assert queries.read_secret(caller, ref_of(handed, "other"))["value"] == "value-2"


def test_read_secret_outside_scope_or_endpoint_looks_missing(operator, handed):
    narrow = EndpointFactory(slug="narrow", owner=operator, scope=["inbox"])
    stranger = EndpointFactory(slug="stranger", owner=UserFactory(username="bob"))
    handed.endpoint.scope = ["inbox"]  # the same endpoint, scoped away from "reviews"
    for caller in [Caller.agent(handed.endpoint, "s"), Caller.agent(narrow, "s"),
                   Caller.agent(stranger, "s")]:
        with pytest.raises(Refusal) as refusal:
            queries.read_secret(caller, ref_of(handed))
        assert refusal.value.code == "not_found"


@pytest.mark.parametrize("ref", [None, 7, "", "token", "sec_" + "x" * 80])
def test_read_secret_malformed_ref_is_invalid_argument(endpoint, ref):
    with pytest.raises(Refusal) as refusal:
        queries.read_secret(Caller.agent(endpoint, "s"), ref)
    assert refusal.value.code == "invalid_argument"


def test_secrets_key_rotation_keeps_old_secrets_readable(endpoint, operator):
    from cryptography.fernet import Fernet

    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    with override_settings(SWITCHBOARD_SECRETS_KEY=old):
        todo, _ = transitions.hand_over_todo(endpoint=endpoint, operator=operator, queue="inbox",
                                             title="t", secret_values={"token": "v"})
    caller = Caller.agent(endpoint, "s")
    from todos import transitions as todo_transitions

    todo_transitions.claim_todo(caller, todo.pk)
    with override_settings(SWITCHBOARD_SECRETS_KEY=f"{new},{old}"):
        assert queries.read_secret(caller, ref_of(todo))["value"] == "v"
    with override_settings(SWITCHBOARD_SECRETS_KEY=new):
        with pytest.raises(Refusal):
            queries.read_secret(caller, ref_of(todo))


def test_bad_secrets_key_fails_loudly_naming_the_variable():
    from django.core.exceptions import ImproperlyConfigured

    with override_settings(SWITCHBOARD_SECRETS_KEY="not-a-fernet-key"):
        with pytest.raises(ImproperlyConfigured, match="SWITCHBOARD_SECRETS_KEY"):
            OperatorSecret.seal("x")


def test_operator_token_lookup(operator):
    row, token = transitions.mint_operator_token(user=operator)
    assert row.digest != token and token not in row.hint + row.digest
    assert queries.find_operator_for_token(token) == operator
    assert queries.find_operator_for_token(token + "x") is None
    operator.is_active = False
    operator.save()
    assert queries.find_operator_for_token(token) is None


def test_find_webhook_with_routes(make_webhook, endpoint, other_endpoints):
    bare = make_webhook("gitlab", routes=[])
    assert queries.find_webhook_with_routes(bare.slug) == (bare, [])
    hook = make_webhook("github", routes=[(endpoint, "inbox", ["issues"]),
                                          (other_endpoints[0], "reviews", None)])
    found, routes = queries.find_webhook_with_routes(hook.slug)
    assert found == hook and found.secret == hook.secret and found.source == "github"
    assert found.previous_secret_expires_at is None and found.created_at == hook.created_at
    assert [(r.endpoint.slug, r.queue, r.kinds) for r in routes] == [
        ("agent", "inbox", ["issues"]), ("agent-0", "reviews", [])]
    assert routes[0].endpoint.scope == ["*"]
    assert routes[0].endpoint.effective_lease  # a deferred field loads on access
    hook.active = False
    hook.save()
    assert queries.find_webhook_with_routes(hook.slug) == (None, [])
    assert queries.find_webhook_with_routes("nope") == (None, [])


def test_the_webhook_lookup_is_prepared_after_a_few_runs(make_webhook):
    """The hook's lookup binds server-side, and settings let psycopg prepare it: PostgreSQL
    plans it once per connection, not on every delivery."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("SQLite has no prepared statements to look for; the PostgreSQL pass checks this")
    webhook = make_webhook("github")
    for _ in range(6):
        assert queries.find_webhook_with_routes(webhook.slug)[0] == webhook
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        prepared = [statement for (statement,) in cursor.fetchall()]
    assert any("FROM ingest_webhook w" in statement for statement in prepared), prepared
