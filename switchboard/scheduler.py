"""The embedded scheduler: periodic sweeps inside the web process when there is no Celery
(docs/operating.md#the-embedded-default).

Started as an asyncio task once daphne is ready. Each tick runs a sweep function — the very
same plain function the Celery task wraps — in Django's sync thread, so on SQLite it queues
behind request writes instead of contending with them for the write lock.
"""

import asyncio
import logging

from asgiref.sync import sync_to_async
from django.db import close_old_connections
from django.utils.module_loading import import_string

from switchboard import schedule

log = logging.getLogger("switchboard.scheduler")


def _run_sweep(sweep):
    # A long-lived loop must not keep a connection past CONN_MAX_AGE or across a DB restart.
    close_old_connections()
    try:
        return sweep()
    finally:
        close_old_connections()


async def run_every(sweep, interval_seconds: float, entry: schedule.PeriodicSweep | None = None):
    """Call ``sweep`` every ``interval_seconds`` until cancelled; a failing run is logged and
    the next one still happens. An ``entry`` that ``wakes`` runs again as soon as it is woken;
    one that ``waits_on_network`` runs on a thread of its own."""
    name = getattr(sweep, "__qualname__", repr(sweep))
    own_thread = entry is not None and entry.waits_on_network
    while True:
        try:
            moved = await sync_to_async(_run_sweep, thread_sensitive=not own_thread)(sweep)
            # A sweep of several kinds answers a dict of counts: all zero is no work either.
            if moved and (not isinstance(moved, dict) or any(moved.values())):
                log.info("sweep did work", extra={"sweep": name, "moved": moved})
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("sweep failed", extra={"sweep": name})
        if entry is not None and entry.wakes:
            await sync_to_async(schedule.wait_for_wake, thread_sensitive=False)(
                entry.name, interval_seconds)
        else:
            await asyncio.sleep(interval_seconds)


def embedded_sweeps():
    """Every (sweep, interval in seconds) pair the embedded scheduler runs: the table in
    switchboard/schedule.py, which beat reads too."""
    return [(import_string(entry.sweep), entry.every.total_seconds())
            for entry in schedule.SWEEPS]


def start(loop=None) -> list:
    from channels_push.bus import publish

    loop = loop or asyncio.get_event_loop()
    # The sweeps ring from this (the server's) process: with the in-memory layer the streams
    # live on this loop, so bind it before the first sweep rather than at the first request.
    publish.bind_server_loop(loop)
    return [loop.create_task(run_every(sweep, interval, entry))
            for entry, (sweep, interval) in zip(schedule.SWEEPS, embedded_sweeps())]
