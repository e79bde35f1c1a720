"""Scope narrowing never strands a route (CONTRACT §3, issue 13 item 15): narrowing an
endpoint's scope is refused while routes target queues outside it, naming them (model-level
function and admin); a delivery can never create a todo outside its endpoint's scope."""

import pytest
from django.core.exceptions import ValidationError

from endpoints import transitions as endpoint_transitions
from endpoints.models import Endpoint
from tests.factories import UserFactory
from todos.models import Todo

from .test_views import deliver

pytestmark = pytest.mark.django_db


def test_narrowing_a_scope_is_refused_while_routes_target_outside_it(make_webhook, endpoint):
    webhook = make_webhook("github", routes=[(endpoint, "inbox", None), (endpoint, "reviews", None)])
    with pytest.raises(ValidationError) as refused:
        endpoint_transitions.set_scope(endpoint, ["reviews"])
    assert "github-hook -> inbox" in str(refused.value) and "reviews ->" not in str(refused.value)
    assert Endpoint.objects.get(pk=endpoint.pk).scope == ["*"]
    webhook.routes.filter(queue="inbox").delete()
    assert endpoint_transitions.set_scope(endpoint, ["reviews"]).scope == ["reviews"]


def test_the_admin_refuses_the_narrowing_naming_the_routes(client, make_webhook, endpoint, operator):
    make_webhook("github")  # routes to endpoint/inbox
    client.force_login(UserFactory(username="root", is_superuser=True, is_staff=True))
    response = client.post(f"/admin/endpoints/endpoint/{endpoint.pk}/change/", {
        "slug": endpoint.slug, "owner": operator.pk, "scope": "reviews",
        "verbs": ["claim_next"], "max_attempts": "5", "active": "on",
        "credentials-TOTAL_FORMS": "0", "credentials-INITIAL_FORMS": "0",
    })
    assert response.status_code == 200 and b"errornote" in response.content
    assert b"github-hook -&gt; inbox" in response.content
    assert Endpoint.objects.get(pk=endpoint.pk).scope == ["*"]


def test_a_delivery_never_creates_a_todo_outside_its_endpoints_scope(make_webhook, endpoint):
    webhook = make_webhook("github", routes=[(endpoint, "inbox", None), (endpoint, "reviews", None)])
    # A narrowing that raced the route check (or a raw UPDATE): the route is stranded.
    Endpoint.objects.filter(pk=endpoint.pk).update(scope=["reviews"])
    answer = deliver(webhook)
    assert answer.status_code == 202, answer.content
    assert [todo["queue"] for todo in answer.json()["todos"]] == ["reviews"]
    assert list(Todo.objects.values_list("queue", flat=True)) == ["reviews"]
