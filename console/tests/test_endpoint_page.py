"""The endpoint's page: counts per queue, presence, pause, live sessions by client name, how to
connect, the credential only as its hint, rotation shown once, 404 for another's endpoint."""

import re
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from channels_push.sessions import transitions as session_transitions
from endpoints import connect_snippets
from endpoints import transitions as endpoint_transitions
from tests.factories import UserFactory
from todos import transitions
from todos.models import State, Todo, Trust

pytestmark = pytest.mark.django_db


@pytest.fixture
def vended(db):
    owner = UserFactory(username="alice")
    endpoint, credential = endpoint_transitions.vend_endpoint(slug="builds", owner=owner)
    return endpoint, credential


@pytest.fixture
def owner_client(vended):
    browser = Client()
    browser.force_login(vended[0].owner)
    return browser


def make(endpoint, queue, state, **fields):
    todo, _ = transitions.create_todo(endpoint=endpoint, queue=queue, title=f"{queue} {state}",
                                      actor="test", trust=Trust.OPERATOR)
    if state != State.PENDING or fields:
        # Test setup only: put a row straight into the state the counts read.
        Todo.objects.filter(pk=todo.pk).update(state=state, **fields)
    return todo


def test_counts_per_queue_cover_every_open_state_and_done_in_a_day(vended, owner_client):
    endpoint, _ = vended
    now = timezone.now()
    make(endpoint, "inbox", State.PENDING)
    make(endpoint, "inbox", State.PENDING)
    make(endpoint, "inbox", State.CLAIMED, lease_owner="x" * 43)
    make(endpoint, "inbox", State.FAILED, retry_at=now + timedelta(minutes=1))
    make(endpoint, "inbox", State.FAILED, dead_lettered_at=now)
    # Done counts come from the audit trail (the throughput tallies): completed for real.
    operator = transitions.Caller.operator(endpoint, "alice")
    for queue, ago in (("inbox", timedelta(hours=1)), ("inbox", timedelta(hours=30)),  # too old
                       ("deploys", timedelta(minutes=5))):
        todo, _ = transitions.create_todo(endpoint=endpoint, queue=queue, title="done",
                                          actor="test", trust=Trust.OPERATOR, now=now - ago)
        transitions.claim_todo(operator, todo.pk, now=now - ago)
        transitions.complete_todo(operator, todo.pk, now=now - ago)
    page = owner_client.get("/todos/endpoints/builds/").content.decode()
    inbox = re.search(r'<tr data-queue="inbox">(.*?)</tr>', page, re.S).group(1)
    cells = dict(re.findall(r'<td class="n-(\w+)">(\d+)</td>', inbox))
    assert {"pending": "2", "claimed": "1", "retrying": "1", "dead": "1", "done": "1"}.items() \
        <= cells.items()
    deploys = re.search(r'<tr data-queue="deploys">(.*?)</tr>', page, re.S).group(1)
    assert dict(re.findall(r'<td class="n-(\w+)">(\d+)</td>', deploys))["done"] == "1"


def test_the_page_costs_the_same_queries_however_many_queues_and_sessions(
        vended, owner_client, django_assert_num_queries):
    endpoint, _ = vended

    def grow(n):
        for i in range(n):
            make(endpoint, f"q{i}-{n}", State.PENDING)
            session_transitions.open_session(endpoint=endpoint, protocol_version="2025-11-25",
                                             client_name="claude-code", client_version="2.1",
                                             credential_id=endpoint.credentials.get().pk)

    grow(2)
    owner_client.get("/todos/endpoints/builds/")  # warm the session and user caches alike
    # session + user, endpoint, sessions, credentials, the glance (open counts, the fold row,
    # the tallies, the unfolded events), the day's spend, the user's permissions (its own and
    # its groups': may it change the budget)
    with django_assert_num_queries(12):
        assert owner_client.get("/todos/endpoints/builds/").status_code == 200
    grow(12)
    with django_assert_num_queries(12):
        assert owner_client.get("/todos/endpoints/builds/").status_code == 200


