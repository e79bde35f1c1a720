"""The one stream pump every SSE response runs on (switchboard/http/stream_pump.py), on its own:
a fake ASGI client (its ``receive`` a queue, its ``send`` a list) and time driven by short
keep-alive intervals and waits on events with a deadline, never a fixed sleep."""

import asyncio
from datetime import timedelta

from switchboard.http import sse, stream_pump
from switchboard.http.stream_pump import Ending
from tests.processes import DEADLINE_SECONDS

SHORT = timedelta(milliseconds=20)
LONG = timedelta(hours=1)  # a keep-alive that never comes during a test


class Client:
    """One response's client: what the pump sent, and a way to leave."""

    def __init__(self):
        self.inbox = asyncio.Queue()
        self.sent = []
        self.changed = asyncio.Event()

    async def receive(self):
        return await self.inbox.get()

    async def send(self, message):
        self.sent.append(message)
        self.changed.set()

    def leave(self):
        self.inbox.put_nowait({"type": "http.disconnect"})

    @property
    def bodies(self) -> list[bytes]:
        return [message["body"] for message in self.sent]

    async def until(self, condition):
        """Wait (with a deadline) until ``condition()`` holds for what was sent."""
        async def poll():
            while not condition():
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(poll(), DEADLINE_SECONDS)


def run(scenario):
    return asyncio.run(asyncio.wait_for(scenario(), DEADLINE_SECONDS))


def test_a_disconnect_ends_the_pump_and_nothing_more_is_written():
    async def scenario():
        client = Client()
        pump = asyncio.ensure_future(stream_pump.pump_stream(
            client.receive, client.send, keepalive_interval=LONG, stop=asyncio.Event()))
        client.leave()
        return await pump, client.sent

    assert run(scenario) == (Ending.DISCONNECTED, [])


def test_messages_other_than_a_disconnect_are_read_past():
    async def scenario():
        client = Client()
        stop = asyncio.Event()
        pump = asyncio.ensure_future(stream_pump.pump_stream(
            client.receive, client.send, keepalive_interval=LONG, stop=stop))
        client.inbox.put_nowait({"type": "http.request", "body": b"", "more_body": False})
        await asyncio.wait_for(_until_empty(client.inbox), DEADLINE_SECONDS)
        running = not pump.done()
        client.leave()
        return running, await pump

    assert run(scenario) == (True, Ending.DISCONNECTED)


async def _until_empty(queue):
    while not queue.empty():
        await asyncio.sleep(0)


def test_stop_ends_the_body_with_an_empty_last_chunk():
    async def scenario():
        client = Client()
        stop = asyncio.Event()
        pump = asyncio.ensure_future(stream_pump.pump_stream(
            client.receive, client.send, keepalive_interval=LONG, stop=stop))
        stop.set()
        return await pump, client.sent

    ending, sent = run(scenario)
    assert ending is Ending.STOPPED
    assert sent == [{"type": "http.response.body", "body": b"", "more_body": False}]


def test_a_keepalive_comment_goes_out_every_interval():
    async def scenario():
        client = Client()
        pump = asyncio.ensure_future(stream_pump.pump_stream(
            client.receive, client.send, keepalive_interval=SHORT))
        await client.until(lambda: len(client.sent) >= 3)
        client.leave()
        return await pump, client.sent

    ending, sent = run(scenario)
    assert ending is Ending.DISCONNECTED
    assert all(message == {"type": "http.response.body", "more_body": True,
                           "body": sse.comment("keep-alive")} for message in sent)


def test_an_empty_keepalive_frame_sends_nothing():
    async def scenario():
        client = Client()
        asked = asyncio.Event()

        def nothing():
            asked.set()
            return b""

        pump = asyncio.ensure_future(stream_pump.pump_stream(
            client.receive, client.send, keepalive_interval=SHORT, keepalive_frame=nothing))
        await asyncio.wait_for(asked.wait(), DEADLINE_SECONDS)
        client.leave()
        return await pump, client.sent

    assert run(scenario) == (Ending.DISCONNECTED, [])


def test_frames_flow_in_order_and_the_source_may_end_the_pump():
    async def scenario():
        client = Client()
        frames = asyncio.Queue()
        for number in range(5):
            frames.put_nowait(number)
        frames.put_nowait(None)  # the source's last word

        async def write(frame):
            if frame is None:
                return False
            await client.send({"type": "http.response.body", "more_body": True,
                               "body": sse.event("n", frame)})
            return True

        ending = await stream_pump.pump_stream(
            client.receive, client.send, keepalive_interval=LONG, stop=asyncio.Event(),
            next_frame=frames.get, on_frame=write)
        return ending, client.bodies

    ending, bodies = run(scenario)
    assert ending is Ending.SOURCE_ENDED  # and the body left for the caller to end
    assert bodies == [sse.event("n", number) for number in range(5)]


def test_a_queued_disconnect_comes_before_a_waiting_frame():
    async def scenario():
        client = Client()
        handled = []

        async def take(frame):
            handled.append(frame)
            return True

        frames = asyncio.Queue()
        frames.put_nowait("late")
        client.leave()
        ending = await stream_pump.pump_stream(
            client.receive, client.send, keepalive_interval=LONG,
            next_frame=frames.get, on_frame=take)
        return ending, handled

    assert run(scenario) == (Ending.DISCONNECTED, [])


def test_stop_ends_the_pump_while_frames_keep_coming():
    async def scenario():
        client = Client()
        stop = asyncio.Event()
        frames = asyncio.Queue()

        async def write(frame):
            await client.send({"type": "http.response.body", "more_body": True, "body": frame})
            if frame == b"2":
                stop.set()
            frames.put_nowait(str(int(frame) + 1).encode())
            return True

        frames.put_nowait(b"0")
        ending = await stream_pump.pump_stream(
            client.receive, client.send, keepalive_interval=LONG, stop=stop,
            next_frame=frames.get, on_frame=write)
        return ending, client.bodies

    ending, bodies = run(scenario)
    assert ending is Ending.STOPPED and bodies == [b"0", b"1", b"2", b""]


def test_the_deadline_ends_the_pump_without_ending_the_body():
    async def scenario():
        client = Client()
        deadline = asyncio.get_running_loop().time() + SHORT.total_seconds()
        ending = await stream_pump.pump_stream(
            client.receive, client.send, keepalive_interval=LONG, deadline=deadline)
        return ending, asyncio.get_running_loop().time() >= deadline, client.sent

    assert run(scenario) == (Ending.DEADLINE, True, [])
