"""The console pages in a real browser (Debian's chromium through Playwright) against daphne:
the endpoint page shows the connection snippets and its live sessions by client name (never a
session id), a delivery's page hides signatures and tokens, the pages follow
prefers-color-scheme and do not scroll sideways at 390 px. Screenshots land in the test's tmp
dir, and in $CONSOLE_SCREENSHOTS_DIR too when it is set (how docs/images/ is made)."""

import hashlib
import hmac
import json
import os
import shutil
import uuid
import zlib
from pathlib import Path

import httpx

from endpoints import transitions as endpoint_transitions
from ingest import transitions as ingest_transitions
from tests.factories import UserFactory
from tests.test_board_browser import (  # noqa: F401 — live_daphne is a fixture
    WAIT_MS, in_thread, launch_chromium, live_daphne, sync_playwright)

PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 900}
DARK_BACKGROUND = "rgb(18, 21, 27)"  # console.css --bg in dark mode


def keep(path: Path) -> None:
    target = os.environ.get("CONSOLE_SCREENSHOTS_DIR")
    if target:
        shutil.copy(path, Path(target) / path.name)


def sign_in_to(page, base_url, path, username="alice"):
    page.goto(f"{base_url}/accounts/login/?next={path}")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", "pw-for-tests")
    page.click("button[type=submit]")
    page.wait_for_url(f"**{path}")


def scrolls_sideways(page) -> bool:
    return page.evaluate("document.documentElement.scrollWidth > window.innerWidth")


def shoot(browser, base_url, path, name, tmp_path, *, ready):
    """Light desktop, dark desktop and light 390 px shots of ``path``; returns what it checked
    at each: (sideways scroll at 390 px, body background in dark)."""
    checks = {}
    for suffix, viewport, scheme in (("light", DESKTOP, "light"), ("dark", DESKTOP, "dark"),
                                     ("390", PHONE, "light")):
        context = browser.new_context(viewport=viewport, color_scheme=scheme)
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        sign_in_to(page, base_url, path)
        page.wait_for_selector(ready)
        shot = tmp_path / f"console-{name}-{suffix}.png"
        page.screenshot(path=str(shot), full_page=True)
        keep(shot)
        if suffix == "390":
            checks["sideways"] = scrolls_sideways(page)
        if suffix == "dark":
            checks["background"] = page.evaluate(
                "getComputedStyle(document.body).backgroundColor")
        context.close()
    return checks


