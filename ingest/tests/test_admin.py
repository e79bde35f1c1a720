"""Admin: webhooks with routes inline, secret rotation, API tokens shown once."""

import subprocess
import sys
from pathlib import Path

import pytest

from ingest import queries, transitions
from ingest.models import DeliveryEvent, OperatorToken, Route, Webhook

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
    # Shown once, on a page of its own: never in a message, which may ride in a cookie.
    assert webhook.secret in answer.content.decode()
    assert answer.templates[0].name == "admin/shown_once.html"
    assert "no-store" in answer["Cache-Control"]
    assert webhook.secret not in str(answer.cookies)
    assert not list(answer.context["messages"])


def test_adding_a_webhook_in_admin_mints_a_secret(admin_client, operator):
    answer = admin_client.post("/admin/ingest/webhook/add/", {
        "slug": "from-admin", "owner": operator.pk, "source": "standard", "active": "on",
        "new_secret": "", "routes-TOTAL_FORMS": "0", "routes-INITIAL_FORMS": "0"}, follow=True)
    webhook = Webhook.objects.get(slug="from-admin")
    assert webhook.secret.startswith("whsec_")
    assert webhook.secret in answer.content.decode()


@pytest.mark.parametrize("source", ["linear", "slack", "sentry"])
def test_adding_a_webhook_in_admin_takes_the_senders_own_secret(admin_client, operator, source):
    form = admin_client.get("/admin/ingest/webhook/add/").content.decode()
    assert f'value="{source}"' in form
    secret = f"{source}-secret-the-sender-showed-0123"
    admin_client.post("/admin/ingest/webhook/add/", {
        "slug": f"{source}-admin", "owner": operator.pk, "source": source, "active": "on",
        "new_secret": secret, "routes-TOTAL_FORMS": "0", "routes-INITIAL_FORMS": "0"})
    webhook = Webhook.objects.get(slug=f"{source}-admin")
    assert (webhook.source, webhook.secret) == (source, secret)


def test_adding_a_token_in_admin_shows_it_once_on_a_page_of_its_own(admin_client, operator):
    """Not in a Django message: messages may ride in a cookie (signed, not encrypted) and are
    shown again on the next page."""
    answer = admin_client.post("/admin/ingest/operatortoken/add/",
                               {"user": operator.pk, "name": "laptop"})
    assert answer.status_code == 200 and "no-store" in answer["Cache-Control"]
    row = OperatorToken.objects.get(name="laptop")
    html = answer.content.decode()
    token = html[html.index("sbo_"):].split("<")[0]
    assert queries.find_operator_for_token(token) == operator and row.user == operator
    assert all(token not in cookie.value for cookie in answer.cookies.values())
    assert token not in str(dict(admin_client.session))
    assert token not in admin_client.get("/admin/ingest/operatortoken/").content.decode()


# -- route checks in the admin (the same as add_webhook_route's) -------------------------------


def route_post(webhook, endpoint, queue, *, owner=None, priority="0", delay_seconds="0"):
    return {
        "slug": webhook.slug, "owner": (owner or webhook.owner).pk, "active": "on",
        "routes-TOTAL_FORMS": "1", "routes-INITIAL_FORMS": "0",
        "routes-MIN_NUM_FORMS": "0", "routes-MAX_NUM_FORMS": "1000",
        "routes-0-endpoint": endpoint.pk, "routes-0-queue": queue, "routes-0-kinds": "[]",
        "routes-0-priority": priority, "routes-0-delay_seconds": delay_seconds,
    }


def test_admin_routes_take_priority_and_delay_in_range_only(admin_client, make_webhook, endpoint):
    webhook = make_webhook("github", routes=[])
    page = admin_client.post(f"/admin/ingest/webhook/{webhook.pk}/change/",
                             route_post(webhook, endpoint, "inbox", priority="150"))
    assert page.status_code == 200 and Route.objects.count() == 0
    answer = admin_client.post(f"/admin/ingest/webhook/{webhook.pk}/change/",
                               route_post(webhook, endpoint, "inbox", priority="-7",
                                          delay_seconds="120"))
    assert answer.status_code == 302
    route = Route.objects.get()
    assert (route.priority, route.delay_seconds) == (-7, 120)


def test_admin_refuses_a_route_outside_the_endpoints_scope(admin_client, make_webhook, operator):
    from tests.factories import EndpointFactory

    narrow = EndpointFactory(slug="narrow", owner=operator, scope=["inbox"])
    webhook = make_webhook("github", routes=[])
    page = admin_client.post(f"/admin/ingest/webhook/{webhook.pk}/change/",
                             route_post(webhook, narrow, "reviews"))
    assert page.status_code == 200 and "outside endpoint narrow&#x27;s scope" in page.content.decode()
    assert Route.objects.count() == 0
    answer = admin_client.post(f"/admin/ingest/webhook/{webhook.pk}/change/",
                               route_post(webhook, narrow, "inbox"))
    assert answer.status_code == 302 and Route.objects.count() == 1


