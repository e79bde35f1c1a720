"""The Todos board in a real browser (Debian's chromium through Playwright) against daphne.

A signed GitHub webhook delivered by the test appears live with its trust badge, changes made
by an agent show without a reload, the operator claims and completes it with the buttons, and
the todo page shows the history. A second test drops the server under a connected board and
checks that it catches up. Screenshots land in the test's tmp dir."""

import hashlib
import hmac
import json
import os
import threading
import uuid
from pathlib import Path

import httpx

import pytest
from django.db import connection

from tests.factories import EndpointFactory, UserFactory
from ingest import transitions as ingest_transitions
from tests.processes import DEADLINE_SECONDS
from tests.servers import DaphneServer
from todos import transitions
from todos.models import Todo, Trust

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
WAIT_MS = int(DEADLINE_SECONDS * 1000)

if not CHROMIUM.exists():
    if os.environ.get("CI"):
        raise RuntimeError("CI must install Debian's chromium (apt-get install -y chromium)")
    pytest.skip("no /usr/bin/chromium: `bash scripts/test` installs it when run as root "
                "(CI does, and fails without it)", allow_module_level=True)

sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright


def start_board_server():
    # Test settings in the server too: the test process hashes passwords with their fast hasher.
    return DaphneServer(env={"DJANGO_SETTINGS_MODULE": "switchboard.settings_test"}).start()


@pytest.fixture
def live_daphne(transactional_db):
    server = start_board_server()
    yield server
    server.stop()


def in_thread(fn, *args, **kwargs):
    """Run ORM work off the thread Playwright's event loop lives on, and commit it."""
    box = {}

    def target():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # re-raised in the test thread
            box["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(60)
    if "error" in box:
        raise box["error"]
    return box.get("value")


def launch_chromium(playwright):
    return playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)


def new_watched_page(browser):
    """A wide page and the list of what the CSP blocked on it: the pages run under the CSP (no
    inline script or style), so that list must stay empty."""
    page = browser.new_page(viewport={"width": 1400, "height": 800})
    page.set_default_timeout(WAIT_MS)
    blocked = []
    page.on("console", lambda message: blocked.append(message.text)
            if "Content Security Policy" in message.text else None)
    return page, blocked


def sign_in(page, base_url, username="alice"):
    page.goto(base_url + "/todos/")
    assert "/accounts/login/" in page.url
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", "pw-for-tests")
    page.click("button[type=submit]")
    page.wait_for_url("**/todos/")
    page.wait_for_selector("#live.on")
    page.wait_for_selector("#board[data-synced]")  # first re-sync done: subscribed


def deliver_github_issue(base_url, webhook_slug, secret, title, number=7):
    """POST a signed GitHub ``issues.opened`` delivery about issue ``number``, as GitHub would;
    returns the todo id. Another number is another thread: its own todo, not a follow-up."""
    body = json.dumps({"action": "opened", "issue": {"number": number, "title": title},
                       "repository": {"full_name": "acme/widgets"}}).encode()
    signature = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    response = httpx.post(f"{base_url}/hooks/{webhook_slug}", content=body, timeout=30, headers={
        "Content-Type": "application/json", "X-GitHub-Event": "issues",
        "X-GitHub-Delivery": str(uuid.uuid4()), "X-Hub-Signature-256": f"sha256={signature}",
    })
    assert response.status_code == 202, response.text
    (routed,) = response.json()["todos"]
    return int(routed["id"])


