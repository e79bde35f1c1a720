"""/metrics: Prometheus text, queue series derived from the database at scrape time."""

from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from switchboard import metrics as push_metrics
from console import metrics as queue_metrics
from tests.factories import EndpointFactory, UserFactory
from todos import sweeps, transitions

pytestmark = pytest.mark.django_db


SCRAPE_TOKEN = "scrape-token-for-tests"


def scrape(client, **headers):
    """Without an Authorization header given, scrape as a Prometheus scraper in production
    does: with the configured bearer."""
    if "HTTP_AUTHORIZATION" in headers:
        response = client.get("/metrics", **headers)
    else:
        with override_settings(SWITCHBOARD_METRICS_TOKEN=SCRAPE_TOKEN):
            response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {SCRAPE_TOKEN}",
                                  **headers)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain; version=")
    values = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def value(values, name, **labels):
    return values.get((name, tuple(sorted(labels.items()))), 0)


def test_metrics_need_no_login_and_move_with_create_claim_and_dead_letter(client, operator):
    endpoint = EndpointFactory(slug="ep", owner=operator, max_attempts=1)
    before = scrape(client)

    def moved(after, name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    todos = [transitions.create_todo(endpoint=endpoint, queue="inbox", title=f"t{n}", actor="t")[0]
             for n in range(3)]
    after = scrape(client)
    assert value(after, "switchboard_todos", endpoint="ep", queue="inbox", state="pending") == 3
    assert moved(after, "switchboard_todos_created_total") == 3

    caller = transitions.Caller.operator(endpoint, "alice")
    transitions.claim_todo(caller, todos[0].pk)
    transitions.claim_todo(caller, todos[1].pk)
    after = scrape(client)
    assert moved(after, "switchboard_todo_claims_total") == 2
    assert value(after, "switchboard_todos", endpoint="ep", queue="inbox", state="claimed") == 2
    assert value(after, "switchboard_todos", endpoint="ep", queue="inbox", state="pending") == 1

    transitions.complete_todo(caller, todos[0].pk)
    transitions.fail_todo(caller, todos[1].pk, error="x")  # max_attempts=1: a dead letter
    transitions.claim_todo(caller, todos[2].pk)
    sweeps.expire_lapsed_leases(now=timezone.now() + timedelta(hours=1))  # lapses, attempts spent
    after = scrape(client)
    assert moved(after, "switchboard_todo_completions_total") == 1
    assert moved(after, "switchboard_todo_failures_total") == 1
    assert moved(after, "switchboard_todo_lease_lapses_total") == 1
    assert moved(after, "switchboard_todo_dead_letters_total") == 2
    assert value(after, "switchboard_todos", endpoint="ep", queue="inbox", state="failed") == 2
    assert value(after, "switchboard_todos", endpoint="ep", queue="inbox", state="done") == 0  # not a backlog


def test_counters_are_exposed(client):
    before = scrape(client)
    push_metrics.count_doorbell("sent")
    push_metrics.count_doorbell("dropped", "no attached session")
    push_metrics.count_doorbell("dropped", "no attached session")
    push_metrics.count_doorbell("skipped", "already claimed")
    push_metrics.INGEST_ACCEPTED.labels(source="github").inc()
    push_metrics.INGEST_REJECTED.labels(reason="bad_signature").inc()
    after = scrape(client)
    for name, labels, step in [
        ("switchboard_doorbells_sent_total", {}, 1),
        ("switchboard_doorbells_dropped_total", {"reason": "no_attached_session"}, 2),
        ("switchboard_doorbells_skipped_total", {"reason": "already_claimed"}, 1),
        ("switchboard_ingest_accepted_total", {"source": "github"}, 1),
        ("switchboard_ingest_rejected_total", {"reason": "bad_signature"}, 1),
    ]:
        assert value(after, name, **labels) - value(before, name, **labels) == step, name


def test_metrics_token_is_required_as_bearer_when_set(client, settings):
    settings.SWITCHBOARD_METRICS_TOKEN = "scrape-me"
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="scrape-me").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-mee").status_code == 401
    scrape(client, HTTP_AUTHORIZATION="Bearer scrape-me")


def test_scrape_cost_does_not_grow_with_endpoints_or_todos(client, operator,
                                                           django_assert_max_num_queries):
    for n in range(5):
        endpoint = EndpointFactory(slug=f"ep{n}", owner=operator)
        transitions.create_todo(endpoint=endpoint, queue="inbox", title="t", actor="t")
    # backlog (one statement), scheduled (one), then the event tally: pruned tally, settled
    # id, (increment), recent range; the paused gauge, the spend counters; the write-back
    # tally (a few rows per source, never per todo); agent credentials (one per kind)
    with django_assert_max_num_queries(10):
        scrape(client)


