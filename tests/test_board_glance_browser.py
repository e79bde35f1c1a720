"""The Todos board's header in a real browser (Debian's chromium through Playwright) against
daphne: the counts, the tabs and the throughput chart follow a todo created and completed
without a reload; at 390 px the page does not scroll sideways and every row's state is in
view; dark mode applies. Screenshots land in the test's tmp dir, and in
$CONSOLE_SCREENSHOTS_DIR too when it is set (how docs/images/ is made)."""

from datetime import timedelta

from django.utils import timezone

from channels_push.sessions import transitions as session_transitions
from endpoints import transitions as endpoint_transitions
from ingest import transitions as ingest_transitions
from tests.factories import UserFactory, credential_for
from tests.test_board_browser import (  # noqa: F401 — live_daphne is a fixture
    WAIT_MS, deliver_github_issue, in_thread, launch_chromium, live_daphne, sync_playwright)
from tests.test_console_browser import (DARK_BACKGROUND, DESKTOP, PHONE, scrolls_sideways, shoot,
                                         sign_in_to)
from todos import transitions
from todos.models import Trust


def card(column):
    return f"#glance-cards [data-column={column}] .n"


def wait_for_text(page, selector, text):
    page.wait_for_function(
        "([selector, text]) => { const node = document.querySelector(selector);"
        " return node !== null && node.textContent.trim() === text; }", arg=[selector, text])


def seed(alice):
    """A board with work in every state an operator meets on a normal day."""
    endpoint, _ = endpoint_transitions.vend_endpoint(slug="builds", owner=alice)
    endpoint_transitions.vend_endpoint(slug="reviews", owner=alice)
    # A named agent: the board shows holders by client and version, never a session id.
    session = session_transitions.open_session(
        endpoint=endpoint, credential_id=credential_for(endpoint),
        protocol_version="2025-11-25", client_name="claude-code",
        client_version="2.1.332")
    agent = transitions.Caller.agent(endpoint, session.pk)

    start = timezone.now()

    def make(title, queue="inbox", minutes_ago=0, **kwargs):
        todo, _ = transitions.create_todo(
            endpoint=endpoint, queue=queue, title=title, actor="test",
            trust=kwargs.pop("trust", Trust.SIGNED), now=start - timedelta(minutes=minutes_ago),
            **kwargs)
        return todo

    # Spread over the last hour, so the chart and the oldest pending age have a shape.
    for title, ago in (("acme/widgets#12 opened: Crash on start", 41),
                       ("acme/widgets#13 opened: Docs typo", 23),
                       ("Rotate the staging certificate", 7)):
        make(title, kind="github.issues", minutes_ago=ago)
    for title in ("Deploy 1.4.2 to production", "Backfill invoices for November"):
        transitions.claim_todo(agent, make(title, queue="deploys", kind="deploy",
                                           minutes_ago=3).pk)
    for title, ago in (("Triage flaky test test_long_poll", 52),
                       ("Summarise yesterday's incidents", 34), ("Bump dependencies", 12)):
        at = start - timedelta(minutes=ago)
        todo = transitions.claim_todo(agent, make(title, minutes_ago=ago + 2).pk, now=at)
        transitions.complete_todo(agent, todo.pk, now=at)
    retrying = transitions.claim_todo(agent, make("Sync CRM contacts", queue="deploys").pk)
    transitions.fail_todo(agent, retrying.pk, error="HTTP 502 from crm.example.com")
    endpoint.max_attempts = 1
    endpoint.save()
    dead = transitions.claim_todo(agent, make("Migrate the billing table", queue="deploys").pk)
    transitions.fail_todo(agent, dead.pk, error="psycopg.errors.LockNotAvailable: lock timeout")
    make("unverified hook from a fork", trust=Trust.UNVERIFIED)
    # Work control: one waiting for its time, one for an operator's yes, one called off.
    make("Nightly dependency audit", not_before=start + timedelta(hours=2))
    make("Deploy 1.5.0 to production", queue="deploys", kind="deploy", requires_approval=True)
    operator = transitions.Caller.operator(endpoint, "alice")
    transitions.cancel_todo(operator, make("Re-run yesterday's import").pk,
                            reason="superseded by today's run")
    return endpoint, agent


