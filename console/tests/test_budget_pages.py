"""Usage and budgets on the console (docs/console.md): spend today against the budget on the
board's header, the endpoint page (with its budget form, for an operator who may change
endpoints) and the endpoints index; the todo page's usage."""

import re
from decimal import Decimal

import pytest
from django.test import Client

from endpoints import transitions as endpoint_transitions
from tests.factories import UserFactory
from todos import transitions, usage

pytestmark = pytest.mark.django_db


@pytest.fixture
def vended(db):
    owner = UserFactory(username="alice")  # an operator: the endpoints app's permissions
    endpoint, _ = endpoint_transitions.vend_endpoint(slug="builds", owner=owner)
    return endpoint


@pytest.fixture
def owner_client(vended):
    browser = Client()
    browser.force_login(vended.owner)
    return browser


def spend(endpoint, cost, tokens=(0, 0)):
    todo = transitions.create_todo(endpoint=endpoint, queue="inbox", title="t", actor="t")[0]
    agent = transitions.Caller.agent(endpoint, "s-1")
    held = transitions.claim_todo(agent, todo.pk)
    return transitions.complete_todo(agent, todo.pk, lease_id=held.lease_id, usage_reported={
        "cost_usd": cost, "input_tokens": tokens[0], "output_tokens": tokens[1], "turns": 2,
        "model": "claude-sonnet-4-5"})


def test_the_endpoint_page_shows_spend_against_the_budget_and_over_budget(vended, owner_client):
    usage.set_endpoint_budget(vended, actor="alice", budget_usd_per_day=Decimal("1.5"),
                              budget_tokens_per_day=1000)
    spend(vended, 2, (300, 40))
    page = owner_client.get("/todos/endpoints/builds/").content.decode()
    card = re.search(r'<div class="card" id="budget">(.*?)</form>', page, re.S).group(1)
    text = re.sub(r"<[^>]+>", "", card)
    assert "$2.00 of $1.50" in text and "340 of 1,000 tokens" in text and "over budget" in text
    assert 'name="budget_usd_per_day"' in card and 'value="1.5"' in card


def test_the_budget_form_saves_and_a_bad_number_is_a_400_naming_the_field(vended, owner_client):
    saved = owner_client.post("/todos/endpoints/builds/budget", {
        "budget_usd_per_day": "12.50", "budget_tokens_per_day": "", "max_cost_usd": "2"})
    assert saved.status_code == 302
    vended.refresh_from_db()
    assert (vended.budget_usd_per_day, vended.budget_tokens_per_day, vended.max_cost_usd) == (
        Decimal("12.5"), None, Decimal("2"))
    for form, field in [({"budget_usd_per_day": "-3"}, "budget_usd_per_day"),
                        ({"budget_usd_per_day": "lots"}, "budget_usd_per_day"),
                        ({"budget_tokens_per_day": "1.5"}, "budget_tokens_per_day"),
                        ({"max_cost_usd": "99999"}, "max_cost_usd")]:
        refused = owner_client.post("/todos/endpoints/builds/budget",
                                    {"budget_usd_per_day": "12.5", "max_cost_usd": "2", **form})
        assert refused.status_code == 400 and field in refused.content.decode(), form
        vended.refresh_from_db()
        assert vended.budget_usd_per_day == Decimal("12.5") and vended.max_cost_usd == Decimal("2")


def test_the_budget_form_needs_the_change_endpoint_permission(vended):
    owner = UserFactory(username="bob", permissions=("todos",))  # no endpoints.change_endpoint
    endpoint, _ = endpoint_transitions.vend_endpoint(slug="bobs", owner=owner)
    browser = Client()
    browser.force_login(owner)
    assert 'name="budget_usd_per_day"' not in browser.get("/todos/endpoints/bobs/").content.decode()
    assert browser.post("/todos/endpoints/bobs/budget",
                        {"budget_usd_per_day": "1"}).status_code == 403
    endpoint.refresh_from_db()
    assert endpoint.budget_usd_per_day is None
    stranger = Client()
    stranger.force_login(UserFactory(username="carol"))  # may change endpoints, not alice's
    assert stranger.post("/todos/endpoints/builds/budget",
                         {"budget_usd_per_day": "1"}).status_code == 404


def test_the_board_header_and_the_endpoints_index_mark_an_endpoint_over_budget(vended, owner_client):
    usage.set_endpoint_budget(vended, actor="alice", budget_usd_per_day=Decimal("1"))
    quiet, _ = endpoint_transitions.vend_endpoint(slug="quiet", owner=vended.owner)
    board = owner_client.get("/todos/").content.decode()
    strip = re.search(r'<div class="spend-strip".*?</ul>', board, re.S).group(0)
    assert "builds $0.00 of $1.00" in re.sub(r"<[^>]+>", "", strip)
    assert "over budget" not in strip
    assert "quiet" not in strip  # no budget, nothing spent: not in the header
    spend(vended, 1)
    board = owner_client.get("/todos/").content.decode()
    assert "over budget" in re.search(r'<div class="spend-strip".*?</ul>', board, re.S).group(0)
    index = owner_client.get("/todos/endpoints/").content.decode()
    assert re.search(r'builds</a>.*over budget</span></li>', index)
    assert not re.search(r'quiet</a>[^\n]*over budget', index)


def test_the_todo_page_shows_its_summed_usage(vended, owner_client):
    done = spend(vended, 0.125, (1200, 80))
    page = owner_client.get(f"/todos/{done.pk}/").content.decode()
    shown = re.search(r'<dd id="usage">(.*?)</dd>', page, re.S).group(1)
    assert "0.125 USD" in shown and "1200 in / 80 out tokens" in shown
    assert "2 turns" in shown and "claude-sonnet-4-5" in shown
