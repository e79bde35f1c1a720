"""Write-back through a source's outage and a worker killed mid-send, on the Procfile topology
(docs/write-back.md#the-outbox): the real Celery worker and beat send to the GitHub stand-in
(held to GitHub's published description), deliveries come through nginx and agents work over
MCP.

* Outage: for a minute the stand-in answers 503, then 429 with ``Retry-After``. Deliveries
  and transitions in that minute answer as fast as before it (their medians are recorded and
  compared), and after it every todo has exactly one 👀 and exactly one status comment, showing
  it done.
* A worker SIGKILLed after GitHub created a status comment and before the answer reached it:
  once the send's lease runs out the row is sent again, finds the comment by its marker and
  edits it; the todo still has exactly one status comment, and no todo is stuck.
"""

import hashlib
import hmac
import json
import statistics
import time
import uuid

import httpx
import pytest

from ingest.tests.github_standin import GitHubStandIn, webhook_example
from tests.system import drive
from tests.system.conftest import env_manage, record
from tests.system.topology import Process, poll

pytestmark = pytest.mark.system

SLUG, HOOK, OWNER, CONNECTION = "wb-outage", "gh-wb-outage", "ops-wb", "wb-outage-gh"
REPO_OWNER, REPO = "acme", "widgets"
# The worker and the commands that test a connection may write back to plain http on loopback
# (the stand-in); the web processes and beat keep the production settings.
WRITE_BACK_SETTINGS = "tests.system.write_back_settings"
OUTAGE_SECONDS = 60
BATCH = 12
# Backoff after a minute of failures reaches 40 s between attempts; a worker's dead send is
# retried after the send lease (60 s) and the next sweep (5 s).
RECOVERY_DEADLINE_SECONDS = 240.0


@pytest.fixture(scope="module")
def github():
    standin = GitHubStandIn().start()
    yield standin
    standin.stop()
    assert not standin.problems, standin.problems


@pytest.fixture(scope="module")
def setup(topology, world, github, tmp_path_factory):
    """An endpoint, a GitHub webhook writing back under a token connection to the stand-in,
    and the topology's worker replaced by one that may write back to loopback http (put back
    as it was afterwards)."""
    credential = world.endpoint(SLUG, OWNER)
    secret = world.github_webhook(HOOK, OWNER, [(SLUG, "inbox")])
    token_file = tmp_path_factory.mktemp("wb") / "token"
    token_file.write_text(github.token)
    env = {**topology.env, "DJANGO_SETTINGS_MODULE": WRITE_BACK_SETTINGS}
    env_manage(topology, ["add_connection", CONNECTION, "--owner", world.operator(OWNER),
                          "--kind", "github_token", "--token-file", str(token_file),
                          "--api-url", github.api_url], DJANGO_SETTINGS_MODULE=WRITE_BACK_SETTINGS)
    env_manage(topology, ["set_connection", HOOK, CONNECTION],
               DJANGO_SETTINGS_MODULE=WRITE_BACK_SETTINGS)
    topology.worker.kill()
    worker = start_worker(topology, env)
    yield {"credential": credential, "secret": secret, "env": env, "worker": worker}
    worker["process"].kill()
    topology.start_worker()


def start_worker(topology, env) -> dict:
    process = Process("worker-write-back", list(topology.worker.argv), env,
                      topology.log_dir).start()
    return {"process": process}


def deliver(url: str, secret: str, number: int) -> tuple[float, int]:
    """One signed ``issues.opened`` delivery of GitHub's own example payload, about issue
    ``number``: (seconds to the 202, the todo's id)."""
    payload = webhook_example("issues", action="opened")
    payload["issue"]["number"] = number
    payload["repository"].update(name=REPO, full_name=f"{REPO_OWNER}/{REPO}")
    payload["repository"]["owner"]["login"] = REPO_OWNER
    payload.pop("installation", None)
    body = json.dumps(payload).encode()
    headers = {"Content-Type": "application/json", "X-GitHub-Event": "issues",
               "X-GitHub-Delivery": str(uuid.uuid4()),
               "X-Hub-Signature-256": "sha256=" + hmac.new(secret.encode(), body,
                                                           hashlib.sha256).hexdigest()}
    began = time.perf_counter()
    answer = httpx.post(f"{url}/hooks/{HOOK}", content=body, headers=headers, timeout=30)
    seconds = time.perf_counter() - began
    assert answer.status_code == 202, answer.text
    (todo,) = answer.json()["todos"]
    return seconds, todo["id"]


def work(session: drive.RawSession, url: str) -> tuple[float, int]:
    """claim_next then complete with a summary and a link: (seconds for the two, todo id)."""
    began = time.perf_counter()
    answer = session.call(url, "claim_next", {})
    todo = answer.json()["result"]["structuredContent"]["todo"]
    answer = session.call(url, "complete", {
        "todo_id": todo["id"], "lease_id": todo["lease_id"],
        "result": {"summary": f"fixed issue {todo['id']}",
                   "url": f"https://example.com/pr/{todo['id']}"}})
    assert not answer.json()["result"].get("isError"), answer.text
    return time.perf_counter() - began, todo["id"]


def batch(setup, topology, numbers) -> dict:
    """Deliver one issue per number and work each todo: the 202 and claim+complete times."""
    url = topology.web_urls[0]
    session = drive.RawSession(url, SLUG, setup["credential"])
    ingest, transitions, todos = [], [], []
    for number in numbers:
        seconds, todo_id = deliver(url, setup["secret"], number)
        ingest.append(seconds)
        todos.append(todo_id)
    for _ in numbers:
        seconds, _ = work(session, url)
        transitions.append(seconds)
    return {"ingest": ingest, "transitions": transitions, "todos": todos}


