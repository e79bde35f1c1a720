"""Webhook secrets at rest and their rotation (CONTRACT §12; issue 15 items 10 and 11): sealed
with the operator-secret keyring (SWITCHBOARD_SECRETS_KEY), rows written before that are sealed
by a data migration, a rotation's grace can be chosen or ended, and new secrets are shown on a
page of their own. An unsigned webhook is created with a plain warning."""

import importlib
import json

import pytest
from django.core.management import call_command
from django.db import connection

from ingest import transitions
from ingest.models import Webhook, build_fernet, unseal_text

from .conftest import SECRETS
from .test_views import deliver

pytestmark = pytest.mark.django_db

MIGRATION = importlib.import_module("ingest.migrations.0004_delivery_log_replay_ledger_sealed_secrets")


def stored(webhook) -> tuple[str, str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT secret, previous_secret FROM ingest_webhook WHERE id = %s",
                       [webhook.pk])
        return cursor.fetchone()


def test_current_and_previous_secrets_are_encrypted_at_rest(make_webhook):
    webhook = make_webhook("github")
    transitions.rotate_webhook_secret(webhook, secret="the-new-secret-0123456789")
    current, previous = stored(webhook)
    assert SECRETS["github"] not in current + previous
    assert "the-new-secret-0123456789" not in current + previous
    assert build_fernet().decrypt(current.encode()).decode() == "the-new-secret-0123456789"
    assert build_fernet().decrypt(previous.encode()).decode() == SECRETS["github"]
    webhook.refresh_from_db()
    assert (webhook.secret, webhook.previous_secret) == ("the-new-secret-0123456789",
                                                         SECRETS["github"])
    assert deliver(webhook).status_code == 202  # the previous secret verifies, decrypted


def test_the_data_migration_seals_plaintext_rows_once(make_webhook):
    webhook = make_webhook("github")
    with connection.cursor() as cursor:  # a row as written before secrets were sealed
        cursor.execute("UPDATE ingest_webhook SET secret = %s, previous_secret = '' WHERE id = %s",
                       [SECRETS["github"], webhook.pk])
    MIGRATION.seal_existing_secrets(None, connection.schema_editor())
    sealed, _ = stored(webhook)
    assert sealed != SECRETS["github"] and unseal_text(sealed) == SECRETS["github"]
    MIGRATION.seal_existing_secrets(None, connection.schema_editor())  # again: left alone
    assert stored(webhook)[0] == sealed
    assert Webhook.objects.get(pk=webhook.pk).secret == SECRETS["github"]
    MIGRATION.unseal_secrets(None, connection.schema_editor())
    assert stored(webhook)[0] == SECRETS["github"]


def test_rotate_webhook_secret_with_zero_grace_ends_the_old_secret_at_once(make_webhook, capsys):
    webhook = make_webhook("github")
    call_command("rotate_webhook_secret", webhook.slug, "--grace-seconds", "0", "--json")
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"slug", "secret"} and data["slug"] == webhook.slug
    assert deliver(webhook).status_code == 401  # signed with the old secret
    webhook.refresh_from_db()
    assert webhook.secret == data["secret"]


def test_rotate_webhook_secret_keeps_the_old_one_for_the_default_grace(make_webhook, capsys):
    webhook = make_webhook("github")
    call_command("rotate_webhook_secret", webhook.slug, "--json")
    assert deliver(webhook).status_code == 202


def test_drop_previous_secret_admin_action_ends_the_grace(admin_client, make_webhook):
    webhook = make_webhook("github")
    transitions.rotate_webhook_secret(webhook, secret="the-new-secret-0123456789")
    assert deliver(webhook).status_code == 202
    admin_client.post("/admin/ingest/webhook/", {
        "action": "drop_previous_secret", "_selected_action": [webhook.pk]})
    webhook.refresh_from_db()
    assert webhook.previous_secret == "" and webhook.previous_secret_expires_at is None
    assert deliver(webhook, {"action": "edited"}).status_code == 401


def test_a_new_webhook_secret_is_shown_on_its_own_page(admin_client, operator):
    answer = admin_client.post("/admin/ingest/webhook/add/", {
        "slug": "fresh", "owner": operator.pk, "source": "standard", "active": "on",
        "new_secret": "", "routes-TOTAL_FORMS": "0", "routes-INITIAL_FORMS": "0"})
    webhook = Webhook.objects.get(slug="fresh")
    assert answer.status_code == 200
    assert answer.templates[0].name == "admin/shown_once.html"
    assert webhook.secret in answer.content.decode() and "no-store" in answer["Cache-Control"]
    assert webhook.secret not in str(answer.cookies)


def test_creating_an_unsigned_webhook_says_anyone_with_the_url_can_create_work(
        admin_client, operator, capsys):
    call_command("add_webhook", "open-hook", "--owner", operator.username, "--source", "unsigned")
    assert "anyone who knows this url can create work" in capsys.readouterr().out.lower()
    answer = admin_client.post("/admin/ingest/webhook/add/", {
        "slug": "open-admin", "owner": operator.pk, "source": "unsigned", "active": "on",
        "new_secret": "", "routes-TOTAL_FORMS": "0", "routes-INITIAL_FORMS": "0"}, follow=True)
    assert "anyone who knows its URL can create work" in answer.content.decode()


@pytest.mark.parametrize("grace", ["-1", "99999999999999"])
def test_rotate_webhook_secret_refuses_a_grace_out_of_range(make_webhook, grace):
    from django.core.management.base import CommandError

    webhook = make_webhook("github")
    with pytest.raises(CommandError, match="--grace-seconds"):
        call_command("rotate_webhook_secret", webhook.slug, "--grace-seconds", grace)
