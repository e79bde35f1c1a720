"""Traces (docs/operating.md#traces) against a real OTLP/HTTP receiver (tests/otlp_receiver.py):
a signed GitHub delivery carrying a ``traceparent`` header to a daphne process that exports,
a claim and a complete over MCP with the official SDK client, and the write-backs to the GitHub
stand-in sent from this process, which exports too — one trace, parented as the docs say, and
nothing secret in any attribute."""

import asyncio
import json
import os
import secrets
import subprocess
import sys
from datetime import timedelta

import httpx
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import Client
from django.utils import timezone

from channels_push.mcp import tools
from endpoints import transitions as endpoint_transitions
from ingest import transitions as ingest_transitions
from ingest import write_back
from ingest.tests import hook_client, signing
from ingest.tests.conftest import (SECRETS, app_connection, github, hooked,  # noqa: F401
                                   make_webhook)
from ingest.tests.github_standin import webhook_example
from switchboard import tracing
from tests.factories import EndpointFactory
from tests.mcp_clients import sdk_client
from tests.otlp_receiver import OtlpReceiver
from tests.servers import REPO_ROOT
from todos import sweeps as todo_sweeps
from todos import transitions as todo_transitions
from todos.models import Todo

# Spans leave a process this soon after they end (the SDK's default is 5 s).
EXPORT_DELAY = {"OTEL_BSP_SCHEDULE_DELAY": "50"}
# Every attribute a switchboard span may carry: ids, names, states, sizes, codes.
ALLOWED_ATTRIBUTES = {
    "http.request.method", "http.route", "http.response.status_code",
    "gen_ai.tool.name", "error.type",
    "switchboard.webhook_id", "switchboard.source", "switchboard.kind",
    "switchboard.delivery.size", "switchboard.todo_ids", "switchboard.todo_id",
    "switchboard.endpoint", "switchboard.queue",
    "switchboard.attempt", "switchboard.refusal", "switchboard.todos_listed",
    "switchboard.empty", "switchboard.queue_wait_seconds", "switchboard.duplicate",
    "switchboard.doorbell.rung", "switchboard.write_back.action",
    "switchboard.write_back.attempt", "switchboard.write_back.state",
    "switchboard.connection.kind", "switchboard.todos_moved",
}


def new_traceparent() -> str:
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


@pytest.fixture
def receiver():
    with OtlpReceiver() as running:
        yield running
        assert running.problems == [], "requests the OTLP/HTTP description refuses"


