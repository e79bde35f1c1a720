"""Endpoint admin: vending shows the credential once, rotation, no secrets on pages."""

import re

import pytest

from endpoints import queries
from endpoints.models import AGENT_VERBS, Credential, Endpoint
from tests.factories import EndpointFactory, UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def root_client(client):
    client.force_login(UserFactory(username="root", is_superuser=True, is_staff=True))
    return client


def test_vending_in_admin_shows_a_working_credential_once(root_client, operator):
    response = root_client.post("/admin/endpoints/endpoint/add/", {
        "slug": "reviewer", "owner": operator.pk, "scope": "inbox, reviews",
        "verbs": ["list_todos", "claim", "complete"], "default_lease_seconds": "600",
        "max_attempts": "3", "active": "on",
        "credentials-TOTAL_FORMS": "0", "credentials-INITIAL_FORMS": "0",
    })
    assert response.status_code == 200, response.content[:2000]
    assert "no-store" in response["Cache-Control"]
    credential = re.search(r'<code class="credential">([^<]+)</code>', response.content.decode()).group(1)
    endpoint = Endpoint.objects.get(slug="reviewer")
    assert endpoint.scope == ["inbox", "reviews"] and endpoint.verbs == ["list_todos", "claim", "complete"]
    assert endpoint.default_lease_seconds == 600 and endpoint.max_attempts == 3
    assert queries.find_endpoint_for_credential("reviewer", credential) == endpoint
    change_page = root_client.get(f"/admin/endpoints/endpoint/{endpoint.pk}/change/").content.decode()
    assert credential not in change_page
    assert Credential.objects.get(endpoint=endpoint).digest not in change_page
    assert credential[:12] in change_page  # the hint tells credentials apart


def test_admin_form_rejects_bad_queue_names(root_client, operator):
    response = root_client.post("/admin/endpoints/endpoint/add/", {
        "slug": "bad", "owner": operator.pk, "scope": "no spaces allowed", "verbs": list(AGENT_VERBS),
        "max_attempts": "5", "credentials-TOTAL_FORMS": "0", "credentials-INITIAL_FORMS": "0",
    })
    assert response.status_code == 200 and b"errornote" in response.content
    assert not Endpoint.objects.filter(slug="bad").exists()


def test_rotate_action_mints_a_new_credential_and_keeps_the_old_one_for_the_grace(root_client, operator):
    from endpoints import transitions

    endpoint, old = transitions.vend_endpoint(slug="ep", owner=operator)
    response = root_client.post("/admin/endpoints/endpoint/", {
        "action": "rotate_credentials", "_selected_action": [endpoint.pk],
    })
    assert response.status_code == 200
    new = re.search(r'<code class="credential">([^<]+)</code>', response.content.decode()).group(1)
    assert new != old
    assert queries.find_endpoint_for_credential("ep", new) == endpoint
    assert queries.find_endpoint_for_credential("ep", old) == endpoint  # grace period
    assert Credential.objects.get(endpoint=endpoint, expires_at__isnull=False).hint == old[:12]


def test_staff_operator_sees_only_own_endpoints(client, operator):
    staff = UserFactory(username="carol", is_staff=True, is_superuser=False)
    from django.contrib.auth.models import Permission

    staff.user_permissions.add(*Permission.objects.filter(codename__in=["view_endpoint", "change_endpoint"]))
    EndpointFactory(slug="carols", owner=staff)
    EndpointFactory(slug="alices", owner=operator)
    client.force_login(staff)
    page = client.get("/admin/endpoints/endpoint/").content.decode()
    assert "carols" in page and "alices" not in page


def test_staff_operator_cannot_vend_for_someone_else(client, operator):
    from django.contrib.auth.models import Permission

    staff = UserFactory(username="carol", is_staff=True, is_superuser=False)
    staff.user_permissions.add(*Permission.objects.filter(
        codename__in=["view_endpoint", "change_endpoint", "add_endpoint"]))
    client.force_login(staff)
    response = client.post("/admin/endpoints/endpoint/add/", {
        "slug": "sneaky", "owner": operator.pk, "scope": "*", "verbs": list(AGENT_VERBS),
        "max_attempts": "5", "credentials-TOTAL_FORMS": "0", "credentials-INITIAL_FORMS": "0",
    })
    assert response.status_code == 200 and b"errornote" in response.content
    assert not Endpoint.objects.filter(slug="sneaky").exists()


