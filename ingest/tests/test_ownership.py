"""Ownership is checked where it is used: a route delivers only while its webhook's owner owns
the target endpoint. Giving an endpoint to another operator strands the routes of webhooks the
new owner does not own; both owners see them as stranded, and the new owner can remove them."""

import pytest
from django.contrib.auth.models import Permission
from django.test import Client

from ingest import transitions
from ingest.models import DeliveryRecord, Route
from tests.factories import EndpointFactory, UserFactory
from todos.models import Todo

from . import signing
from .conftest import SECRETS
from .test_views import ISSUE, post_hook

pytestmark = pytest.mark.django_db


def staff_client(user) -> Client:
    user.is_staff = True
    user.save(update_fields=["is_staff"])
    user.user_permissions.add(*Permission.objects.filter(content_type__app_label="ingest"))
    client = Client()
    client.force_login(user)
    return client


def deliver_issue(webhook, delivery):
    body = signing.body_of({**ISSUE, "delivery": delivery})
    return post_hook(webhook.slug, body, signing.github(SECRETS["github"], body, delivery=delivery))


def give_endpoint(endpoint, new_owner):
    """The transfer as a superuser makes it: the endpoint's admin change form."""
    root = Client()
    root.force_login(UserFactory(username="root", is_superuser=True, is_staff=True))
    answer = root.post(f"/admin/endpoints/endpoint/{endpoint.pk}/change/", {
        "slug": endpoint.slug, "owner": new_owner.pk, "scope": "*",
        "verbs": list(endpoint.verbs), "max_attempts": str(endpoint.max_attempts),
        "active": "on", "accept_unverified": "on",
        "credentials-TOTAL_FORMS": "0", "credentials-INITIAL_FORMS": "0",
    })
    assert answer.status_code == 302, answer.content[:3000]
    endpoint.refresh_from_db()
    assert endpoint.owner_id == new_owner.pk
    return root


@pytest.fixture
def bob():
    return UserFactory(username="bob")


def test_a_route_stops_delivering_once_its_endpoint_is_given_to_another_operator(
        make_webhook, endpoint, operator, bob):
    webhook = make_webhook("github")
    first = deliver_issue(webhook, "d-1")
    assert first.status_code == 202 and len(first.json()["todos"]) == 1
    original = DeliveryRecord.objects.get(webhook=webhook, outcome="accepted")
    root = give_endpoint(endpoint, bob)
    notes = [str(m) for m in root.get("/admin/endpoints/endpoint/").context["messages"]]
    assert any("1 route(s) from webhooks of other operators no longer deliver" in n for n in notes)
    answer = deliver_issue(webhook, "d-2")
    assert answer.status_code == 202 and answer.json()["todos"] == []
    assert DeliveryRecord.objects.filter(webhook=webhook).latest("id").outcome == "no_route"
    # An operator's redelivery from the log is no way around it either.
    transitions.redeliver(original, operator=operator,
                          routes=list(webhook.routes.select_related("endpoint")))
    assert Todo.objects.count() == 1
    # The new owner's own webhook delivers to it as usual.
    bobs, _ = transitions.create_webhook(slug="bobs-hook", owner=bob, source="github",
                                         secret=SECRETS["github"])
    transitions.add_webhook_route(webhook=bobs, endpoint=endpoint, queue="inbox")
    assert len(deliver_issue(bobs, "d-3").json()["todos"]) == 1


def test_a_route_whose_endpoint_changed_owner_outside_the_admin_delivers_nothing(
        make_webhook, endpoint, bob):
    # However the owner changed (a shell, a script), the delivery checks it where it is used.
    webhook = make_webhook("github")
    type(endpoint).objects.filter(pk=endpoint.pk).update(owner=bob)
    answer = deliver_issue(webhook, "d-1")
    assert answer.status_code == 202 and answer.json()["todos"] == []
    assert Todo.objects.count() == 0


def test_both_owners_see_a_stranded_route_and_the_new_owner_can_remove_it(
        make_webhook, endpoint, operator, bob):
    webhook = make_webhook("github")
    EndpointFactory(slug="alices-other", owner=operator)
    give_endpoint(endpoint, bob)
    (route,) = Route.objects.all()
    alice_admin, bob_admin = staff_client(operator), staff_client(bob)
    for client in (alice_admin, bob_admin):
        listing = client.get("/admin/ingest/route/")
        assert listing.status_code == 200
        html = listing.content.decode()
        assert f"/admin/ingest/route/{route.pk}/" in html and "stranded" in html
    assert "(1 stranded)" in alice_admin.get("/admin/ingest/webhook/").content.decode()
    # The old owner's webhook page on the board says so too.
    board = Client()
    board.force_login(operator)
    assert "stranded" in board.get(f"/todos/webhooks/{webhook.slug}/").content.decode()
    # Someone who owns neither end sees nothing of it.
    carol_admin = staff_client(UserFactory(username="carol"))
    assert f"/admin/ingest/route/{route.pk}/" not in (
        carol_admin.get("/admin/ingest/route/").content.decode())
    assert carol_admin.post(f"/admin/ingest/route/{route.pk}/delete/",
                            {"post": "yes"}).status_code in (302, 403, 404)
    assert Route.objects.filter(pk=route.pk).exists()
    # The new owner removes it.
    answer = bob_admin.post(f"/admin/ingest/route/{route.pk}/delete/", {"post": "yes"})
    assert answer.status_code == 302
    assert not Route.objects.filter(pk=route.pk).exists()
