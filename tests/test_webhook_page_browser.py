"""A webhook's page in a real browser (Debian's chromium through Playwright) against daphne
(CONTRACT §14): deliveries appear live with their outcome badge, the outcome filter narrows the
log, and the redeliver button re-sends an accepted delivery as new operator-attributed todos
of the original's trust, linked from the log. Screenshots land in the test's tmp dir."""

import httpx

from ingest import transitions as ingest_transitions
from tests.factories import EndpointFactory, UserFactory
from tests.test_board_browser import (  # noqa: F401 — live_daphne is a fixture
    WAIT_MS, deliver_github_issue, in_thread, launch_chromium, live_daphne, sign_in,
    sync_playwright)
from todos.models import Todo, Trust


def test_the_webhook_page_shows_deliveries_live_and_redelivers(live_daphne, tmp_path):
    alice = UserFactory(username="alice")
    endpoint = EndpointFactory(slug="agent", owner=alice)
    webhook, secret = ingest_transitions.create_webhook(slug="widgets", owner=alice, source="github")
    ingest_transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="inbox")

    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 800})
            page.set_default_timeout(WAIT_MS)
            sign_in(page, live_daphne.url)
            page.get_by_role("link", name="webhooks").click()
            page.get_by_role("link", name="widgets").click()
            page.wait_for_url("**/todos/webhooks/widgets/")
            page.wait_for_selector("#live.on")
            page.wait_for_selector("#deliveries[data-synced]")  # subscribed, first fetch done
            page.evaluate("window.__sameDocument = true")

            todo_id = deliver_github_issue(live_daphne.url, "widgets", secret, "Ship it")
            accepted = page.locator("#delivery-rows tr", has=page.locator(".outcome-accepted"))
            accepted.wait_for()
            assert f"#{todo_id}" in accepted.inner_text()
            forged = httpx.post(f"{live_daphne.url}/hooks/widgets", content=b"{}", timeout=30,
                                headers={"Content-Type": "application/json",
                                         "X-Hub-Signature-256": "sha256=" + "0" * 64})
            assert forged.status_code == 401
            page.wait_for_selector("#delivery-rows .outcome-bad_signature")
            assert page.evaluate("window.__sameDocument") is True  # no reload happened
            page.screenshot(path=str(tmp_path / "webhook-live.png"), full_page=True)

            page.select_option("select[name=outcome]", "bad_signature")
            page.get_by_role("button", name="filter").click()
            page.wait_for_url("**outcome=bad_signature")
            page.wait_for_selector("#deliveries[data-synced]")
            assert page.locator("#delivery-rows .outcome-accepted").count() == 0
            assert page.locator("#delivery-rows .outcome-bad_signature").count() == 1

            page.goto(live_daphne.url + "/todos/webhooks/widgets/")
            page.get_by_role("button", name="redeliver").click()
            page.wait_for_selector(".messages .success")
            redelivered = page.locator("#delivery-rows tr", has=page.locator(".redelivered"))
            redelivered.wait_for()
            new_todo = in_thread(lambda: Todo.objects.exclude(pk=todo_id).get())
            assert new_todo.trust == Trust.SIGNED  # the original's trust, never raised
            assert f"#{new_todo.pk}" in redelivered.inner_text()
            assert "redelivered from #" in redelivered.inner_text()
            page.screenshot(path=str(tmp_path / "webhook-redelivered.png"), full_page=True)
        finally:
            browser.close()