def test_changing_an_endpoint_in_admin_edits_scope_and_verbs(root_client, operator):
    endpoint = EndpointFactory(slug="ep", owner=operator)
    form = root_client.get(f"/admin/endpoints/endpoint/{endpoint.pk}/change/").content.decode()
    assert 'name="scope" value="*"' in form
    response = root_client.post(f"/admin/endpoints/endpoint/{endpoint.pk}/change/", {
        "slug": "ep", "owner": operator.pk, "scope": "reviews", "verbs": ["claim_next", "complete"],
        "max_attempts": "7", "active": "on",
        "credentials-TOTAL_FORMS": "0", "credentials-INITIAL_FORMS": "0",
    })
    assert response.status_code == 302
    endpoint.refresh_from_db()
    assert endpoint.scope == ["reviews"] and endpoint.verbs == ["claim_next", "complete"]
    assert endpoint.max_attempts == 7


def test_admin_edits_the_shift_schedule_and_clock_actions_set_presence(root_client, operator):
    endpoint = EndpointFactory(slug="shifty", owner=operator)
    response = root_client.post(f"/admin/endpoints/endpoint/{endpoint.pk}/change/", {
        "slug": "shifty", "owner": operator.pk, "scope": "*", "verbs": list(AGENT_VERBS),
        "max_attempts": "5", "active": "on", "shift_timezone": "Europe/Berlin",
        "shift_schedule": '[{"day": "mon", "start": "09:00", "end": "17:00"}]',
        "credentials-TOTAL_FORMS": "0", "credentials-INITIAL_FORMS": "0",
    })
    assert response.status_code == 302, response.content[:3000]
    endpoint.refresh_from_db()
    assert endpoint.shift_schedule == [{"day": "mon", "start": "09:00", "end": "17:00"}]
    bad = root_client.post(f"/admin/endpoints/endpoint/{endpoint.pk}/change/", {
        "slug": "shifty", "owner": operator.pk, "scope": "*", "verbs": list(AGENT_VERBS),
        "max_attempts": "5", "active": "on", "shift_timezone": "Mars/Olympus",
        "shift_schedule": '[{"day": "mon", "start": "09:00", "end": "17:00"}]',
        "credentials-TOTAL_FORMS": "0", "credentials-INITIAL_FORMS": "0",
    })
    assert bad.status_code == 200 and b"errornote" in bad.content
    root_client.post("/admin/endpoints/endpoint/", {"action": "clock_out",
                                                    "_selected_action": [endpoint.pk]})
    endpoint.refresh_from_db()
    assert endpoint.presence_state == "out" and endpoint.presence_hold_until is not None
    listing = root_client.get("/admin/endpoints/endpoint/").content.decode()
    assert "presence (now)" in listing.lower()


def test_vending_in_admin_keeps_accept_unverified_off_the_shift_schedule_and_the_override(
        root_client, operator):
    from datetime import timedelta

    from django.utils import timezone

    until = timezone.localtime(timezone.now() + timedelta(hours=2))
    response = root_client.post("/admin/endpoints/endpoint/add/", {
        "slug": "careful", "owner": operator.pk, "scope": "*", "verbs": list(AGENT_VERBS),
        "max_attempts": "5", "active": "on",  # accept_unverified unticked: off
        "shift_timezone": "Europe/Berlin",
        "shift_schedule": '[{"day": "mon", "start": "09:00", "end": "17:00"}]',
        "presence_override": "out",
        "presence_override_until_0": until.strftime("%Y-%m-%d"),
        "presence_override_until_1": until.strftime("%H:%M:%S"),
        "credentials-TOTAL_FORMS": "0", "credentials-INITIAL_FORMS": "0",
    })
    assert response.status_code == 200, response.content[:3000]
    endpoint = Endpoint.objects.get(slug="careful")
    assert endpoint.accept_unverified is False
    assert endpoint.shift_timezone == "Europe/Berlin"
    assert endpoint.shift_schedule == [{"day": "mon", "start": "09:00", "end": "17:00"}]
    assert endpoint.presence_override == "out"
    assert abs((endpoint.presence_override_until - until).total_seconds()) < 1
    assert endpoint.presence_at(timezone.now()) == "out"