def mcp_initialize(base_url, slug, credential, name, version) -> str:
    answer = httpx.post(f"{base_url}/mcp/{slug}", timeout=30, headers={
        "Authorization": f"Bearer {credential}", "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream"},
        json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": name, "version": version}}})
    assert answer.status_code == 200, answer.text
    return answer.headers["mcp-session-id"]


def deliver(base_url, slug, secret, title, *, payload=None, **extra_headers) -> httpx.Response:
    # Each title its own issue (its own thread), so each delivery makes its own todo.
    number = 1 + zlib.crc32(title.encode()) % 100_000
    body = json.dumps(payload or {"action": "opened", "issue": {"number": number, "title": title},
                                  "repository": {"full_name": "acme/widgets"}}).encode()
    signature = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return httpx.post(f"{base_url}/hooks/{slug}", content=body, timeout=30, headers={
        "Content-Type": "application/json", "X-GitHub-Event": "issues",
        "User-Agent": "GitHub-Hookshot/5e1f2a9", "X-GitHub-Delivery": str(uuid.uuid4()),
        "X-GitHub-Hook-ID": "512345678", "X-Hub-Signature-256": f"sha256={signature}",
        **extra_headers})


def test_the_endpoint_page_shows_snippets_and_sessions_by_client(live_daphne, tmp_path):
    alice = UserFactory(username="alice")
    endpoint, credential = in_thread(endpoint_transitions.vend_endpoint, slug="builds",
                                     owner=alice)
    webhook, secret = in_thread(ingest_transitions.create_webhook, slug="widgets", owner=alice,
                                source="github")
    in_thread(ingest_transitions.add_webhook_route, webhook=webhook, endpoint=endpoint,
              queue="inbox")
    for title in ("Crash on start", "Docs typo", "Flaky test"):
        assert deliver(live_daphne.url, "widgets", secret, title).status_code == 202
    # A budget and a settled attempt's usage, so the spend strip and the budget form show.
    from decimal import Decimal

    from todos import transitions as todo_transitions, usage

    in_thread(usage.set_endpoint_budget, endpoint, actor="alice",
              budget_usd_per_day=Decimal("5"), budget_tokens_per_day=200000)
    agent = todo_transitions.Caller.agent(endpoint, "shots")
    claimed = in_thread(todo_transitions.claim_next_todo, agent)
    in_thread(todo_transitions.complete_todo, agent, claimed.pk, lease_id=claimed.lease_id,
              usage_reported={"input_tokens": 12400, "output_tokens": 2100, "cost_usd": 1.37,
                              "turns": 6, "model": "claude-sonnet-4-5"})
    sessions = [mcp_initialize(live_daphne.url, "builds", credential, "claude-code", "2.1.3"),
                mcp_initialize(live_daphne.url, "builds", credential, "codex-mcp-client",
                               "0.58.0")]

    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page(viewport=DESKTOP)
            page.set_default_timeout(WAIT_MS)
            sign_in_to(page, live_daphne.url, "/todos/endpoints/")
            page.get_by_role("link", name="builds").click()
            page.wait_for_url("**/todos/endpoints/builds/")
            listed = page.locator("#sessions").inner_text()
            assert f"claude-code 2.1.3 · {sessions[0][:8]}" in listed
            assert f"codex-mcp-client 0.58.0 · {sessions[1][:8]}" in listed
            html = page.content()
            assert all(session not in html for session in sessions)
            assert credential not in html
            assert page.locator("#queue-counts tr[data-queue=inbox] .n-pending").inner_text() == "2"
            mcp_json = json.loads(page.locator("#snippet-mcp-json pre").inner_text())
            server = mcp_json["mcpServers"]["switchboard"]
            assert server["headers"] == {"Authorization": "Bearer ${SWITCHBOARD_TOKEN}"}
            assert server["url"].endswith("/mcp/builds")
            add = page.locator("#snippet-claude-mcp-add pre").inner_text()
            assert add.endswith("--header 'Authorization: Bearer ${SWITCHBOARD_TOKEN}'")
            assert 'bearer_token_env_var = "SWITCHBOARD_TOKEN"' in page.locator(
                "#snippet-codex pre").inner_text()
            assert '"httpUrl"' in page.locator("#snippet-gemini pre").inner_text()
            assert "--token-env SWITCHBOARD_TOKEN" in page.locator("#snippet-runner pre").inner_text()

            page.get_by_role("button", name="rotate credential").click()
            page.wait_for_selector("#new-credential")
            shown = page.locator("#new-credential pre").inner_text().split("=", 1)[1].strip()
            assert shown.startswith(credential[:4]) and shown != credential
            page.goto(live_daphne.url + "/todos/endpoints/builds/")
            assert shown not in page.content()
            page.close()

            checks = shoot(browser, live_daphne.url, "/todos/endpoints/builds/", "endpoint",
                           tmp_path, ready="#snippet-runner")
            assert checks == {"sideways": False, "background": DARK_BACKGROUND}
            checks = shoot(browser, live_daphne.url, "/todos/", "board-spend", tmp_path,
                           ready="#rows")
            assert checks == {"sideways": False, "background": DARK_BACKGROUND}
        finally:
            browser.close()


def test_the_delivery_page_hides_signatures_and_the_pages_fit_a_phone(live_daphne, tmp_path):
    alice = UserFactory(username="alice")
    endpoint, _ = in_thread(endpoint_transitions.vend_endpoint, slug="builds", owner=alice)
    webhook, secret = in_thread(ingest_transitions.create_webhook, slug="widgets", owner=alice,
                                source="github")
    in_thread(ingest_transitions.add_webhook_route, webhook=webhook, endpoint=endpoint,
              queue="inbox")
    answer = deliver(live_daphne.url, "widgets", secret, "Crash on start",
                     Authorization="Bearer sb-secret-bearer-value",
                     Cookie="sessionid=cookie-secret-value")
    assert answer.status_code == 202, answer.text
    forged = httpx.post(f"{live_daphne.url}/hooks/widgets", content=b"{}", timeout=30,
                        headers={"Content-Type": "application/json",
                                 "X-Hub-Signature-256": "sha256=" + "0" * 64})
    assert forged.status_code == 401
    signature = answer.request.headers["x-hub-signature-256"]

    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page(viewport=DESKTOP)
            page.set_default_timeout(WAIT_MS)
            sign_in_to(page, live_daphne.url, "/todos/webhooks/widgets/")
            assert "Content type: application/json" in page.locator("#setup").inner_text()
            assert page.locator("#public-url-warning").is_visible()  # the default is loopback
            page.locator("#delivery-rows tr", has=page.locator(".outcome-accepted")) \
                .get_by_role("link", name="#").first.click()
            page.wait_for_url("**/deliveries/*/")
            assert "signature verified" in page.locator("#verification").inner_text()
            headers = page.locator("#headers").inner_text()
            assert "x-github-event" in headers and "GitHub-Hookshot/5e1f2a9" in headers
            html = page.content()
            for secret_text in (signature, signature.split("=", 1)[1], "sb-secret-bearer-value",
                                "cookie-secret-value", secret):
                assert secret_text not in html
            assert page.locator("#todos-created a").count() == 1
            delivery_path = page.url.split(live_daphne.url, 1)[1]
            page.close()

            todo_path = f"/todos/{answer.json()['todos'][0]['id']}/"
            for name, path, ready in (("webhook", "/todos/webhooks/widgets/", "#setup"),
                                      ("delivery", delivery_path, "#headers"),
                                      ("webhooks", "/todos/webhooks/", "table"),
                                      ("todo", todo_path, "#history")):
                checks = shoot(browser, live_daphne.url, path, name, tmp_path, ready=ready)
                assert checks == {"sideways": False, "background": DARK_BACKGROUND}, name

            for scheme in ("light", "dark"):
                context = browser.new_context(viewport=PHONE, color_scheme=scheme)
                login = context.new_page()
                login.goto(live_daphne.url + "/accounts/login/")
                assert not scrolls_sideways(login)
                shot = tmp_path / f"console-login-{scheme}.png"
                login.screenshot(path=str(shot), full_page=True)
                keep(shot)
                context.close()
        finally:
            browser.close()


def test_write_backs_on_the_todo_and_webhook_pages(live_daphne, tmp_path):
    """Write-backs in four states, made by the worker against the GitHub stand-in: the todo
    page lists them with links and retries the refused one, the webhook page counts the
    failing and retrying ones and tests its connection; light, dark and 390 px shots."""
    from datetime import timedelta

    from django.utils import timezone

    from ingest import connections, write_back
    from ingest.models import WriteBack
    from ingest.tests.github_standin import GitHubStandIn, webhook_example
    from todos import transitions as todo_transitions

    github = GitHubStandIn().start()
    try:
        alice = UserFactory(username="alice")
        endpoint, _ = in_thread(endpoint_transitions.vend_endpoint, slug="builds", owner=alice)
        webhook, secret = in_thread(ingest_transitions.create_webhook, slug="widgets",
                                    owner=alice, source="github")
        in_thread(ingest_transitions.add_webhook_route, webhook=webhook, endpoint=endpoint,
                  queue="inbox")
        connection, test = in_thread(connections.create_connection, name="gh-token",
                                     owner=alice, kind="github_token", secret=github.token,
                                     api_url=github.api_url)
        assert test.ok, test.error
        in_thread(connections.set_webhook_connection, webhook, connection)
        agent = todo_transitions.Caller.agent(endpoint, "shots")

        def arrive(number, title):
            # GitHub's example, cut to what the write-back reads, so that the shots show the
            # write-backs rather than 12 KB of payload.
            example = webhook_example("issues", action="opened")
            payload = {
                "action": "opened", "sender": {"login": example["sender"]["login"]},
                "issue": {"number": number, "title": title, "state": "open",
                          "user": {"login": example["issue"]["user"]["login"]}},
                "repository": {key: example["repository"][key] for key in ("id", "name",
                                                                            "full_name")}}
            payload["repository"]["owner"] = {"login": example["repository"]["owner"]["login"]}
            answer = deliver(live_daphne.url, "widgets", secret, title, payload=payload)
            assert answer.status_code == 202, answer.text
            return int(answer.json()["todos"][0]["id"])

        def send(now=None):
            return in_thread(write_back.send_due_write_backs, now=now)

        # Abandoned: GitHub down for longer than the retry window (the clock moved 25 h).
        gone = arrive(40, "Ancient flake")
        github.fail(503, times=None)
        start = timezone.now()
        send(start)
        send(start + timedelta(hours=25))
        github.recover()
        # Sent, both the reaction and the living status.
        done = arrive(41, "Crash on start")
        send()
        in_thread(todo_transitions.claim_todo, agent, done)
        send()
        # Refused: GitHub answers the status comment 422.
        refused = arrive(42, "Docs typo")
        send()
        in_thread(todo_transitions.claim_todo, agent, refused)
        github.fail(422, message="Validation Failed", times=1)
        send()
        # Retrying: one 503 on the reaction.
        github.fail(503, times=1)
        arrive(43, "Flaky test")
        send()
        states = dict(in_thread(lambda: {(row.todo_id, row.action): row.state
                                         for row in WriteBack.objects.all()}))
        assert states[(gone, "ack")] == "abandoned" and states[(refused, "status")] == "failed"
        assert states[(done, "status")] == "sent"

        with sync_playwright() as playwright:
            browser = launch_chromium(playwright)
            try:
                for name, path, ready in (
                        ("todo-write-backs", f"/todos/{refused}/", "#write-backs"),
                        ("webhook-write-backs", "/todos/webhooks/widgets/", "#write-back-trouble")):
                    checks = shoot(browser, live_daphne.url, path, name, tmp_path, ready=ready)
                    assert checks == {"sideways": False, "background": DARK_BACKGROUND}, name

                page = browser.new_page(viewport=DESKTOP)
                page.set_default_timeout(WAIT_MS)
                sign_in_to(page, live_daphne.url, "/todos/webhooks/widgets/")
                card = page.locator("#write-back").inner_text()
                assert "octo-operator" in card and "2 failing" in card and "1 retrying" in card
                page.get_by_role("button", name="test").click()
                page.wait_for_url("**/todos/webhooks/widgets/")
                assert "gh-token: writes back as octo-operator" in page.locator(
                    ".messages").inner_text()
                page.locator(".failing-write-backs").get_by_role("link", name=f"#{refused}").click()
                page.wait_for_url(f"**/todos/{refused}/")
                failed = page.locator("#write-backs tr[data-action=status]")
                assert "Validation Failed" in failed.inner_text()
                link = failed.locator("a.write-back-where").get_attribute("href")
                assert link.endswith("/issues/42")
                failed.get_by_role("button", name="retry now").click()
                page.wait_for_url(f"**/todos/{refused}/")
                assert "the status write-back is due again" in page.locator(".messages").inner_text()
                send()
                page.reload()
                status = page.locator("#write-backs tr[data-action=status]")
                assert status.get_attribute("data-state") == "sent"
                assert status.get_by_role("button", name="retry now").count() == 0
                page.close()
            finally:
                browser.close()
        # Exactly one status comment per claimed todo, the retried one included.
        assert len(github.status_comments()) == 2
        assert github.problems == [], "requests GitHub's description refuses"
    finally:
        github.stop()