def test_event_tally_folds_settled_events_once_and_recounts_recent_ones(make_todo):
    tally = queue_metrics.EventTally()
    now = timezone.now()
    long_ago = now - 3 * queue_metrics.EVENT_SETTLE_TIME
    for _ in range(2):
        make_todo(now=long_ago)
    make_todo()  # recent
    first = tally.counts(now=now)
    assert first[("create", "pending")] == 3
    settled_through = tally._settled_through
    assert settled_through > 0  # the old ones were folded in
    assert tally.counts(now=now) == first  # a second scrape counts nothing twice
    later = now + 3 * queue_metrics.EVENT_SETTLE_TIME
    assert tally.counts(now=later) == first  # folding the recent one changes no total
    assert tally._settled_through > settled_through
    make_todo()
    assert tally.counts(now=later)[("create", "pending")] == 4


REMOTE = {"REMOTE_ADDR": "203.0.113.9"}


@pytest.mark.parametrize("token", ["", "scrape-me"])
def test_staff_operators_who_are_not_superusers_never_read_metrics(client, operator, settings,
                                                                   token):
    """Every operator is staff; /metrics names every tenant's endpoints and queues."""
    settings.SWITCHBOARD_METRICS_TOKEN = token
    operator.is_staff = True
    operator.save()
    client.force_login(operator)
    for where in ({}, REMOTE):  # from loopback too: a same-host proxy makes everyone loopback
        assert client.get("/metrics", **where).status_code in (403, 404)


@pytest.mark.parametrize("token", ["", "scrape-me"])
def test_a_superuser_session_reads_metrics_with_or_without_a_token(client, settings, token):
    settings.SWITCHBOARD_METRICS_TOKEN = token
    client.force_login(UserFactory(username="root", is_staff=True, is_superuser=True))
    scrape(client, HTTP_AUTHORIZATION="", **REMOTE)


def test_without_a_token_metrics_are_off_in_production(client, settings):
    settings.SWITCHBOARD_METRICS_TOKEN = ""
    settings.SWITCHBOARD_PRODUCTION = True
    assert client.get("/metrics").status_code == 404  # the test client is 127.0.0.1
    assert client.get("/metrics", **REMOTE).status_code == 404