def test_admin_refuses_a_route_to_another_owners_endpoint_even_for_a_superuser(
        admin_client, make_webhook):
    from tests.factories import EndpointFactory, UserFactory

    bobs = EndpointFactory(slug="bobs", owner=UserFactory(username="bob"))
    webhook = make_webhook("github", routes=[])
    page = admin_client.post(f"/admin/ingest/webhook/{webhook.pk}/change/",
                             route_post(webhook, bobs, "inbox"))
    assert page.status_code == 200 and "different owners" in page.content.decode()
    assert Route.objects.count() == 0


def test_admin_refuses_moving_a_webhook_to_an_owner_its_routes_do_not_share(
        admin_client, make_webhook, endpoint):
    from tests.factories import UserFactory

    webhook = make_webhook("github", routes=[])
    bob = UserFactory(username="bob")
    page = admin_client.post(f"/admin/ingest/webhook/{webhook.pk}/change/",
                             route_post(webhook, endpoint, "inbox", owner=bob))
    assert page.status_code == 200 and "different owners" in page.content.decode()
    webhook.refresh_from_db()
    assert webhook.owner_id != bob.pk and Route.objects.count() == 0


@pytest.mark.parametrize("bad", ["\\u0000", "\\ud800"])
def test_a_nul_or_lone_surrogate_in_a_routes_kinds_is_a_form_error_not_a_500(
        admin_client, make_webhook, endpoint, operator, bad):
    webhook = make_webhook("github", routes=[])
    answer = admin_client.post(f"/admin/ingest/webhook/{webhook.pk}/change/", {
        "slug": webhook.slug, "owner": operator.pk, "active": "on",
        "routes-TOTAL_FORMS": "1", "routes-INITIAL_FORMS": "0",
        "routes-0-endpoint": endpoint.pk, "routes-0-queue": "inbox",
        "routes-0-kinds": '["iss%sues"]' % bad})
    assert answer.status_code == 200, answer.status_code
    (route_form,) = answer.context["inline_admin_formsets"][0].formset.forms
    assert "kinds" in route_form.errors
    assert Route.objects.count() == 0


# -- staff operators see only their own rows ----------------------------------------------------


@pytest.fixture
def carol(django_user_model):
    from django.contrib.auth.models import Permission

    staff = django_user_model.objects.create_user("carol", password="pw", is_staff=True)
    staff.user_permissions.add(*Permission.objects.filter(content_type__app_label="ingest"))
    return staff


@pytest.fixture
def carol_client(carol):
    from django.test import Client

    client = Client()
    client.force_login(carol)
    return client


def test_staff_operator_sees_and_changes_only_own_webhooks(carol_client, carol, make_webhook,
                                                           operator):
    alices = make_webhook("github", slug="alices-hook")
    carols, _ = transitions.create_webhook(slug="carols-hook", owner=carol, source="gitea")
    listing = carol_client.get("/admin/ingest/webhook/").content.decode()
    assert "carols-hook" in listing and "alices-hook" not in listing
    assert carol_client.get(f"/admin/ingest/webhook/{carols.pk}/change/").status_code == 200
    assert carol_client.get(f"/admin/ingest/webhook/{alices.pk}/change/").status_code == 302
    # The rotate action cannot reach someone else's webhook either.
    old = alices.secret
    carol_client.post("/admin/ingest/webhook/", {"action": "rotate_secret",
                                                 "_selected_action": [alices.pk]})
    alices.refresh_from_db()
    assert alices.secret == old
    # Owner and route endpoint choices are hers only.
    page = carol_client.get("/admin/ingest/webhook/add/")
    assert list(page.context["adminform"].form.fields["owner"].queryset) == [carol]
    from tests.factories import EndpointFactory

    mine = EndpointFactory(slug="carols-agent", owner=carol)
    page = carol_client.get(f"/admin/ingest/webhook/{carols.pk}/change/")
    route_form = page.context["inline_admin_formsets"][0].formset.forms[0]
    assert list(route_form.fields["endpoint"].queryset) == [mine]


def test_staff_operator_cannot_route_to_someone_elses_endpoint(carol_client, carol, endpoint):
    carols, _ = transitions.create_webhook(slug="carols-hook", owner=carol, source="gitea")
    page = carol_client.post(f"/admin/ingest/webhook/{carols.pk}/change/",
                             route_post(carols, endpoint, "inbox"))
    assert page.status_code == 200 and Route.objects.count() == 0


def test_staff_operator_sees_only_deliveries_attributed_to_them(carol_client, carol, operator):
    from django.utils import timezone

    for user, delivery in ((operator, "alices-delivery"), (carol, "carols-delivery")):
        DeliveryEvent.objects.create(trust="operator", delivery_id=delivery,
                                     received_at=timezone.now(), attributed_to=user)
    listing = carol_client.get("/admin/ingest/deliveryevent/").content.decode()
    assert "carols-delivery" in listing and "alices-delivery" not in listing
    alices = DeliveryEvent.objects.get(delivery_id="alices-delivery")
    assert carol_client.get(f"/admin/ingest/deliveryevent/{alices.pk}/change/").status_code == 302