@pytest.fixture
def traced(receiver, monkeypatch):
    """This process exports to ``receiver`` (as a worker would), for the sends it makes."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    for name, value in EXPORT_DELAY.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    assert tracing.configure("worker")
    yield receiver
    tracing.shutdown()


def by_name(spans, name):
    found = [span for span in spans if span.name == name]
    assert found, f"no span {name!r} among {[span.name for span in spans]}"
    return found


def walk_attributes(spans, forbidden: list[str]) -> None:
    """Every exported attribute is one switchboard may export, and no value carries any of
    ``forbidden`` (secrets, the payload's and the result's text, the title)."""
    for span in spans:
        assert set(span.attributes) <= ALLOWED_ATTRIBUTES, (span.name, span.attributes)
        for value in span.attributes.values():
            text = json.dumps(value)
            for secret in forbidden:
                assert secret not in text, (span.name, secret)


@pytest.mark.django_db(transaction=True)
def test_one_trace_from_the_delivery_through_the_mcp_calls_to_the_write_backs(
        traced, start_daphne, hooked, github, endpoint, settings):
    settings.SWITCHBOARD_PUBLIC_URL = "https://sb.example"
    receiver = traced
    server = start_daphne(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url,
                          OTEL_RESOURCE_ATTRIBUTES="deployment.environment=test", **EXPORT_DELAY)
    credential = endpoint_transitions.rotate_credential(endpoint)
    sender = new_traceparent()
    _, sender_trace, sender_span, _ = sender.split("-")

    payload = webhook_example("issues", action="opened")
    payload.setdefault("installation", {"id": 4242, "node_id": "MDIzOkludGVncmF0aW9u"})
    body = signing.body_of(payload)
    headers = {hook_client._header_name(key): value
               for key, value in signing.github(SECRETS["github"], body).items()}
    answer = httpx.post(f"{server.url}/hooks/gh", content=body,
                        headers={**headers, "Content-Type": "application/json",
                                 "traceparent": sender})
    assert answer.status_code == 202, answer.text
    todo = Todo.objects.get(pk=answer.json()["todos"][0]["id"])
    assert todo.traceparent.split("-")[1] == sender_trace

    agent_side = new_traceparent()

    async def work():
        async with sdk_client(server.url, endpoint.slug, credential) as client:
            claimed = await client.call_tool("claim_next", {}, meta={"traceparent": agent_side})
            done = await client.call_tool(
                "complete", {"todo_id": str(todo.pk), "result": {"summary": "fixed it"}})
            return claimed.structured_content["todo"], done.structured_content["todo"]

    claimed, done = asyncio.run(work())
    assert claimed["id"] == str(todo.pk) and done["state"] == "done"
    assert claimed["traceparent"] == todo.traceparent
    assert write_back.send_due_write_backs() == 2  # the ack, then the living status
    tracing.force_flush()

    names = ["POST /hooks/{slug}", "doorbell", "tools/call claim_next", "tools/call complete",
             "write_back ack", "write_back status"]
    spans = receiver.wait_for(lambda got: {span.name for span in got} >= set(names))
    ours = [span for span in spans if span.trace_id == sender_trace]
    (delivery,) = by_name(ours, "POST /hooks/{slug}")
    assert delivery.parent_span_id == sender_span
    assert todo.traceparent == f"00-{sender_trace}-{delivery.span_id}-01"
    assert delivery.attributes["switchboard.todo_ids"] == [str(todo.pk)]
    assert delivery.attributes["http.response.status_code"] == 202
    assert delivery.resource["service.name"] == "switchboard"
    assert delivery.resource["switchboard.process"] == "web"
    assert delivery.resource["deployment.environment"] == "test"
    for name in names[1:]:
        (span,) = by_name(ours, name)
        assert span.parent_span_id == delivery.span_id, name
        assert span.attributes["switchboard.todo_id"] == str(todo.pk), name
    (claim,) = by_name(ours, "tools/call claim_next")
    assert claim.attributes["switchboard.endpoint"] == endpoint.slug
    assert claim.attributes["switchboard.queue"] == "inbox"
    assert claim.attributes["gen_ai.tool.name"] == "claim_next"
    assert claim.attributes["switchboard.queue_wait_seconds"] >= 0
    assert claim.links == [tuple(agent_side.split("-")[1:3])]
    (ack,) = by_name(ours, "write_back ack")
    assert ack.attributes["switchboard.write_back.state"] == "sent"
    assert ack.resource["switchboard.process"] == "worker"
    walk_attributes(spans, [SECRETS["github"], credential, github.token, payload["issue"]["title"],
                            payload["issue"]["body"] or "", todo.title, "fixed it",
                            payload["sender"]["login"]])


@pytest.mark.django_db
def test_a_refused_call_is_a_span_in_its_todos_trace_with_its_code(traced, endpoint):
    sender = new_traceparent()
    with tracing.delivery("test arrival", sender):
        todo, _ = todo_transitions.create_todo(endpoint=endpoint, queue="inbox", title="t",
                                               actor="x")
    result = tools.call_tool(endpoint=endpoint, session_id="session-a",
                             params={"name": "complete", "arguments": {"todo_id": str(todo.pk)}})
    assert result.is_error
    listing = tools.call_tool(endpoint=endpoint, session_id="session-a",
                              params={"name": "list_todos", "arguments": {}})
    tracing.force_flush()
    spans = traced.wait_for(lambda got: len(got) >= 3)
    (refused,) = by_name(spans, "tools/call complete")
    (arrival,) = by_name(spans, "test arrival")
    assert refused.trace_id == arrival.trace_id == sender.split("-")[1]
    assert refused.parent_span_id == arrival.span_id
    assert refused.attributes["switchboard.refusal"] == "lease_lost"
    (listed,) = by_name(spans, "tools/call list_todos")
    assert listing.structured_content["todos"][0]["traceparent"] == todo.traceparent
    assert listed.attributes["switchboard.todos_listed"] == 1
    assert listed.links == [(arrival.trace_id, arrival.span_id)]


def call(endpoint, name, **arguments):
    return tools.call_tool(endpoint=endpoint, session_id="session-a",
                           params={"name": name, "arguments": arguments})


@pytest.mark.django_db
def test_a_refused_call_records_no_client_text_as_its_todo_id(traced, endpoint):
    """Only the id of a todo the caller may see is recorded: not the text an agent passed,
    nor an id of a todo that is missing, of another endpoint or outside the caller's scope."""
    elsewhere, _ = todo_transitions.create_todo(endpoint=EndpointFactory(), queue="inbox",
                                                title="t", actor="x")
    endpoint.scope = ["inbox"]
    endpoint.save()
    out_of_scope, _ = todo_transitions.create_todo(endpoint=endpoint, queue="other", title="t",
                                                   actor="x")
    leaked = "ghp_pasted-by-mistake-0123456789"
    passed = [leaked, "٤٢", "²", "1" * 40, str(elsewhere.pk), str(out_of_scope.pk),
              "9" * 18, -3, 2**70, True]
    for todo_id in passed:
        assert call(endpoint, "heartbeat", todo_id=todo_id).is_error, todo_id
    tracing.force_flush()
    spans = traced.wait_for(lambda got: len(got) >= len(passed))
    refused = by_name(spans, "tools/call heartbeat")
    assert len(refused) == len(passed)
    for span in refused:
        assert "switchboard.todo_id" not in span.attributes, span.attributes
        assert span.attributes["switchboard.refusal"] in ("not_found", "invalid_argument")
    walk_attributes(spans, [leaked, "٤٢", "1" * 40])