def test_live_sessions_show_the_client_and_never_a_session_id(vended, owner_client):
    endpoint, _ = vended
    credential_id = endpoint.credentials.get().pk
    live = session_transitions.open_session(endpoint=endpoint, protocol_version="2025-11-25",
                                            client_name="claude-code", client_version="2.1.3",
                                            credential_id=credential_id)
    ended = session_transitions.open_session(endpoint=endpoint, protocol_version="2025-11-25",
                                             client_name="old-runner", client_version="0.1",
                                             credential_id=credential_id)
    type(ended).objects.filter(pk=ended.pk).update(terminated_at=timezone.now())
    page = owner_client.get("/todos/endpoints/builds/").content.decode()
    sessions = page.split('id="sessions"', 1)[1].split("</table>", 1)[0]
    assert f"claude-code 2.1.3 · {live.pk[:8]}" in sessions
    assert "attached" in sessions  # it made its request (initialize) just now
    assert "old-runner" not in sessions
    assert live.pk not in page and ended.pk not in page


def test_connection_snippets_name_the_variable_never_the_credential(vended, owner_client):
    endpoint, credential = vended
    page = owner_client.get("/todos/endpoints/builds/").content.decode()
    assert "/mcp/builds" in page
    assert credential not in page
    assert endpoint.credentials.get().hint in page
    for _, _, text in connect_snippets.all_snippets(
            re.search(r'<code id="mcp-url">(.*?)</code>', page).group(1)):
        assert text.replace('"', "&quot;").replace("'", "&#x27;") in page


def test_snippets_say_what_each_client_needs():
    url = "https://sb.example.com/mcp/builds"
    assert connect_snippets.mcp_json(url)["mcpServers"]["switchboard"]["headers"] == {
        "Authorization": "Bearer ${SWITCHBOARD_TOKEN}"}
    add = connect_snippets.claude_mcp_add(url)
    assert add.startswith("claude mcp add --transport http --scope local switchboard ")
    assert add.endswith("--header 'Authorization: Bearer ${SWITCHBOARD_TOKEN}'")
    codex = connect_snippets.codex_config_toml(url)
    assert 'bearer_token_env_var = "SWITCHBOARD_TOKEN"' in codex
    timeout = int(re.search(r"tool_timeout_sec = (\d+)", codex).group(1))
    assert timeout > connect_snippets.LONGEST_LONG_POLL_SECONDS
    gemini = connect_snippets.gemini_settings_json(url)["mcpServers"]["switchboard"]
    assert gemini["httpUrl"] == url and gemini["trust"] is True and gemini["headers"]
    runner = connect_snippets.runner_line(url)
    assert runner.startswith(f"switchboard-runner --url {url} --token-env SWITCHBOARD_TOKEN "
                             "--require-settled --pass-env ANTHROPIC_API_KEY -- "
                             "claude -p '{prompt}' ")
    assert "{title}" not in runner  # the sender's text never sits where the agent reads orders


def test_the_longest_long_poll_is_the_one_claim_next_grants():
    from channels_push.mcp import schemas as mcp_schemas
    assert connect_snippets.LONGEST_LONG_POLL_SECONDS == mcp_schemas.MAX_WAIT_SECONDS


def test_rotate_shows_the_new_credential_once_and_needs_csrf(vended):
    endpoint, old = vended
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(endpoint.owner)
    assert strict.post("/todos/endpoints/builds/rotate").status_code == 403
    page = strict.get("/todos/endpoints/builds/").content.decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
    rotated = strict.post("/todos/endpoints/builds/rotate", {"csrfmiddlewaretoken": token})
    assert rotated.status_code == 200
    assert "no-store" in rotated["Cache-Control"]
    shown = re.search(r"export SWITCHBOARD_TOKEN=(\S+)</code>", rotated.content.decode()).group(1)
    assert shown != old and endpoint.credentials.count() == 2
    assert endpoint_transitions.hash_credential(shown) in set(
        endpoint.credentials.values_list("digest", flat=True))
    again = strict.get("/todos/endpoints/builds/").content.decode()
    assert shown not in again and shown[:12] in again


def test_another_operators_endpoint_is_404_and_a_superuser_sees_all(vended):
    bob = Client()
    bob.force_login(UserFactory(username="bob"))
    assert bob.get("/todos/endpoints/builds/").status_code == 404
    assert bob.post("/todos/endpoints/builds/rotate").status_code == 404
    assert bob.get("/todos/endpoints/nope/").status_code == 404
    assert "builds" not in bob.get("/todos/endpoints/").content.decode()
    root = Client()
    root.force_login(UserFactory(username="root", is_superuser=True, is_staff=True))
    assert root.get("/todos/endpoints/builds/").status_code == 200
    assert 'href="/todos/endpoints/builds/"' in root.get("/todos/endpoints/").content.decode()