def test_board_shows_a_todo_live_and_the_operator_claims_and_completes_it(live_daphne, tmp_path):
    alice = UserFactory(username="alice")
    endpoint = EndpointFactory(slug="agent", owner=alice)
    webhook, secret = ingest_transitions.create_webhook(slug="widgets", owner=alice, source="github")
    ingest_transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="inbox")
    bob = UserFactory(username="bob")
    bobs = EndpointFactory(slug="bobs", owner=bob)
    agent = transitions.Caller.agent(endpoint, "session-a")

    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            page, blocked = new_watched_page(browser)
            sign_in(page, live_daphne.url)
            page.evaluate("window.__sameDocument = true")
            assert "frame-ancestors 'none'" in httpx.get(f"{live_daphne.url}/accounts/login/",
                                                       timeout=DEADLINE_SECONDS) \
                .headers["content-security-policy"]
            assert page.evaluate("getComputedStyle(document.body).marginTop") == "0px"  # board.css

            in_thread(transitions.create_todo, endpoint=bobs, queue="inbox",
                      title="bob's todo must not show", actor="test", trust=Trust.SIGNED)
            todo_pk = deliver_github_issue(live_daphne.url, "widgets", secret, "Deploy the release")
            todo = in_thread(Todo.objects.get, pk=todo_pk)
            row = page.locator(f"#todo-{todo.pk}")
            row.wait_for()
            assert row.locator(".badge.trust").inner_text() == "signed"
            assert row.locator(".badge.state").inner_text() == "pending"
            assert page.evaluate("window.__sameDocument") is True  # no reload happened
            assert page.locator("text=bob's todo must not show").count() == 0

            # An agent's claim and release show up live too.
            in_thread(transitions.claim_todo, agent, todo.pk)
            page.wait_for_selector(f"#todo-{todo.pk} .badge.state.state-claimed")
            assert row.locator("td").nth(7).inner_text().startswith("session-a"[:8] + " ")  # the owner hint (CONTRACT §12)
            in_thread(transitions.release_todo, agent, todo.pk)
            page.wait_for_selector(f"#todo-{todo.pk} .badge.state.state-pending")
            assert page.evaluate("window.__sameDocument") is True
            page.screenshot(path=str(tmp_path / "board-live.png"), full_page=True)

            # The operator's buttons (streamed rows get the page's CSRF token).
            row.get_by_role("button", name="claim").click()
            page.wait_for_selector(f"#todo-{todo.pk} .badge.state.state-claimed")
            assert "alice" in row.locator("td").nth(7).inner_text()
            row.get_by_role("button", name="complete").click()
            page.wait_for_selector(f"#todo-{todo.pk} .badge.state.state-done")
            assert page.locator(".messages .success").first.inner_text() == f"completed #{todo.pk}"
            page.screenshot(path=str(tmp_path / "board.png"), full_page=True)

            row.get_by_role("link", name=f"#{todo.pk}").click()
            page.wait_for_url(f"**/todos/{todo.pk}/")
            history = page.locator("#history tbody tr")
            actions = [history.nth(i).locator("td").nth(1).inner_text() for i in range(history.count())]
            assert actions == ["create", "claim", "release", "claim", "complete"]
            assert history.nth(4).locator("td").nth(4).inner_text() == "alice"
            assert '"full_name": "acme/widgets"' in page.locator("#payload").inner_text()
            assert "acme/widgets#7 opened: Deploy the release" in page.locator("h1").inner_text()
            page.screenshot(path=str(tmp_path / "todo.png"), full_page=True)
            assert blocked == []
        finally:
            browser.close()
    assert (tmp_path / "board.png").stat().st_size > 0


def test_board_catches_up_on_changes_made_while_its_stream_was_down(transactional_db, tmp_path):
    """The server goes away under a connected board; a todo is created and another completed
    meanwhile; once a server is back on the same address, the board shows both without a
    reload (EventSource reconnects, the stream says sync, the page re-fetches its rows)."""
    alice = UserFactory(username="alice")
    endpoint = EndpointFactory(slug="agent", owner=alice)
    agent = transitions.Caller.agent(endpoint, "session-a")
    before, _ = transitions.create_todo(endpoint=endpoint, queue="inbox", title="before the drop",
                                        actor="test", trust=Trust.OPERATOR)
    transitions.claim_todo(agent, before.pk)

    server = None
    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page()
            page.set_default_timeout(WAIT_MS)
            server = start_board_server()
            sign_in(page, server.url)
            page.wait_for_selector(f"#todo-{before.pk} .badge.state.state-claimed")
            page.evaluate("window.__sameDocument = true")
            server.stop()
            page.wait_for_selector("#live:not(.on)")  # the stream noticed the drop

            missed, _ = in_thread(transitions.create_todo, endpoint=endpoint, queue="inbox",
                                  title="created while down", actor="test", trust=Trust.SIGNED)
            in_thread(transitions.complete_todo, agent, before.pk)

            server.start()  # the same address: EventSource reconnects by itself
            page.wait_for_selector(f"#todo-{missed.pk} .badge.trust.trust-signed")
            page.wait_for_selector(f"#todo-{before.pk} .badge.state.state-done")
            page.wait_for_selector("#live.on")
            assert page.evaluate("window.__sameDocument") is True
            page.screenshot(path=str(tmp_path / "board-resumed.png"), full_page=True)
        finally:
            browser.close()
            if server is not None:
                server.stop()


