"""Threads on the console in a real browser (Debian's chromium through Playwright) against
daphne: a follow-up marks its row live, a row's thread link opens the thread view, "request cancel" asks the holder to stop
(the lease stays its own), and the board, the thread view and a todo page with follow-ups and
a cancel request fit a phone and follow the dark scheme. Screenshots land in the test's tmp
dir, and in $CONSOLE_SCREENSHOTS_DIR too when it is set (how docs/images/ is made)."""

from django.utils import timezone

from endpoints import transitions as endpoint_transitions
from tests.factories import UserFactory
from tests.test_board_browser import (  # noqa: F401 — live_daphne is a fixture
    WAIT_MS, in_thread, launch_chromium, live_daphne, sync_playwright)
from tests.test_console_browser import (DARK_BACKGROUND, DESKTOP, PHONE, keep, scrolls_sideways,
                                        sign_in_to)
from todos import transitions
from todos.models import Todo, Trust

THREAD = "acme/widgets#12"


def comment(number: int, comment_id: int, body: str) -> dict:
    """The fields of a GitHub ``issue_comment`` delivery the page shows (as third-party text)."""
    return {"action": "created", "issue": {"number": number, "title": "Crash on save"},
            "comment": {"id": comment_id, "body": body, "user": {"login": "reviewer"}},
            "repository": {"full_name": "acme/widgets"}}


def make_thread(endpoint):
    """On thread acme/widgets#12: an earlier todo done, and one claimed by an agent with two
    follow-ups; on #13 one pending; one todo with no thread."""
    agent = transitions.Caller.agent(endpoint, "session-shots")

    def todo(title, thread, *, kind="issues.opened"):
        made, _ = transitions.create_todo(endpoint=endpoint, queue="inbox", title=title,
                                          actor="github", kind=kind, source="github",
                                          trust=Trust.SIGNED)
        if thread:
            Todo.objects.filter(pk=made.pk).update(thread=thread)
        return made

    earlier = todo("acme/widgets#12: Crash on save (first report)", THREAD)
    transitions.claim_todo(agent, earlier.pk)
    transitions.complete_todo(agent, earlier.pk, result={"summary": "could not reproduce"})
    held = transitions.claim_todo(agent, todo("acme/widgets#12: Crash on save", THREAD).pk)
    for comment_id, body in ((9001, "Also handle the empty case, please."),
                             (9002, "<b>Note</b>: the CSV export crashes the same way")):
        transitions.add_followup(held.pk, delivery_event=None, kind="issue_comment.created",
                                 title="acme/widgets#12: comment by reviewer",
                                 actor="reviewer", trust=Trust.SIGNED,
                                 payload=comment(12, comment_id, body), now=timezone.now())
    other = transitions.claim_todo(agent, todo("acme/widgets#13: Docs typo",
                                                "acme/widgets#13").pk)
    plain = todo("Rotate the staging keys", None, kind="")
    return {"earlier": earlier, "held": held, "other": other, "plain": plain}


def shoot(browser, base_url, path, name, tmp_path, *, ready, then=None) -> dict:
    """As test_console_browser.shoot, for a path whose query holds a "#" (a thread key): signed
    in first, then opened, as the login's ``next`` would cut it at the "#"."""
    checks = {}
    for suffix, viewport, scheme in (("light", DESKTOP, "light"), ("dark", DESKTOP, "dark"),
                                     ("390", PHONE, "light")):
        context = browser.new_context(viewport=viewport, color_scheme=scheme)
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        sign_in_to(page, base_url, "/todos/")
        page.goto(base_url + path)
        page.wait_for_selector(ready)
        if then:
            then(page)
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


def test_the_thread_link_and_request_cancel_in_the_browser(live_daphne, tmp_path):
    alice = UserFactory(username="alice")
    endpoint, _ = in_thread(endpoint_transitions.vend_endpoint, slug="builds", owner=alice)
    todos = in_thread(make_thread, endpoint)
    held = todos["held"]

    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page(viewport=DESKTOP)
            page.set_default_timeout(WAIT_MS)
            sign_in_to(page, live_daphne.url, "/todos/")
            row = page.locator(f"#todo-{held.pk}")
            assert page.locator(f"#todo-{todos['other'].pk} button[name=request_cancel]").count()
            assert "+2 follow-ups" in row.inner_text()
            assert page.locator(f"#todo-{todos['plain'].pk} .thread-link").count() == 0
            # Live: a follow-up folded in meanwhile marks its row without a reload.
            in_thread(transitions.add_followup, todos["other"].pk, delivery_event=None,
                      kind="issue_comment.created", title="acme/widgets#13: one more typo",
                      actor="reviewer", trust=Trust.SIGNED,
                      payload=comment(13, 9003, "line 40 too"), now=timezone.now())
            page.wait_for_selector(f"#todo-{todos['other'].pk} .followups")
            assert "+1 follow-up" in page.locator(f"#todo-{todos['other'].pk}").inner_text()
            row.locator(".thread-link").click()
            page.wait_for_url("**/todos/?thread=acme/widgets%2312")
            page.wait_for_selector("#thread-view")
            shown = page.locator("#rows tr").evaluate_all("rows => rows.map(r => r.id)")
            assert sorted(shown) == sorted([f"todo-{held.pk}", f"todo-{todos['earlier'].pk}"])
            assert THREAD in page.locator("#thread-view").inner_text()

            page.locator(f"#todo-{held.pk} button[name=request_cancel]").click()
            page.wait_for_selector(f"#todo-{held.pk} .cancel-requested")
            assert "asked its agent to stop and cancel" in page.locator(".messages").inner_text()
            assert "thread=" in page.url  # back on the thread view
            after = in_thread(Todo.objects.get, pk=held.pk)
            assert after.state == "claimed" and after.lease_id == held.lease_id
            assert after.cancel_requested_at is not None
            assert page.locator(f"#todo-{held.pk} button[name=request_cancel]").count() == 0
            assert page.locator(f"#todo-{held.pk} button[name=cancel]").count() == 1

            page.goto(f"{live_daphne.url}/todos/{held.pk}/")
            assert page.locator("#followups li").count() == 2
            assert "cancel requested" in page.locator("#cancel-requested").inner_text()
            page.locator("#followup-2 summary").click()
            assert "<b>Note</b>" in page.locator("#followup-2 pre").inner_text()  # as text
            assert page.locator("#followup-2 pre b").count() == 0
            page.close()

            def open_a_payload(page):
                page.locator("#followup-2 summary").click()

            for name, path, ready, then in (
                    ("board-threads", "/todos/", f"#todo-{held.pk}", None),
                    ("thread", "/todos/?thread=acme/widgets%2312", "#thread-view", None),
                    ("todo-thread", f"/todos/{held.pk}/", "#followups", open_a_payload)):
                checks = shoot(browser, live_daphne.url, path, name, tmp_path, ready=ready,
                               then=then)
                assert checks == {"sideways": False, "background": DARK_BACKGROUND}, name
        finally:
            browser.close()
