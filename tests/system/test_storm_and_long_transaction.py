"""Two load shapes: a duplicate storm (the same delivery 50 times at once, to both web
processes) and a long-running transaction held open while agents drain (the SKIP LOCKED /
vacuum hazard)."""

import time

import pytest

from tests.system import drive
from tests.system.conftest import record

pytestmark = pytest.mark.system

STORM_COPIES = 50


def test_duplicate_storm_makes_one_todo_per_route(topology, world):
    world.endpoint("storm-a", "ops-storm")
    world.endpoint("storm-b", "ops-storm")
    secret = world.github_webhook("gh-storm", "ops-storm",
                                  [("storm-a", "inbox"), ("storm-b", "triage")])
    delivery_id = "storm-delivery-1"
    report = drive.send_deliveries(topology.web_urls, "gh-storm", secret, [7] * STORM_COPIES,
                                   delivery_ids=[delivery_id] * STORM_COPIES,
                                   concurrency=STORM_COPIES)
    assert report.statuses == {202: STORM_COPIES}, report.statuses
    # Every answer names the same two todos; exactly one answer created each of them.
    todo_sets = {tuple(sorted(todo["id"] for todo in answer["todos"]))
                 for answer in report.answers}
    assert len(todo_sets) == 1 and len(next(iter(todo_sets))) == 2, todo_sets
    created = [todo["id"] for answer in report.answers for todo in answer["todos"]
               if not todo["duplicate"]]
    assert sorted(created) == sorted(next(iter(todo_sets)))
    for slug in ("storm-a", "storm-b"):
        assert drive.ledger(topology, slug)["total"] == 1
    record(f"[storm] one delivery x{STORM_COPIES} concurrently over both web processes: "
           f"2 todos (one per route), {STORM_COPIES * 2 - 2} duplicate answers")


def drain(topology, credential, slug, count, agents=4) -> float:
    """Start ``agents`` MCP agents (alternating web processes) on ``count`` pending todos and
    return the seconds until the ledger shows them all done."""
    started = time.monotonic()
    procs = [drive.Agent(topology, topology.web_urls[i % 2], slug, credential,
                         name=f"{slug}{i}-{started:.0f}", idle_seconds=1.0)
             for i in range(agents)]
    assert drive.wait_all_done(topology, slug, count, 240), drive.ledger(topology, slug)
    seconds = time.monotonic() - started
    for proc in procs:
        assert proc.wait(60) == 0, proc.stderr_text()[-2000:]
    return seconds


@pytest.mark.timeout(900)
def test_long_transaction_dips_throughput_but_nothing_stalls(topology, world):
    batch = 400
    credential = world.endpoint("longtx", "ops-longtx")
    secret = world.github_webhook("gh-longtx", "ops-longtx", [("longtx", "inbox")])

    report = drive.send_deliveries(topology.web_urls, "gh-longtx", secret, range(batch))
    assert report.statuses == {202: batch}
    baseline = drain(topology, credential, "longtx", batch)

    # Another connection opens a REPEATABLE READ transaction and takes a snapshot: its xmin
    # pins every row version the drain below deletes or updates, so vacuum can remove none of
    # them and each SKIP LOCKED scan walks past more dead tuples.
    with topology.connect() as holder:
        holder.autocommit = False
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM todos_todo").fetchone()
        report = drive.send_deliveries(topology.web_urls, "gh-longtx", secret,
                                       range(batch, 2 * batch))
        assert report.statuses == {202: batch}
        held = drain(topology, credential, "longtx", 2 * batch)
        with topology.connect() as probe:
            oldest = probe.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction'"
            ).fetchone()[0]
        assert oldest >= 1  # the transaction really was open throughout
        holder.rollback()

    book = drive.ledger(topology, "longtx")
    assert book["states"] == {"done": 2 * batch}
    assert set(book["completes"].values()) == {1}
    record(f"[long transaction] {batch} todos by 4 agents: {batch / baseline:.0f}/s without, "
           f"{batch / held:.0f}/s with a REPEATABLE READ transaction held open "
           f"(the drain took {held / baseline:.2f}x as long); nothing stalled")
