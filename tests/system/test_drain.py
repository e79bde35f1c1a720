"""4 MCP agent processes on one endpoint drain 2,000 todos that arrived as signed GitHub
webhooks spread over both web processes: every todo completed exactly once by the ledger, and
doorbells rung by one process reach agents streaming from the other."""

import time

import pytest

from tests.system import drive
from tests.system.conftest import record

pytestmark = pytest.mark.system

TODOS = 2000
AGENTS = 4


# A shared 2-core CI machine can take minutes here; pytest.ini's 300 s is per test.
@pytest.mark.timeout(900)
def test_four_agents_drain_2000_webhook_todos_exactly_once(topology, world, tmp_path):
    credential = world.endpoint("drain", "ops-drain")
    secret = world.github_webhook("gh-drain", "ops-drain", [("drain", "inbox")])
    # Two agents on each web process: doorbells for todos ingested by one process must reach
    # sessions streaming from the other (over the Redis channel layer).
    agents = [drive.Agent(topology, topology.web_urls[i % 2], "drain", credential,
                          name=f"drain{i}", idle_seconds=30.0) for i in range(AGENTS)]
    for agent in agents:
        assert agent.wait_for("ready"), agent.stderr_text()

    started = time.monotonic()
    report = drive.send_deliveries(topology.web_urls, "gh-drain", secret, range(TODOS))
    ingest_seconds = time.monotonic() - started
    assert report.statuses == {202: TODOS}, report.statuses
    assert all(len(answer["todos"]) == 1 and not answer["todos"][0]["duplicate"]
               for answer in report.answers)

    for agent in agents:
        assert agent.wait(240) == 0, agent.stderr_text()[-2000:]
    drain_seconds = time.monotonic() - started
    book = drive.assert_each_done_exactly_once(topology, "drain", TODOS, agents)
    assert book["sessions"] == AGENTS
    share = [len(agent.ids("completed")) for agent in agents]
    assert all(share), f"an agent got no work: {share}"
    doorbells = sum(len(agent.ids("doorbell")) for agent in agents)
    # A doorbell rung for a todo that one web process ingested reaches an agent whose stream is
    # held by the other process (over the Redis channel layer).
    agent_web = {agent.name: topology.web_urls[i % 2] for i, agent in enumerate(agents)}
    across = sum(1 for agent in agents for todo_id in agent.ids("doorbell")
                 if todo_id in report.todo_web and report.todo_web[todo_id] != agent_web[agent.name])
    assert doorbells > 0 and across > 0, (doorbells, across)
    record(f"[drain] {TODOS} deliveries in {ingest_seconds:.1f}s "
          f"({TODOS / ingest_seconds:.0f}/s over 2 web processes); drained by {AGENTS} MCP agents "
          f"in {drain_seconds:.1f}s from the first delivery; per agent {share}; "
          f"doorbells received {doorbells}, {across} of them across web processes")