@pytest.mark.parametrize("bad", ["\\u0000", "\\ud800"])
def test_a_nul_or_lone_surrogate_in_an_admin_json_field_is_a_form_error_not_a_500(
        root_client, operator, bad):
    endpoint = EndpointFactory(slug="shifty", owner=operator)
    response = root_client.post(f"/admin/endpoints/endpoint/{endpoint.pk}/change/", {
        "slug": "shifty", "owner": operator.pk, "scope": "*", "verbs": list(AGENT_VERBS),
        "max_attempts": "5", "active": "on", "shift_timezone": "Europe/Berlin",
        "shift_schedule": '[{"day": "mon", "start": "09:00", "end": "17:00", "note": "x%sy"}]'
                          % bad,
        "credentials-TOTAL_FORMS": "0", "credentials-INITIAL_FORMS": "0",
    })
    assert response.status_code == 200, response.status_code
    assert "shift_schedule" in response.context["adminform"].form.errors
    endpoint.refresh_from_db()
    assert endpoint.shift_schedule == []


def test_admin_sets_caps_and_refuses_a_negative_one(root_client, operator):
    base = {"slug": "capped", "owner": operator.pk, "scope": "*", "verbs": list(AGENT_VERBS),
            "max_attempts": "5", "credentials-TOTAL_FORMS": "0", "credentials-INITIAL_FORMS": "0"}
    refused = root_client.post("/admin/endpoints/endpoint/add/", {**base, "max_claimed": "-1"})
    assert refused.status_code == 200 and b"errornote" in refused.content
    assert not Endpoint.objects.filter(slug="capped").exists()
    refused = root_client.post("/admin/endpoints/endpoint/add/",
                               {**base, "queue_limits": '{"deploys": -1}'})
    assert b"errornote" in refused.content and b"queue_limits" in refused.content
    saved = root_client.post("/admin/endpoints/endpoint/add/",
                             {**base, "max_claimed": "2", "queue_limits": '{"deploys": 1}'})
    assert saved.status_code == 200, saved.content[:2000]
    endpoint = Endpoint.objects.get(slug="capped")
    assert (endpoint.max_claimed, endpoint.queue_limits) == (2, {"deploys": 1})


def test_admin_sets_the_approval_timeout_and_refuses_zero(root_client, operator):
    endpoint = EndpointFactory(slug="gated", owner=operator)
    form = {"slug": "gated", "owner": operator.pk, "scope": "*", "verbs": list(AGENT_VERBS),
            "max_attempts": "5", "active": "on",
            "credentials-TOTAL_FORMS": "0", "credentials-INITIAL_FORMS": "0"}
    bad = root_client.post(f"/admin/endpoints/endpoint/{endpoint.pk}/change/",
                           {**form, "approval_timeout_seconds": "0"})
    assert bad.status_code == 200 and b"at least 1 second" in bad.content
    response = root_client.post(f"/admin/endpoints/endpoint/{endpoint.pk}/change/",
                                {**form, "approval_timeout_seconds": "3600"})
    assert response.status_code == 302
    endpoint.refresh_from_db()
    assert endpoint.approval_timeout_seconds == 3600


def test_admin_sets_budgets_as_a_budget_event_and_refuses_a_negative_one(
        root_client, operator, django_capture_on_commit_callbacks):
    from decimal import Decimal

    endpoint = EndpointFactory(slug="spender", owner=operator, budget_usd_per_day=Decimal("1"))
    form = {"slug": "spender", "owner": operator.pk, "scope": "*", "verbs": list(AGENT_VERBS),
            "max_attempts": "5", "active": "on", "budget_usd_per_day": "1",
            "credentials-TOTAL_FORMS": "0", "credentials-INITIAL_FORMS": "0"}
    change = f"/admin/endpoints/endpoint/{endpoint.pk}/change/"
    bad = root_client.post(change, {**form, "budget_usd_per_day": "-1"})
    assert bad.status_code == 200 and b"budget_usd_per_day" in bad.content
    assert root_client.post(change, form).status_code == 302  # unchanged: no event
    assert not endpoint.events.filter(action="budget").exists()
    with django_capture_on_commit_callbacks() as announced:
        saved = root_client.post(change, {**form, "budget_usd_per_day": "2.5",
                                          "budget_tokens_per_day": "", "max_cost_usd": "0.75"})
    assert saved.status_code == 302
    endpoint.refresh_from_db()
    assert (endpoint.budget_usd_per_day, endpoint.budget_tokens_per_day, endpoint.max_cost_usd) \
        == (Decimal("2.5"), None, Decimal("0.75"))
    event = endpoint.events.get(action="budget")
    assert event.actor == "root"
    assert event.detail["before"]["budget_usd_per_day"] == "1.000000"
    assert event.detail["after"]["max_cost_usd"] == "0.75"
    assert announced  # the raise, for the digest of a held endpoint
