"""The runner hands a todo's follow-ups and a request to stop to the agent it runs
(docs/runner.md#follow-ups-and-stops), end to end: a real daphne on PostgreSQL + Redis, the
runner as its own process, an agent script that waits."""

import json
from pathlib import Path

import httpx
import pytest
from django.utils import timezone

from ingest import transitions as ingest_transitions
from ingest.tests import signing
from ingest.tests.conftest import SECRETS
from ingest.tests.github_standin import webhook_example
from test_runner import agent, load_runner_module, make_todos, runners, setup  # noqa: F401
from test_runner_product import watcher  # noqa: F401
from tests.processes import DEADLINE_SECONDS, poll
from todos import transitions
from todos.models import Todo, TodoEvent

pytestmark = pytest.mark.django_db(transaction=True)

# The most a follow-up may take to reach the agent's file (docs/runner.md): a doorbell makes it
# sooner, the heartbeat cadence keeps it within this without one.
FOLLOWUP_LATENCY_SECONDS = 15

WAITING_AGENT = """
    import os, pathlib, signal, sys, time
    seen = pathlib.Path(sys.argv[1])

    def stop(*_):
        (seen.parent / "terminated").write_text("yes")
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    path = os.environ["SWITCHBOARD_FOLLOWUPS"]
    (seen.parent / "followups_path").write_text(path)
    while True:
        seen.write_text(pathlib.Path(path).read_text())
        time.sleep(0.1)
"""


def followup(todo, title):
    return transitions.add_followup(todo.pk, delivery_event=None, kind="issue_comment.created",
                                    title=title, actor="reviewer", trust="signed",
                                    payload={"comment": {"body": title}}, now=timezone.now())


def lines(path: Path) -> list[dict]:
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_follow_ups_reach_the_agents_file_and_a_stop_ends_the_agent_and_cancels_the_todo(
        setup, runners, tmp_path):
    endpoint, credential, url = setup
    [todo] = make_todos(endpoint, 1)
    followup(todo, "before the claim")
    seen = tmp_path / "seen.jsonl"
    runner = runners(url, credential, "--once", "--grace-seconds", "5",
                     command=[*agent(tmp_path, "waits", WAITING_AGENT), str(seen)])
    assert poll(lambda: [f["title"] for f in lines(seen)] == ["before the claim"],
                DEADLINE_SECONDS), runner.log_text()
    followup(todo, "also handle the empty case")
    assert poll(lambda: len(lines(seen)) == 2, FOLLOWUP_LATENCY_SECONDS), runner.log_text()
    second = lines(seen)[1]
    assert second["id"] == f"{todo.pk}.2" and second["payload"] == {
        "comment": {"body": "also handle the empty case"}}
    assert second["trust"] == "signed" and second["actor"] == "reviewer"

    transitions.request_cancel(todo.pk, actor="octocat", reason="source_closed")
    assert runner.wait() == 0, runner.log_text()
    todo.refresh_from_db()
    assert todo.state == "cancelled", (todo.state, runner.log_text())
    assert (tmp_path / "terminated").read_text() == "yes"  # SIGTERM first, within the grace
    event = TodoEvent.objects.get(todo=todo, action="cancel")
    assert event.detail["cancel_requested"] is True and "asked to stop" in event.detail["reason"]
    # The file went with the todo's private directory.
    assert not Path((tmp_path / "followups_path").read_text()).exists()
    assert Todo.objects.get(pk=todo.pk).attempts == 1  # never retried


def post_github(base_url, slug, event, action):
    """A signed delivery of @octokit/webhooks-examples' ``event`` payload to the live server
    (GitHub publishes no ``issues`` ``closed`` example: its ``opened`` one, closed)."""
    try:
        payload = webhook_example(event, action=action)
    except LookupError:
        payload = {**webhook_example(event, action="opened"), "action": action}
    body = signing.body_of(payload)
    meta = signing.github(SECRETS["github"], body, event=event)
    headers = {name.removeprefix("HTTP_").replace("_", "-"): value
               for name, value in meta.items()}
    answer = httpx.post(f"{base_url}/hooks/{slug}", content=body, timeout=DEADLINE_SECONDS,
                        headers={**headers, "Content-Type": "application/json"})
    assert answer.status_code == 202, answer.text
    return answer.json()