@pytest.mark.django_db
def test_a_refused_call_by_integer_id_joins_its_todos_trace_with_queue_and_attempt(
        traced, endpoint, agent):
    sender = new_traceparent()
    with tracing.delivery("test arrival", sender):
        todo, _ = todo_transitions.create_todo(endpoint=endpoint, queue="inbox", title="t",
                                               actor="x")
    todo_transitions.claim_todo(agent, todo.pk)
    assert call(endpoint, "complete", todo_id=todo.pk, lease_id="not-the-lease").is_error
    assert call(endpoint, "claim", todo_id=todo.pk).is_error
    tracing.force_flush()
    spans = traced.wait_for(lambda got: len(got) >= 3)
    (arrival,) = by_name(spans, "test arrival")
    for name, code in (("tools/call complete", "lease_lost"),
                       ("tools/call claim", "not_claimable")):
        (refused,) = by_name(spans, name)
        assert (refused.trace_id, refused.parent_span_id) == (arrival.trace_id, arrival.span_id)
        assert refused.attributes["switchboard.refusal"] == code
        assert refused.attributes["switchboard.todo_id"] == str(todo.pk)
        assert refused.attributes["switchboard.queue"] == "inbox"
        assert refused.attributes["switchboard.attempt"] == 1


@pytest.mark.django_db
def test_a_hand_over_continues_its_requests_traceparent(traced, endpoint, operator):
    token = ingest_transitions.mint_operator_token(user=operator, name="laptop")[1]
    sender = new_traceparent()
    answer = Client().post(f"/api/v1/endpoints/{endpoint.slug}/todos",
                           content_type="application/json",
                           data={"queue": "inbox", "title": "rotate the keys",
                                 "secrets": {"deploy_token": "tok-very-secret-123"}},
                           HTTP_AUTHORIZATION=f"Bearer {token}", HTTP_TRACEPARENT=sender)
    assert answer.status_code == 201, answer.content
    tracing.force_flush()
    spans = traced.wait_for(lambda got: len(got) >= 1)
    (hand_over,) = by_name(spans, "POST /api/v1/endpoints/{slug}/todos")
    assert (hand_over.trace_id, hand_over.parent_span_id) == tuple(sender.split("-")[1:3])
    assert answer.json()["todo"]["traceparent"] == (
        f"00-{hand_over.trace_id}-{hand_over.span_id}-01")
    assert hand_over.attributes["switchboard.todo_id"] == answer.json()["todo"]["id"]
    walk_attributes(spans, [token, "tok-very-secret-123", "rotate the keys"])