def test_approvals_banner_updates_live_and_bulk_approve_is_confirmed_first(live_daphne, tmp_path):
    alice = UserFactory(username="alice")
    endpoint = EndpointFactory(slug="agent", owner=alice)
    webhook, secret = ingest_transitions.create_webhook(slug="widgets", owner=alice, source="github")
    ingest_transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="deploys",
                                         requires_approval=True)

    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            page, blocked = new_watched_page(browser)
            sign_in(page, live_daphne.url)
            assert page.locator("#approvals").is_hidden()
            first = deliver_github_issue(live_daphne.url, "widgets", secret, "Deploy prod")
            second = deliver_github_issue(live_daphne.url, "widgets", secret, "Migrate the db",
                                          number=8)
            page.wait_for_selector(f"#todo-{second} .badge.state.state-awaiting_approval")
            banner = page.locator("#approvals")
            page.wait_for_selector("#approvals:has-text('2 todos awaiting your approval')")
            assert banner.get_by_role("link").get_attribute("href") == \
                "/todos/?state=awaiting_approval"
            page.screenshot(path=str(tmp_path / "board-approvals.png"), full_page=True)

            # One click approves one; the banner follows.
            page.locator(f"#todo-{first}").get_by_role("button", name="approve").click()
            page.wait_for_selector(f"#todo-{first} .badge.state.state-pending")
            page.wait_for_selector("#approvals:has-text('1 todo awaiting your approval')")

            # Bulk: select, review, confirm. A live change of the selected row (another
            # operator raises its priority) re-renders it and keeps the tick.
            page.locator(f"#todo-{second} input[name=ids]").check()
            in_thread(transitions.set_priority_todo, transitions.Caller.operator(endpoint, "bob"),
                      second, 5)
            page.wait_for_selector(f"#todo-{second} .badge.priority:has-text('+5')")
            assert page.locator(f"#todo-{second} input[name=ids]").is_checked()
            page.locator("#bulk").get_by_role("button", name="reject…").click()
            page.wait_for_selector("#bulk-confirm")
            assert page.locator("h1").inner_text() == "Reject 1 todo?"
            assert in_thread(lambda: Todo.objects.get(pk=second).state) == "awaiting_approval"
            page.fill("#bulk-confirm input[name=reason]", "not this week")
            page.screenshot(path=str(tmp_path / "bulk-confirm.png"), full_page=True)
            page.get_by_role("button", name="reject 1").click()
            page.wait_for_url("**/todos/")
            page.wait_for_selector(f"#todo-{second} .badge.state.state-cancelled")
            assert page.locator("#approvals").is_hidden()

            # Cancel asks first: dismissing the dialog changes nothing, accepting cancels.
            page.once("dialog", lambda dialog: dialog.dismiss())
            page.locator(f"#todo-{first}").get_by_role("button", name="cancel").click()
            assert in_thread(lambda: Todo.objects.get(pk=first).state) == "pending"
            page.once("dialog", lambda dialog: dialog.accept())
            page.locator(f"#todo-{first}").get_by_role("button", name="cancel").click()
            page.wait_for_selector(f"#todo-{first} .badge.state.state-cancelled")
            assert blocked == []
        finally:
            browser.close()
