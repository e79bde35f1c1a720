"""The wait room of long-poll claim_next (channels_push/mcp/longpoll.py): who is woken for what."""

import asyncio

import pytest

from channels_push.mcp import longpoll


def change(todo_id, endpoint_id=1, queue="inbox", state="pending", action="create"):
    return {"action": action, "todo_id": str(todo_id), "endpoint_id": endpoint_id,
            "queue": queue, "state": state}


@pytest.fixture
def room():
    loop = asyncio.new_event_loop()
    room = longpoll.WaitRoom(loop, follow=False)
    room.following_since = loop.time() - 100  # following the board group since long ago
    yield room
    loop.close()


def woken(waiters):
    return [w.woken_for for w in waiters]


def test_each_ready_change_wakes_one_idle_waiter_oldest_first(room):
    now = room.loop.time()
    waiters = [room.add(1, None, started_at=now) for _ in range(3)]
    room.on_changes([change(10)])
    assert woken(waiters) == ["10", None, None]
    room.on_changes([change(11), change(12)])
    assert woken(waiters) == ["10", "11", "12"]


def test_changes_that_do_not_make_a_todo_ready_wake_nobody(room):
    waiter = room.add(1, None, started_at=room.loop.time())
    room.on_changes([change(10, state="claimed", action="claim"), change(11, state="done"),
                     change(12, endpoint_id=2)])
    assert waiter.idle


@pytest.mark.parametrize("action", ["create", "release", "retry", "requeue", "lease_lapsed"])
def test_every_kind_of_readiness_wakes(room, action):
    waiter = room.add(1, None, started_at=room.loop.time())
    room.on_changes([change(10, action=action)])
    assert waiter.woken_for == "10"


def test_only_waiters_whose_queues_cover_the_todo_are_woken(room):
    now = room.loop.time()
    reviews = room.add(1, ("reviews",), started_at=now)
    inbox = room.add(1, ("inbox", "triage"), started_at=now)
    room.on_changes([change(10, queue="inbox")])
    assert reviews.idle and inbox.woken_for == "10"


def test_a_change_that_finds_every_waiter_busy_goes_to_the_first_idle_again(room):
    waiter = room.add(1, None, started_at=room.loop.time())
    room.on_changes([change(10)])  # woken; its claim is under way...
    room.on_changes([change(11)])  # ...when the next todo commits
    room.attempted(waiter, claimed=False)  # its claim missed todo 11 (read before the commit)
    assert not waiter.idle  # woken again at once, not at the next re-check


def test_a_wake_up_its_waiter_did_not_act_on_passes_to_the_next(room):
    now = room.loop.time()
    gone, other = room.add(1, None, started_at=now), room.add(1, None, started_at=now)
    room.on_changes([change(10)])
    room.remove(gone)  # the client left (or the deadline passed) before it claimed
    assert other.woken_for == "10"


def test_recheck_wakes_one_waiter_per_kind_and_a_successful_one_wakes_the_next(room):
    long_ago = room.loop.time() - 60
    first, second = room.add(1, None, started_at=long_ago), room.add(1, None, started_at=long_ago)
    narrow = room.add(1, ("reviews",), started_at=long_ago)
    fresh = room.add(2, None, started_at=room.loop.time())  # just tried: not due
    room.recheck()
    assert woken([first, second, narrow, fresh]) == ["recheck", None, "recheck", None]
    room.attempted(first, claimed=True)  # a lost wake-up: more may be waiting
    assert second.woken_for == "recheck"
    room.attempted(second, claimed=False)  # nothing more: the chain ends
    assert all(w.idle for w in room.waiters[1] if w is not narrow)


def test_a_waiter_that_may_have_missed_a_change_before_it_joined_is_woken_at_once(room):
    before = room.loop.time() - 1
    room.on_changes([change(10)])  # nobody was waiting yet
    assert room.add(1, None, started_at=before).woken_for == "recheck"
    assert room.add(1, None, started_at=room.loop.time() + 1).idle
    room.following_since = None  # not (yet) following: joining re-checks every kind
    late = room.add(3, None, started_at=before)
    assert late.idle
    room.recheck_all()
    assert late.woken_for == "recheck"


def test_the_recheck_period_bounds_a_lost_wake_up_to_five_seconds():
    assert longpoll.RECHECK_SECONDS <= 5


def test_an_unverified_todo_wakes_a_waiter_that_may_claim_it_not_a_verified_only_one(room):
    now = room.loop.time()
    picky = room.add(1, None, started_at=now, verified_only=True)
    anyone = room.add(1, None, started_at=now)
    room.on_changes([{**change(10), "trust": "unverified"}])
    assert picky.idle and anyone.woken_for == "10"
    room.on_changes([{**change(11), "trust": "signed"}])
    assert picky.woken_for == "11"


def test_an_unverified_todo_no_waiter_may_claim_is_not_kept_for_later(room):
    picky = room.add(1, None, started_at=room.loop.time(), verified_only=True)
    room.on_changes([{**change(10), "trust": "unverified"}])
    assert picky.idle and not room.unserved.get(1)


class FlakyLayer:
    """A channel layer whose first receive fails (Redis gone) and then hands out one board
    batch before going quiet."""

    def __init__(self, batch):
        self.batch = batch
        self.receives = 0
        self.joined = asyncio.Event()

    async def new_channel(self):
        return f"channel-{self.receives}"

    async def group_add(self, group, channel):
        self.joined.set()

    async def group_discard(self, group, channel):
        pass

    async def receive(self, channel):
        self.receives += 1
        if self.receives == 1:
            raise ConnectionError("redis went away")
        if self.receives == 2:
            return {"type": "todos.changed", "changes": self.batch}
        await asyncio.Event().wait()


def test_the_room_follows_the_board_group_through_the_streams_rejoin_loop(monkeypatch):
    """A lost channel layer: the room rejoins (after the loop's first retry delay), re-checks
    every kind of waiter, and takes the next batch."""
    loop = asyncio.new_event_loop()
    layer = FlakyLayer([change(10)])
    monkeypatch.setattr(longpoll, "get_channel_layer", lambda: layer)
    room = longpoll.WaitRoom(loop, follow=False)
    rechecks = []
    room.recheck_all = lambda: rechecks.append(loop.time())

    async def scenario():
        waiter = room.add(1, None, started_at=loop.time() + 100)
        task = loop.create_task(room._follow())
        while not waiter.woken_for:
            await asyncio.sleep(0.005)
        task.cancel()
        return waiter

    try:
        waiter = loop.run_until_complete(asyncio.wait_for(scenario(), 10))
    finally:
        loop.close()
    assert waiter.woken_for == "10"
    assert len(rechecks) == 2  # at the first join and again after the loss
    assert room.following_since is not None