@pytest.mark.django_db
def test_a_sweep_over_several_todos_links_to_each_ones_trace(traced, endpoint, agent):
    made = []
    for _ in range(2):
        with tracing.delivery("test arrival", new_traceparent()):
            made.append(todo_transitions.create_todo(endpoint=endpoint, queue="inbox",
                                                     title="t", actor="x")[0])
    for todo in made:
        todo_transitions.claim_todo(agent, todo.pk, lease_ttl_seconds=30)
    assert todo_sweeps.expire_lapsed_leases(now=timezone.now() + timedelta(minutes=5)) == 2
    tracing.force_flush()
    spans = traced.wait_for(lambda got: "sweep expire_lapsed_leases" in {s.name for s in got})
    (sweep,) = by_name(spans, "sweep expire_lapsed_leases")
    arrivals = by_name(spans, "test arrival")
    assert sorted(sweep.links) == sorted((span.trace_id, span.span_id) for span in arrivals)
    assert sweep.trace_id not in {span.trace_id for span in arrivals}
    assert sweep.attributes == {"switchboard.todos_moved": 2}


@pytest.mark.django_db
def test_traces_off_a_delivery_still_keeps_the_senders_valid_traceparent(hooked):
    assert not tracing.enabled()
    sender = new_traceparent()
    for number, (header, kept) in enumerate((
            (sender, sender), ("00-" + "0" * 32 + "-" + "1" * 16 + "-01", None),
            ("not a traceparent", None), (sender.upper(), None))):
        payload = webhook_example("issues", action="opened")
        payload["issue"]["number"] += number  # another body each time, not a replay
        body = signing.body_of(payload)
        answer = hook_client.post("gh", body, HTTP_TRACEPARENT=header,
                                  **signing.github(SECRETS["github"], body))
        assert answer.status_code == 202, answer.content
        assert Todo.objects.get(pk=answer.json()["todos"][0]["id"]).traceparent == kept, header