def test_without_a_token_the_embedded_default_refuses_anonymous_scrapers_from_loopback_too(
        client, settings):
    """Behind a tunnel on the same machine (the docs' way to expose the embedded default)
    every request comes from 127.0.0.1: loopback proves nothing."""
    settings.SWITCHBOARD_METRICS_TOKEN = ""
    settings.SWITCHBOARD_PRODUCTION = False
    assert client.get("/metrics").status_code == 404  # the test client is 127.0.0.1
    assert client.get("/metrics", REMOTE_ADDR="::1").status_code == 404
    assert client.get("/metrics", **REMOTE).status_code == 404


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("production", [False, True])
def test_no_peer_or_forwarded_address_opens_metrics_without_its_token(settings, production):
    """Through the real ASGI app, with or without a trusted hop, whatever X-Forwarded-For
    says: an anonymous scrape needs the bearer."""
    import asyncio

    import httpx

    from switchboard.asgi import application

    settings.SWITCHBOARD_PRODUCTION = production

    async def get(forwarded_for, **headers):
        transport = httpx.ASGITransport(app=application, client=("127.0.0.1", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            return (await http.get("/metrics", headers={"X-Forwarded-For": forwarded_for,
                                                        **headers})).status_code

    for trusted in ([], ["127.0.0.1"]):
        settings.SWITCHBOARD_TRUSTED_PROXIES = trusted
        settings.SWITCHBOARD_METRICS_TOKEN = ""
        for forwarded_for in ("127.0.0.1", "::1", "203.0.113.9", "127.0.0.1, 127.0.0.1"):
            assert asyncio.run(get(forwarded_for)) == 404, (trusted, forwarded_for)
        settings.SWITCHBOARD_METRICS_TOKEN = SCRAPE_TOKEN
        assert asyncio.run(get("127.0.0.1")) == 401
        assert asyncio.run(get("127.0.0.1", Authorization=f"Bearer {SCRAPE_TOKEN}")) == 200


def test_metrics_count_scheduled_todos_and_work_control_transitions(client, operator):
    endpoint = EndpointFactory(slug="ep", owner=operator)
    before = scrape(client)
    later = timezone.now() + timedelta(hours=1)
    todos = [transitions.create_todo(endpoint=endpoint, queue="nightly", title=f"t{n}",
                                     actor="t", not_before=later)[0] for n in range(3)]
    after = scrape(client)
    assert value(after, "switchboard_todos_scheduled", endpoint="ep", queue="nightly") == 3
    operator_caller = transitions.Caller.operator(endpoint, "alice")
    transitions.run_now_todo(operator_caller, todos[0].pk)
    transitions.set_priority_todo(operator_caller, todos[1].pk, 9)
    sweeps.release_due_scheduled_todos(now=later + timedelta(seconds=1))
    after = scrape(client)
    assert value(after, "switchboard_todos_scheduled", endpoint="ep", queue="nightly") == 0
    for name, moved in [("switchboard_todo_runs_now_total", 1),
                        ("switchboard_todo_priority_changes_total", 1),
                        ("switchboard_todos_scheduled_due_total", 2)]:
        assert value(after, name) - value(before, name) == moved, name


def test_metrics_count_cancellations_approvals_and_todos_awaiting_approval(client, operator):
    endpoint = EndpointFactory(slug="gate", owner=operator)
    before = scrape(client)

    def moved(after, name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    gated = [transitions.create_todo(endpoint=endpoint, queue="deploys", title=f"t{n}",
                                     actor="t", requires_approval=True)[0] for n in range(4)]
    after = scrape(client)
    assert value(after, "switchboard_todos", endpoint="gate", queue="deploys",
                 state="awaiting_approval") == 4
    alice = transitions.Caller.operator(endpoint, "alice")
    transitions.approve_todo(alice, gated[0].pk)
    transitions.reject_todo(alice, gated[1].pk)
    transitions.cancel_todo(alice, gated[2].pk)
    transitions.cancel_todo(alice, gated[0].pk)
    after = scrape(client)
    assert moved(after, "switchboard_todo_approvals_total") == 1
    assert moved(after, "switchboard_todo_cancellations_total") == 3  # reject + two cancels
    assert value(after, "switchboard_todos", endpoint="gate", queue="deploys",
                 state="awaiting_approval") == 1


def test_agent_spend_counters_by_endpoint_never_go_down_when_history_is_pruned(client, operator):
    from ingest import sweeps as ingest_sweeps

    endpoint = EndpointFactory(slug="spender", owner=operator)
    caller = transitions.Caller.agent(endpoint, "s-1")
    for cost in (0.25, 0.5):
        todo = transitions.create_todo(endpoint=endpoint, queue="inbox", title="t", actor="t")[0]
        held = transitions.claim_todo(caller, todo.pk)
        transitions.complete_todo(caller, todo.pk, lease_id=held.lease_id, usage_reported={
            "cost_usd": cost, "input_tokens": 100, "output_tokens": 10})
    before = scrape(client)
    assert value(before, "switchboard_agent_cost_usd_total", endpoint="spender") == 0.75
    assert value(before, "switchboard_agent_tokens_total", endpoint="spender") == 220
    pruned = ingest_sweeps.prune_history(now=timezone.now() + timedelta(days=400), pause_seconds=0)
    assert pruned["done_todos"] == 2
    after = scrape(client)
    assert value(after, "switchboard_agent_cost_usd_total", endpoint="spender") == 0.75
    assert value(after, "switchboard_agent_tokens_total", endpoint="spender") == 220


def test_agent_credentials_issued_and_revoked_are_counted(client, operator):
    from ingest import sweeps as ingest_sweeps

    endpoint = EndpointFactory(slug="creds", owner=operator)
    todo, _ = transitions.create_todo(endpoint=endpoint, queue="inbox", title="t", actor="t")
    agent = transitions.Caller.agent(endpoint, "session-a")
    before = scrape(client)
    token = transitions.issue_todo_token(transitions.claim_todo(agent, todo.pk))
    after = scrape(client)
    assert token and token not in str(after)
    issued = "switchboard_agent_credentials_issued_total"
    revoked = "switchboard_agent_credentials_revoked_total"
    assert value(after, issued, kind="todo_token") - value(before, issued, kind="todo_token") == 1
    transitions.complete_todo(agent, todo.pk)
    ingest_sweeps.revoke_ended_agent_tokens()
    after = scrape(client)
    assert value(after, revoked, kind="todo_token") - value(before, revoked, kind="todo_token") == 1
    assert (issued, (("kind", "repo_token"),)) in after