def test_a_webhooks_follow_up_reaches_the_agent_and_closing_the_issue_cancels_its_todo(
        setup, runners, tmp_path, daphne_server):
    endpoint, credential, url = setup
    webhook, _ = ingest_transitions.create_webhook(
        slug=f"gh-{endpoint.slug}", owner=endpoint.owner, source="github",
        secret=SECRETS["github"])
    ingest_transitions.add_webhook_route(webhook=webhook, endpoint=endpoint, queue="inbox")
    opened = post_github(daphne_server.url, webhook.slug, "issues", "opened")
    [made] = opened["todos"]
    seen = tmp_path / "seen.jsonl"
    runner = runners(url, credential, "--once", "--grace-seconds", "5",
                     command=[*agent(tmp_path, "waits", WAITING_AGENT), str(seen)])
    assert poll(lambda: Todo.objects.filter(pk=made["id"], state="claimed").exists()
                and seen.exists(), DEADLINE_SECONDS), runner.log_text()
    comment = post_github(daphne_server.url, webhook.slug, "issue_comment", "created")
    assert comment["todos"][0]["followup"] is True
    assert poll(lambda: len(lines(seen)) == 1, FOLLOWUP_LATENCY_SECONDS), runner.log_text()
    [heard] = lines(seen)
    assert heard["id"] == f"{made['id']}.1" and heard["trust"] == "signed"
    assert heard["payload"]["comment"]["body"]

    closed = post_github(daphne_server.url, webhook.slug, "issues", "closed")
    assert closed["stopped"] == [made["id"]] and closed["todos"] == []
    assert runner.wait() == 0, runner.log_text()
    todo = Todo.objects.get(pk=made["id"])
    assert todo.state == "cancelled", (todo.state, runner.log_text())
    assert (tmp_path / "terminated").read_text() == "yes"
    assert TodoEvent.objects.get(todo=todo, action="cancel").detail["cancel_requested"] is True


def test_the_follow_ups_file_takes_whole_json_lines(tmp_path):
    agent_module = load_runner_module("agent")
    path = agent_module.create_followups_file(str(tmp_path), None)
    assert Path(path).read_text() == "" and oct(Path(path).stat().st_mode & 0o777) == "0o600"
    assert agent_module.append_followups(path, [{"id": "1.1", "title": "a\nb"}, "junk"]) == 1
    assert agent_module.append_followups(path, [{"id": "1.2", "title": "c"}]) == 1
    assert [json.loads(line)["id"] for line in Path(path).read_text().splitlines()] == [
        "1.1", "1.2"]


def test_the_built_in_prompt_says_where_the_follow_ups_are():
    agent_module = load_runner_module("agent")
    for prompt in (agent_module.DEFAULT_PROMPT, agent_module.REPORT_PROMPT):
        assert "SWITCHBOARD_FOLLOWUPS" in prompt and "untrusted" in prompt


def test_watch_prints_a_line_per_new_follow_up_and_one_for_a_stop(setup, watcher):
    endpoint, credential, url = setup
    [todo] = make_todos(endpoint, 1)
    followup(todo, "before the claim")
    transitions.claim_todo(transitions.Caller.agent(endpoint, "an-agents-session"), todo.pk)
    [waiting] = make_todos(endpoint, 1, queue="other")
    watch = watcher(url, credential, "--poll-seconds", "0.5")
    _, first = watch.next_line()  # the start-up listing is done: the claimed todo is seen
    assert first.startswith(f"{waiting.pk}\tother\t")
    followup(todo, "a review comment")
    _, line = watch.next_line()
    assert line == f"{todo.pk}.2\tinbox\tfollowup\tsigned\tjob 0 of 1"
    transitions.request_cancel(todo.pk, actor="octocat", reason="source_closed")
    _, line = watch.next_line()
    assert line == f"{todo.pk}\tinbox\tcancel_requested\tsigned\tjob 0 of 1"


def test_a_todo_claimed_already_asked_to_stop_is_cancelled_without_starting_the_agent(
        setup, runners, tmp_path):
    endpoint, credential, url = setup
    [todo] = make_todos(endpoint, 1)
    earlier = transitions.Caller.agent(endpoint, "an-earlier-holder")
    transitions.claim_todo(earlier, todo.pk)
    transitions.request_cancel(todo.pk, actor="octocat", reason="source_closed")
    transitions.release_todo(earlier, todo.pk)
    # A release now cancels it; a row handed back still marked (before that) must not run.
    Todo.objects.filter(pk=todo.pk).update(state="pending", cancelled_at=None)
    started = tmp_path / "started"
    runner = runners(url, credential, "--once", command=["touch", str(started)])
    assert runner.wait() == 0, runner.log_text()
    todo.refresh_from_db()
    assert todo.state == "cancelled" and not started.exists(), runner.log_text()