def test_staff_operator_sees_and_mints_only_own_tokens(carol_client, carol, operator):
    alices, _ = transitions.mint_operator_token(user=operator, name="alices-laptop")
    transitions.mint_operator_token(user=carol, name="carols-laptop")
    listing = carol_client.get("/admin/ingest/operatortoken/").content.decode()
    assert "carols-laptop" in listing and "alices-laptop" not in listing
    carol_client.post("/admin/ingest/operatortoken/", {"action": "revoke",
                                                       "_selected_action": [alices.pk]})
    alices.refresh_from_db()
    assert alices.revoked_at is None
    form = carol_client.get("/admin/ingest/operatortoken/add/")
    assert "user" not in form.context["adminform"].form.fields
    # A forged user field is ignored: the token is hers.
    answer = carol_client.post("/admin/ingest/operatortoken/add/",
                               {"user": operator.pk, "name": "sneaky"}, follow=True)
    assert answer.status_code == 200
    assert OperatorToken.objects.get(name="sneaky").user == carol


def test_superuser_sees_every_operators_rows(admin_client, carol, operator):
    transitions.create_webhook(slug="carols-hook", owner=carol, source="gitea")
    transitions.create_webhook(slug="alices-hook", owner=operator, source="gitea")
    transitions.mint_operator_token(user=operator, name="alices-laptop")
    transitions.mint_operator_token(user=carol, name="carols-laptop")
    hooks = admin_client.get("/admin/ingest/webhook/").content.decode()
    tokens = admin_client.get("/admin/ingest/operatortoken/").content.decode()
    assert "carols-hook" in hooks and "alices-hook" in hooks
    assert "carols-laptop" in tokens and "alices-laptop" in tokens
    assert "user" in admin_client.get("/admin/ingest/operatortoken/add/").context[
        "adminform"].form.fields


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


def test_adding_an_unsigned_webhook_in_admin_warns_that_anyone_can_create_work(admin_client, operator):
    answer = admin_client.post("/admin/ingest/webhook/add/", {
        "slug": "open-hook", "owner": operator.pk, "source": "unsigned", "active": "on",
        "routes-TOTAL_FORMS": "0", "routes-INITIAL_FORMS": "0",
    }, follow=True)
    assert "anyone who knows its URL can create work" in answer.content.decode()


def test_the_delivery_log_filter_lists_only_the_operators_own_webhooks(client):
    from django.contrib.auth.models import Permission

    from ingest import transitions as ingest_transitions
    from tests.factories import UserFactory

    mine, theirs = UserFactory(username="log-owner", is_staff=True), UserFactory(username="other")
    mine.user_permissions.add(Permission.objects.get(codename="view_deliveryrecord"))
    ingest_transitions.create_webhook(slug="my-hook", owner=mine, source="github")
    ingest_transitions.create_webhook(slug="victim-secret-project-hook", owner=theirs,
                                      source="github")
    client.force_login(mine)
    page = client.get("/admin/ingest/deliveryrecord/")
    assert page.status_code == 200
    assert b"my-hook" in page.content and b"victim-secret-project-hook" not in page.content


@pytest.fixture
def viewer_client(django_user_model):
    """A staff operator who may only look at ingest's rows, not change them."""
    from django.contrib.auth.models import Permission
    from django.test import Client

    viewer = django_user_model.objects.create_user("vera", password="pw", is_staff=True)
    viewer.user_permissions.add(*Permission.objects.filter(
        content_type__app_label="ingest", codename__startswith="view_"))
    client = Client()
    client.force_login(viewer)
    return viewer, client


@pytest.mark.parametrize("action", ["rotate_secret", "drop_previous_secret"])
def test_a_staff_user_without_the_change_permission_cannot_rotate_or_drop_a_webhook_secret(
        viewer_client, action):
    viewer, client = viewer_client
    webhook, _ = transitions.create_webhook(slug="veras-hook", owner=viewer, source="github")
    transitions.rotate_webhook_secret(webhook)
    webhook.refresh_from_db()
    before = (webhook.secret, webhook.previous_secret)
    assert client.get("/admin/ingest/webhook/").status_code == 200  # she may look
    client.post("/admin/ingest/webhook/", {"action": action, "_selected_action": [webhook.pk]})
    webhook.refresh_from_db()
    assert (webhook.secret, webhook.previous_secret) == before


def test_a_staff_user_without_the_change_permission_cannot_revoke_a_token(viewer_client):
    viewer, client = viewer_client
    row, _ = transitions.mint_operator_token(user=viewer, name="laptop")
    assert client.get("/admin/ingest/operatortoken/").status_code == 200
    client.post("/admin/ingest/operatortoken/", {"action": "revoke",
                                                 "_selected_action": [row.pk]})
    row.refresh_from_db()
    assert row.revoked_at is None


def test_a_staff_user_with_the_change_permission_may_revoke_their_token(carol_client, carol):
    row, _ = transitions.mint_operator_token(user=carol, name="laptop")
    carol_client.post("/admin/ingest/operatortoken/", {"action": "revoke",
                                                       "_selected_action": [row.pk]})
    row.refresh_from_db()
    assert row.revoked_at is not None