def written_back(github, todo_ids) -> dict:
    """Per todo: its status comments at the stand-in and whether each shows it done."""
    found = {todo_id: [] for todo_id in todo_ids}
    for comment in github.status_comments():
        for todo_id in todo_ids:
            if f"<!-- switchboard:todo:{todo_id} -->" in comment["body"]:
                found[todo_id].append("✅ Done" in comment["body"])
    return found


def eyes_per_issue(github) -> dict:
    counts = {}
    for reaction in github.reactions:
        if reaction["content"] == "eyes":
            counts[reaction["subject"][3]] = counts.get(reaction["subject"][3], 0) + 1
    return counts


def all_final(github, todo_ids) -> bool:
    found = written_back(github, todo_ids)
    return all(shown == [True] for shown in found.values())


@pytest.mark.timeout(900)
def test_a_minute_long_outage_costs_transitions_and_ingest_nothing_and_loses_nothing(
        topology, setup, github):
    before = batch(setup, topology, range(1, BATCH + 1))
    assert poll(lambda: all_final(github, before["todos"]), RECOVERY_DEADLINE_SECONDS)

    # The source is down: 503 for half the minute, then 429 asking for 20 s more.
    outage_began = time.monotonic()
    github.fail(503, times=None)
    during = batch(setup, topology, range(101, 101 + BATCH // 2))
    while time.monotonic() - outage_began < OUTAGE_SECONDS / 2:
        time.sleep(0.5)
    github.recover()
    github.fail(429, headers={"Retry-After": "20"}, times=None, message="rate limited")
    second = batch(setup, topology, range(201, 201 + BATCH // 2))
    for key in during:
        during[key] += second[key]
    while time.monotonic() - outage_began < OUTAGE_SECONDS:
        time.sleep(0.5)
    refused = sum(1 for seen in github.seen if seen.status in (429, 503))
    github.recover()
    recovered_at = time.monotonic()
    assert refused, "the worker tried nothing during the outage"

    # Nothing waits on the source: every todo is done, and after it every write-back is there,
    # once.
    assert drive.ledger(topology, SLUG)["states"] == {"done": 2 * BATCH}
    assert poll(lambda: all_final(github, before["todos"] + during["todos"]),
                RECOVERY_DEADLINE_SECONDS), written_back(github, during["todos"])
    delivered_after = time.monotonic() - recovered_at
    assert all(len(shown) == 1 for shown in written_back(
        github, before["todos"] + during["todos"]).values())
    eyes = eyes_per_issue(github)
    numbers = [*range(1, BATCH + 1), *range(101, 101 + BATCH // 2),
               *range(201, 201 + BATCH // 2)]
    assert all(eyes.get(str(number)) == 1 for number in numbers), eyes

    medians = {phase: (statistics.median(times["ingest"]) * 1000,
                       statistics.median(times["transitions"]) * 1000)
               for phase, times in (("before", before), ("during", during))}
    record(f"[write-back] source down {OUTAGE_SECONDS}s (503, then 429 Retry-After 20): "
           f"{refused} sends refused; ingest 202 median {medians['before'][0]:.0f} ms before, "
           f"{medians['during'][0]:.0f} ms during; claim+complete median "
           f"{medians['before'][1]:.0f} ms before, {medians['during'][1]:.0f} ms during; every "
           f"write-back of the {len(during['todos'])} todos made in it delivered "
           f"{delivered_after:.1f}s after the source came back, none twice")


@pytest.mark.timeout(600)
def test_a_worker_killed_after_github_acted_does_not_post_the_status_twice(
        topology, setup, github):
    url = topology.web_urls[0]
    session = drive.RawSession(url, SLUG, setup["credential"])
    _, todo_id = deliver(url, setup["secret"], 900)
    assert poll(lambda: eyes_per_issue(github).get("900") == 1, 60)
    # GitHub creates the status comment the claim asks for; its answer never reaches the
    # worker, which is killed while it waits.
    reached, release = github.hold_answer("issues/create-comment")
    answer = session.call(url, "claim_next", {})
    todo = answer.json()["result"]["structuredContent"]["todo"]
    assert todo["id"] == todo_id
    assert reached.wait(60), "the worker never sent the status"
    killed_at = time.monotonic()
    setup["worker"]["process"].kill()
    release.set()
    setup["worker"].update(start_worker(topology, setup["env"]))
    session.call(url, "complete", {"todo_id": todo_id, "lease_id": todo["lease_id"],
                                   "result": {"summary": "done after the kill"}})
    assert poll(lambda: all_final(github, [todo_id]), RECOVERY_DEADLINE_SECONDS), \
        written_back(github, [todo_id])
    recovered = time.monotonic() - killed_at
    assert written_back(github, [todo_id]) == {todo_id: [True]}
    assert drive.ledger(topology, SLUG)["states"].get("claimed", 0) == 0
    looked = [seen for seen in github.requests_to("issues/list-comments")
              if seen.path.endswith("/issues/900/comments")]
    assert looked, "the second send did not look for the comment first"
    record(f"[write-back] worker SIGKILLed after GitHub created the status comment: the send "
           f"went again and edited that comment {recovered:.1f}s after the kill (send lease "
           f"60 s); one status comment, showing the todo done")
