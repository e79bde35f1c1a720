"""4 MCP agent processes on one endpoint drain 2,000 todos that arrived as signed GitHub
webhooks spread over both web processes: every todo completed exactly once by the ledger."""

import time

import pytest

from tests.system import drive

pytestmark = pytest.mark.system

TODOS = 2000
AGENTS = 4


def test_four_agents_drain_2000_webhook_todos_exactly_once(topology, world, tmp_path):
    credential = world.endpoint("drain", "ops-drain")
    secret = world.github_webhook("gh-drain", "ops-drain", [("drain", "inbox")])
    # Two agents on each web process: doorbells for todos ingested by one process must reach
    # sessions streaming from the other (over the Redis channel layer).
    agents = [drive.Agent(topology, topology.web_urls[i % 2], "drain", credential,
                          name=f"drain{i}", idle_seconds=5.0) for i in range(AGENTS)]
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
    print(f"\n[drain] {TODOS} deliveries in {ingest_seconds:.1f}s "
          f"({TODOS / ingest_seconds:.0f}/s over 2 web processes); drained by {AGENTS} MCP agents "
          f"in {drain_seconds:.1f}s from the first delivery; per agent {share}; "
          f"doorbells received {doorbells}")
