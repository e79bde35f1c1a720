"""Admin: webhooks with routes inline, secret rotation, API tokens shown once."""

import subprocess
import sys
from pathlib import Path

import pytest

from ingest.models import OperatorToken, Webhook
from ingest import queries

pytestmark = pytest.mark.django_db
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def admin_client(client, django_user_model):
    boss = django_user_model.objects.create_superuser("boss", "boss@example.com", "pw")
    client.force_login(boss)
    return client


def test_webhook_change_page_shows_routes_inline_and_no_secret(admin_client, make_webhook):
    webhook = make_webhook("github")
    page = admin_client.get(f"/admin/ingest/webhook/{webhook.pk}/change/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "routes-TOTAL_FORMS" in html and "inbox" in html
    assert webhook.secret not in html


def test_rotate_secret_action_keeps_the_old_one_for_a_grace(admin_client, make_webhook):
    webhook = make_webhook("github")
    old = webhook.secret
    answer = admin_client.post("/admin/ingest/webhook/", {
        "action": "rotate_secret", "_selected_action": [webhook.pk]}, follow=True)
    webhook.refresh_from_db()
    assert webhook.secret != old and webhook.previous_secret == old
    assert webhook.previous_secret_expires_at is not None
    assert webhook.secret in answer.content.decode()  # shown once, in the message


def test_adding_a_webhook_in_admin_mints_a_secret(admin_client, operator):
    answer = admin_client.post("/admin/ingest/webhook/add/", {
        "slug": "from-admin", "owner": operator.pk, "source": "standard", "active": "on",
        "new_secret": "", "routes-TOTAL_FORMS": "0", "routes-INITIAL_FORMS": "0"}, follow=True)
    webhook = Webhook.objects.get(slug="from-admin")
    assert webhook.secret.startswith("whsec_")
    assert webhook.secret in answer.content.decode()


def test_adding_a_token_in_admin_shows_it_once(admin_client, operator):
    answer = admin_client.post("/admin/ingest/operatortoken/add/",
                               {"user": operator.pk, "name": "laptop"}, follow=True)
    assert answer.status_code == 200
    row = OperatorToken.objects.get(name="laptop")
    html = answer.content.decode()
    token = html[html.index("sbo_"):].split("<")[0]
    assert queries.find_operator_for_token(token) == operator and row.user == operator


def test_oidc_is_wired_only_when_configured():
    script = ("import django; django.setup(); from django.conf import settings; "
              "from django.urls import reverse; "
              "print('mozilla_django_oidc' in settings.INSTALLED_APPS, reverse('oidc_authentication_init'))")
    env = {**__import__("os").environ, "DJANGO_SETTINGS_MODULE": "switchboard.settings_test",
           "OIDC_RP_CLIENT_ID": "sb", "OIDC_RP_CLIENT_SECRET": "x",
           "OIDC_OP_AUTHORIZATION_ENDPOINT": "https://id.example/auth",
           "OIDC_OP_TOKEN_ENDPOINT": "https://id.example/token",
           "OIDC_OP_USER_ENDPOINT": "https://id.example/userinfo",
           "OIDC_OP_JWKS_ENDPOINT": "https://id.example/jwks"}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.split() == ["True", "/oidc/authenticate/"], done.stderr[-2000:]
    del env["OIDC_OP_TOKEN_ENDPOINT"]
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and "OIDC_OP_TOKEN_ENDPOINT" in done.stderr