def test_the_page_needs_a_login(vended):
    response = Client().get("/todos/endpoints/builds/")
    assert response.status_code == 302 and "/accounts/login/" in response["Location"]


def test_a_session_with_an_open_stream_shows_as_streaming(vended, owner_client):
    endpoint, _ = vended
    session = session_transitions.open_session(endpoint=endpoint, protocol_version="2025-11-25",
                                               client_name="codex", client_version="0.5",
                                               credential_id=endpoint.credentials.get().pk)
    page = owner_client.get("/todos/endpoints/builds/").content.decode()
    assert "streaming</span>" not in page.split('id="sessions"', 1)[1]
    type(session).objects.filter(pk=session.pk).update(
        open_streams=1, stream_lease_until=timezone.now() + timedelta(minutes=5))
    page = owner_client.get("/todos/endpoints/builds/").content.decode()
    assert "streaming</span>" in page.split('id="sessions"', 1)[1]


def test_the_page_shows_the_endpoints_caps_when_it_has_any(vended, owner_client):
    endpoint, _ = vended
    page = owner_client.get("/todos/endpoints/builds/").content.decode()
    assert "no cap on claimed work" in page
    from console import views

    endpoint.max_claimed, endpoint.queue_limits = 3, {"deploys": 1}
    assert views.endpoint_caps(endpoint) == ["at most 3 claimed at once",
                                             "deploys: at most 1 claimed"]


def test_the_sessions_rows_alone_for_the_live_page(vended, owner_client):
    endpoint, _ = vended
    live = session_transitions.open_session(endpoint=endpoint, protocol_version="2025-11-25",
                                            client_name="codex-mcp-client", client_version="0.58",
                                            credential_id=endpoint.credentials.get().pk)
    rows = owner_client.get("/todos/endpoints/builds/sessions").content.decode()
    assert f"codex-mcp-client 0.58 · {live.pk[:8]}" in rows and live.pk not in rows
    stranger = Client()
    stranger.force_login(UserFactory(username="mallory"))
    assert stranger.get("/todos/endpoints/builds/sessions").status_code == 404


# -- concurrency caps (docs/work-control.md#caps) -----------------------------------------------


def test_the_page_shows_the_caps_and_the_claimed_count_against_them(vended, owner_client):
    endpoint, _ = vended
    endpoint_transitions.set_claim_caps(endpoint, max_claimed=1, queue_limits={"deploys": 1},
                                        actor="alice")
    make(endpoint, "deploys", State.CLAIMED, lease_owner="x" * 43)
    page = owner_client.get("/todos/endpoints/builds/").content.decode()
    caps = re.search(r'<div class="card" id="caps">(.*?)</form>', page, re.S).group(1)
    assert "at most 1 claimed at once" in caps and "deploys: at most 1 claimed" in caps
    assert "1 claimed now" in caps and "at capacity" in caps and 'value="deploys=1"' in caps


def test_the_caps_form_saves_and_a_negative_cap_is_a_400_naming_the_field(vended, owner_client):
    endpoint, _ = vended
    saved = owner_client.post("/todos/endpoints/builds/limits",
                              {"max_claimed": "3", "queue_limits": "deploys=1, inbox=2"})
    assert saved.status_code == 302
    endpoint.refresh_from_db()
    assert (endpoint.max_claimed, endpoint.queue_limits) == (3, {"deploys": 1, "inbox": 2})
    for form, field in [({"max_claimed": "-1"}, "max_claimed"),
                        ({"max_claimed": "", "queue_limits": "deploys=-1"}, "queue_limits"),
                        ({"max_claimed": "two"}, "max_claimed")]:
        refused = owner_client.post("/todos/endpoints/builds/limits", form)
        assert refused.status_code == 400 and field in refused.content.decode()
        endpoint.refresh_from_db()
        assert (endpoint.max_claimed, endpoint.queue_limits) == (3, {"deploys": 1, "inbox": 2})
    cleared = owner_client.post("/todos/endpoints/builds/limits",
                                {"max_claimed": "", "queue_limits": "inbox=2"})
    assert cleared.status_code == 302
    endpoint.refresh_from_db()
    assert (endpoint.max_claimed, endpoint.queue_limits) == (None, {"inbox": 2})


def test_another_operators_caps_form_is_a_404(vended):
    browser = Client()
    browser.force_login(UserFactory(username="mallory"))
    assert browser.post("/todos/endpoints/builds/limits", {"max_claimed": "0"}).status_code == 404