@pytest.mark.parametrize("variable, value", [
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"), ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc"),
    ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json"), ("OTEL_TRACES_EXPORTER", "console")])
def test_an_unsupported_setting_is_refused_in_one_line_naming_its_variable(
        monkeypatch, variable, value):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as refused:
        tracing.start("web")
    said = str(refused.value.code)
    assert said.startswith(f"switchboard: {variable}={value!r} is not supported")
    assert ("'http/protobuf'" if "PROTOCOL" in variable else "'otlp'") in said
    assert "\n" not in said
    assert not tracing.enabled()


def test_a_web_process_with_an_unsupported_protocol_stops_with_one_line():
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    env.update(DJANGO_SETTINGS_MODULE="switchboard.settings_test",
               OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:4318",
               OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="grpc")
    done = subprocess.run([sys.executable, "-m", "daphne", "--port", "0",
                           "switchboard.asgi:application"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "switchboard: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='grpc' is not supported: switchboard "
        "exports traces over 'http/protobuf' only (set "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf or unset it)"]


@pytest.mark.parametrize("environment, reason", [
    ({}, "OTEL_EXPORTER_OTLP_ENDPOINT is not set"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_SDK_DISABLED": "TRUE"},
     "OTEL_SDK_DISABLED=true"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_TRACES_EXPORTER": "none"},
     "OTEL_TRACES_EXPORTER=none")])
def test_a_process_says_at_start_that_traces_are_off_and_why(
        monkeypatch, caplog, environment, reason):
    for name in [name for name in os.environ if name.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level("INFO", logger="switchboard.tracing"):
        assert not tracing.start("worker")
    (said,) = caplog.records
    assert (said.getMessage(), said.role, said.reason) == ("traces off", "worker", reason)


@pytest.mark.parametrize("variable, value, shown", [
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://user:pass-word@{host}/", "http://{host}/v1/traces"),
    ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://k3y@{host}/v1/traces",
     "http://{host}/v1/traces")])
def test_a_process_says_at_start_where_traces_go(receiver, monkeypatch, caplog, variable,
                                                   value, shown):
    host = receiver.url.removeprefix("http://")
    monkeypatch.setenv(variable, value.format(host=host))
    monkeypatch.setenv("OTEL_SERVICE_NAME", "sb-test")
    with caplog.at_level("INFO", logger="switchboard.tracing"):
        try:
            assert tracing.start("beat")
            with tracing.span("hello"):
                pass
        finally:
            tracing.shutdown()
    (said,) = [record for record in caplog.records if record.name == "switchboard.tracing"]
    assert (said.getMessage(), said.role, said.endpoint, said.service) == (
        "traces on", "beat", shown.format(host=host), "sb-test")
    assert "pass-word" not in said.endpoint and "k3y" not in said.endpoint
    assert [span.name for span in receiver.wait_for(lambda got: got)] == ["hello"]


def test_unset_nothing_of_the_sdk_or_the_exporter_is_imported():
    """The web process's modules, the hot paths among them, with no OTLP endpoint: the SDK and
    the exporter are never imported (the OpenTelemetry API is: the mcp SDK imports it)."""
    script = (
        "import django, sys; django.setup();"
        "import switchboard.asgi, ingest.hook, ingest.api, channels_push.mcp.tools,"
        " ingest.write_back, channels_push.doorbells.doorbells, switchboard.celery;"
        "from switchboard import tracing; assert not tracing.enabled();"
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk',"
        " 'opentelemetry.exporter', 'opentelemetry.proto', 'google.protobuf'))))")
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    env["DJANGO_SETTINGS_MODULE"] = "switchboard.settings_test"
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.django_db
def test_a_todo_from_the_consoles_form_starts_its_own_trace(traced, endpoint, operator):
    browser = Client()
    browser.force_login(operator)
    answer = browser.post("/todos/new", {"endpoint": endpoint.slug, "queue": "inbox",
                                         "title": "rotate the keys", "idempotency_key": "k-1"})
    assert answer.status_code == 302, answer.content
    todo = Todo.objects.get()
    assert browser.post("/todos/new", {"endpoint": endpoint.slug, "queue": "inbox",
                                       "title": "rotate the keys",
                                       "idempotency_key": "k-1"}).status_code == 302
    tracing.force_flush()
    spans = traced.wait_for(lambda got: len(got) >= 2)
    first, repeat = by_name(spans, "POST /todos/new")
    assert first.parent_span_id == "" and first.kind == 2  # a server span starting a trace
    assert todo.traceparent.startswith(f"00-{first.trace_id}-{first.span_id}-")
    assert first.attributes["switchboard.todo_id"] == str(todo.pk)
    assert first.attributes["http.response.status_code"] == 302
    assert repeat.attributes["switchboard.duplicate"] is True
    assert repeat.links == [(first.trace_id, first.span_id)]
    walk_attributes(spans, ["rotate the keys"])


@pytest.mark.django_db
def test_a_repeated_hand_over_links_to_the_trace_of_the_todo_it_found(traced, endpoint,
                                                                       operator):
    token = ingest_transitions.mint_operator_token(user=operator, name="laptop")[1]
    answers = [Client().post(f"/api/v1/endpoints/{endpoint.slug}/todos",
                             content_type="application/json",
                             data={"queue": "inbox", "title": "t", "idempotency_key": "same"},
                             HTTP_AUTHORIZATION=f"Bearer {token}") for _ in range(2)]
    assert [answer.status_code for answer in answers] == [201, 200]
    tracing.force_flush()
    spans = traced.wait_for(lambda got: len(got) >= 2)
    first, repeat = by_name(spans, "POST /api/v1/endpoints/{slug}/todos")
    assert answers[1].json()["todo"]["traceparent"].startswith(
        f"00-{first.trace_id}-{first.span_id}-")
    assert repeat.attributes["switchboard.duplicate"] is True
    assert repeat.links == [(first.trace_id, first.span_id)]


@pytest.mark.django_db
def test_a_redelivery_starts_its_own_trace_linked_to_the_originals(traced, hooked):
    from ingest import queries as ingest_queries
    from ingest.models import DeliveryRecord, Outcome

    sender = new_traceparent()
    body = signing.body_of(webhook_example("issues", action="opened"))
    answer = hook_client.post("gh", body, HTTP_TRACEPARENT=sender,
                              **signing.github(SECRETS["github"], body))
    assert answer.status_code == 202, answer.content
    original = Todo.objects.get(pk=answer.json()["todos"][0]["id"])
    Todo.objects.filter(pk=original.pk).update(state="done")  # no live todo holds its work
    record = DeliveryRecord.objects.get(outcome=Outcome.ACCEPTED)
    webhook, routes = ingest_queries.find_webhook_with_routes("gh")
    arrival = ingest_transitions.redeliver(record, operator=webhook.owner, routes=routes)
    (again, created), = arrival.todos
    assert created and again.traceparent != original.traceparent
    tracing.force_flush()
    spans = traced.wait_for(lambda got: "redeliver" in {span.name for span in got})
    (redelivery,) = by_name(spans, "redeliver")
    assert redelivery.parent_span_id == "" and redelivery.trace_id != sender.split("-")[1]
    assert redelivery.links == [tuple(original.traceparent.split("-")[1:3])]
    assert again.traceparent.startswith(f"00-{redelivery.trace_id}-{redelivery.span_id}-")
    assert redelivery.attributes["switchboard.todo_ids"] == [str(again.pk)]


@pytest.mark.django_db
def test_an_unsampled_meta_traceparent_is_neither_linked_nor_a_root(traced, endpoint):
    """An unsampled one names a span nobody exported (a runner drops the mcp SDK's spans of
    calls made outside its own spans, docs/runner.md#traces): a claim links to no such span,
    and an idle poll follows its caller's decision and exports nothing."""
    unsampled = new_traceparent()[:-2] + "00"
    with tracing.delivery("test arrival", new_traceparent()):
        todo_transitions.create_todo(endpoint=endpoint, queue="inbox", title="t", actor="x")
    for _ in range(2):  # the todo, then an empty queue
        tools.call_tool(endpoint=endpoint, session_id="session-a",
                        params={"name": "claim_next", "arguments": {},
                                "_meta": {"traceparent": unsampled}})
    with tracing.span("marker"):
        pass
    tracing.force_flush()
    spans = traced.wait_for(lambda got: "marker" in {span.name for span in got})
    (arrival,) = by_name(spans, "test arrival")
    (claim,) = by_name(spans, "tools/call claim_next")
    assert (claim.parent_span_id, claim.links) == (arrival.span_id, [])


def test_the_exporters_failures_are_logged_without_the_urls_query_or_userinfo(
        monkeypatch, caplog):
    import socket

    with socket.socket() as closed:  # a port nothing listens on: the export is refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                       f"http://user:pass-word@127.0.0.1:{port}/v1/traces?api_key=SECRET-KEY")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "5")  # room for one retry
    with caplog.at_level("WARNING"):
        try:
            assert tracing.configure("worker")
            with tracing.span("hello"):
                pass
            tracing.force_flush()
        finally:
            tracing.shutdown()
    exported = [record for record in caplog.records if record.name.startswith("opentelemetry")]
    assert exported, caplog.text
    assert "SECRET-KEY" not in caplog.text and "pass-word" not in caplog.text
    assert "/v1/traces" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_celery_worker_process_puts_its_write_back_in_the_deliverys_trace(
        receiver, start_daphne, hooked, github, endpoint, tmp_path):
    """The web process and a real ``celery worker`` both export: the ack the worker sends to the
    GitHub stand-in is a span of that worker's, child of the delivery's span."""
    exporting = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, **EXPORT_DELAY}
    server = start_daphne(**exporting)
    log = (tmp_path / "worker.log").open("w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "switchboard", "worker", "--pool", "solo",
         "--without-gossip", "--without-mingle", "--loglevel", "INFO"], cwd=REPO_ROOT,
        env={**server.env, **exporting, "DJANGO_SETTINGS_MODULE": "switchboard.settings_test"},
        stdout=log, stderr=subprocess.STDOUT)
    try:
        sender = new_traceparent()
        payload = webhook_example("issues", action="opened")
        payload.setdefault("installation", {"id": 4242, "node_id": "MDIzOkludGVncmF0aW9u"})
        body = signing.body_of(payload)
        headers = {hook_client._header_name(key): value
                   for key, value in signing.github(SECRETS["github"], body).items()}
        answer = httpx.post(f"{server.url}/hooks/gh", content=body,
                            headers={**headers, "Content-Type": "application/json",
                                     "traceparent": sender})
        assert answer.status_code == 202, answer.text
        spans = receiver.wait_for(lambda got: "write_back ack" in {s.name for s in got})
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        log.close()
    (delivery,) = by_name(spans, "POST /hooks/{slug}")
    (ack,) = by_name(spans, "write_back ack")
    assert (ack.trace_id, ack.parent_span_id) == (sender.split("-")[1], delivery.span_id)
    assert ack.resource["switchboard.process"] == "worker"
    assert ack.attributes["switchboard.write_back.state"] == "sent"
    assert delivery.resource["switchboard.process"] == "web"