def test_the_board_header_follows_work_live_and_fits_a_phone_and_the_dark(live_daphne, tmp_path):
    alice = UserFactory(username="alice")
    endpoint, agent = in_thread(seed, alice)
    webhook, secret = in_thread(ingest_transitions.create_webhook, slug="widgets", owner=alice,
                                source="github")
    in_thread(ingest_transitions.add_webhook_route, webhook=webhook, endpoint=endpoint,
              queue="inbox")

    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page(viewport=DESKTOP)
            page.set_default_timeout(WAIT_MS)
            blocked = []
            page.on("console", lambda message: blocked.append(message.text)
                    if "Content Security Policy" in message.text else None)
            sign_in_to(page, live_daphne.url, "/todos/")
            page.wait_for_selector("#live.on")
            page.wait_for_selector("#board[data-synced]")
            page.evaluate("window.__sameDocument = true")
            wait_for_text(page, card("pending"), "4")
            assert page.locator(card("claimed")).inner_text() == "2"
            assert page.locator(card("retrying")).inner_text() == "1"
            assert page.locator(card("dead")).inner_text() == "1"
            assert page.locator(card("done_24h")).inner_text() == "3"
            assert page.locator("#state-tabs [data-count=dead]").inner_text() == "1"
            chart = page.locator("#chart")
            assert chart.get_attribute("data-total-created") == "14"
            assert chart.get_attribute("data-total-done") == "3"
            assert page.locator("#chart rect.bar-created").count() >= 1
            dead_row = page.locator("#glance-table tr[data-endpoint=builds][data-queue=deploys]")
            assert dead_row.locator("[data-col=dead]").inner_text().startswith("1")
            assert "lock timeout" in page.locator("#rows").inner_text()  # a dead row says why

            # A webhook delivery and an agent's completion: header and chart follow, no reload.
            todo_pk = deliver_github_issue(live_daphne.url, "widgets", secret, "Fresh crash")
            wait_for_text(page, card("pending"), "5")
            wait_for_text(page, "#state-tabs [data-count=pending]", "5")
            page.wait_for_function(
                "document.querySelector('#chart').dataset.totalCreated === '15'")
            in_thread(transitions.complete_todo, agent, in_thread(
                transitions.claim_todo, agent, todo_pk).pk)
            wait_for_text(page, card("done_24h"), "4")
            wait_for_text(page, card("pending"), "4")
            page.wait_for_function("document.querySelector('#chart').dataset.totalDone === '4'")
            page.wait_for_selector(f"#todo-{todo_pk} .badge.state.state-done")
            assert page.evaluate("window.__sameDocument") is True
            assert not scrolls_sideways(page)  # nor on a laptop

            # The dead letters of a queue: retry all, confirmed first.
            dead_row.get_by_role("link", name="retry all…").click()
            page.wait_for_selector("#bulk-confirm")
            assert "Migrate the billing table" in page.locator("#bulk-todos").inner_text()
            page.get_by_role("button", name="retry 1").click()
            page.wait_for_url("**/todos/")
            assert "re-queued 1" in page.locator(".messages").inner_text()
            wait_for_text(page, card("dead"), "0")
            page.close()

            checks = shoot(browser, live_daphne.url, "/todos/", "board", tmp_path,
                           ready="#glance[data-rendered]")
            assert checks == {"sideways": False, "background": DARK_BACKGROUND}

            phone = browser.new_page(viewport=PHONE)
            phone.set_default_timeout(WAIT_MS)
            sign_in_to(phone, live_daphne.url, "/todos/")
            phone.wait_for_selector("#board[data-synced]")  # the rows are re-synced once
            rows = phone.locator("#rows tr")
            assert rows.count() == 15
            for index in range(rows.count()):
                state = rows.nth(index).locator(".badge.state")
                state.scroll_into_view_if_needed()
                box = state.bounding_box()
                assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"]
                assert state.is_visible()
            assert phone.evaluate(
                "document.documentElement.scrollWidth > window.innerWidth") is False
            assert blocked == []
        finally:
            browser.close()


def test_the_endpoint_page_follows_its_counts_and_sessions_live(live_daphne):
    from tests.test_console_browser import mcp_initialize

    alice = UserFactory(username="alice")
    endpoint, credential = in_thread(endpoint_transitions.vend_endpoint, slug="builds",
                                     owner=alice)
    in_thread(transitions.create_todo, endpoint=endpoint, queue="inbox", title="first",
              actor="test", trust=Trust.SIGNED)
    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page(viewport=DESKTOP)
            page.set_default_timeout(WAIT_MS)
            sign_in_to(page, live_daphne.url, "/todos/endpoints/builds/")
            page.wait_for_selector("#live.on")
            page.wait_for_selector("#queue-counts[data-synced]")
            page.evaluate("window.__sameDocument = true")
            inbox = "#queue-counts tr[data-queue=inbox] .n-pending"
            wait_for_text(page, inbox, "1")
            session = mcp_initialize(live_daphne.url, "builds", credential, "claude-code", "2.1.3")
            in_thread(transitions.create_todo, endpoint=endpoint, queue="inbox", title="second",
                      actor="test", trust=Trust.SIGNED)
            in_thread(transitions.create_todo, endpoint=endpoint, queue="deploys",
                      title="a new queue", actor="test", trust=Trust.SIGNED)
            wait_for_text(page, inbox, "2")
            wait_for_text(page, "#queue-counts tr[data-queue=deploys] .n-pending", "1")
            page.wait_for_function(
                "text => document.querySelector('#sessions').textContent.includes(text)",
                arg=f"claude-code 2.1.3 · {session[:8]}")
            assert session not in page.content()
            assert page.evaluate("window.__sameDocument") is True
        finally:
            browser.close()
