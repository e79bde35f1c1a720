"""Prometheus series for /metrics (docs/operating.md#metrics): the registry, the in-process
counters, and the doorbell outcomes every process adds to.

Three kinds of series, on purpose:

* Queue series derived from the database at scrape time (``console.metrics``, which registers
  them here): the backlog, and the transition counters counted from the todo event audit
  trail. Several web processes share one database, so every process answers the same totals
  and a restart loses nothing; in-process counters could not promise either.
* Doorbell outcomes (``count_doorbell``): sent, dropped and skipped, by reason. They are
  decided in every kind of process — a web process's stream, a Celery worker's sweep, a
  command — and a scrape reaches only web processes, so each process adds its counts to one
  Redis hash that every scrape reads whole (the same totals on every web process). Without
  Redis (the embedded default) there is one process, and they are counted in it.
* In-process counters for what only a web process decides (a webhook accepted or rejected
  before anything is stored). Other apps import and increment them:

      from switchboard import metrics
      metrics.INGEST_ACCEPTED.labels(source="github").inc()
      metrics.INGEST_REJECTED.labels(reason="bad_signature").inc()

  They count per process: scrape every web process (Prometheus sums them with ``sum()``).
"""

import atexit
import collections
import logging
import os
import re
import threading
import time

import redis
from django.conf import settings
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily

log = logging.getLogger("switchboard.metrics")

REGISTRY = CollectorRegistry(auto_describe=True)

INGEST_ACCEPTED = Counter(
    "switchboard_ingest_accepted", "Webhook deliveries and operator todos accepted.",
    ["source"], registry=REGISTRY,
)
INGEST_REJECTED = Counter(
    "switchboard_ingest_rejected", "Webhook deliveries rejected (signature, size, rate, body).",
    ["reason"], registry=REGISTRY,
)

# -- doorbell outcomes, one total across processes ------------------------------------------------

DOORBELL_SERIES = {
    "sent": ("switchboard_doorbells_sent", "Doorbell notifications written to an MCP session "
                                           "stream."),
    "dropped": ("switchboard_doorbells_dropped", "Doorbell notifications that reached nobody, "
                                                 "by reason (no attached session, no open "
                                                 "stream, full buffer, channel layer down)."),
    "skipped": ("switchboard_doorbells_skipped", "Doorbells not sent because there was nothing "
                                                 "to ring for, by reason (already_claimed: an "
                                                 "agent took the todo first)."),
}
# A process hands its counts to Redis at most this long after counting them (and at every
# scrape it answers, and at exit): one round trip per interval, not one per doorbell, on the
# path of every ready todo.
FLUSH_INTERVAL_SECONDS = 1.0
# A Redis that does not answer must not hold the flusher (or a scrape) for long.
REDIS_TIMEOUT_SECONDS = 0.25


def reason_label(reason: str) -> str:
    """A log line's reason as a label value: "no attached session" -> "no_attached_session"."""
    return re.sub(r"[^a-z0-9]+", "_", reason.lower()).strip("_")


class _DoorbellTally:
    """Counts by (outcome, reason): pending here until flushed into the shared Redis hash, read
    whole at scrape time. Counts that could not be flushed (Redis down) stay pending and go at
    the next flush; a scrape while Redis is down answers the last totals it read."""

    def __init__(self):
        self._lock = threading.Lock()
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a forked worker starts with nothing

    def _reset(self):
        self._lock = threading.Lock()
        self._pending = collections.Counter()
        self._totals = collections.Counter()  # without Redis: the totals themselves
        self._last_read = collections.Counter()
        self._client = None
        self._flusher = None
        self._wake = threading.Event()

    @staticmethod
    def _shared() -> bool:
        return bool(getattr(settings, "REDIS_URL", ""))

    @staticmethod
    def _key() -> str:
        return f"{settings.CHANNEL_PREFIX}:metrics:doorbells"

    def add(self, outcome: str, reason: str) -> None:
        field = f"{outcome}|{reason}"
        shared = self._shared()
        with self._lock:
            if not shared:
                self._totals[field] += 1
                return
            self._pending[field] += 1
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_forever, daemon=True,
                                                 name="switchboard-metrics-flush")
                self._flusher.start()

    def _redis(self):
        if self._client is None:
            self._client = redis.Redis.from_url(
                settings.REDIS_URL, socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
                socket_timeout=REDIS_TIMEOUT_SECONDS)
        return self._client

    def flush(self) -> bool:
        """Add this process's pending counts to the shared hash; False when Redis refused (the
        counts stay pending)."""
        with self._lock:
            pending, self._pending = self._pending, collections.Counter()
        if not pending:
            return True
        try:
            pipeline = self._redis().pipeline(transaction=False)
            for field, count in pending.items():
                pipeline.hincrby(self._key(), field, count)
            pipeline.execute()
            return True
        except redis.RedisError as exc:
            with self._lock:
                self._pending.update(pending)
            log.warning("doorbell counts not flushed", extra={"error": type(exc).__name__})
            return False

    def _flush_forever(self):
        while True:
            self._wake.wait(FLUSH_INTERVAL_SECONDS)
            self.flush()

    def read(self) -> collections.Counter:
        if not self._shared():
            with self._lock:
                return collections.Counter(self._totals)
        self.flush()
        try:
            raw = self._redis().hgetall(self._key())
        except redis.RedisError as exc:
            log.warning("doorbell counts not read", extra={"error": type(exc).__name__})
            return collections.Counter(self._last_read)
        totals = collections.Counter({field.decode(): int(count) for field, count in raw.items()})
        self._last_read = totals
        return totals

    def flush_at_exit(self, timeout_seconds: float = 2.0):
        deadline = time.monotonic() + timeout_seconds
        while self._shared() and self._pending and time.monotonic() < deadline:
            if not self.flush():
                return


_tally = _DoorbellTally()
atexit.register(_tally.flush_at_exit)


def count_doorbell(outcome: str, reason: str = "") -> None:
    """Count one doorbell ``outcome`` ("sent", "dropped", "skipped") with its ``reason`` (the
    log line's words, turned into a label value), where every scrape sees it."""
    if outcome not in DOORBELL_SERIES:
        raise ValueError(f"unknown doorbell outcome {outcome!r}")
    _tally.add(outcome, reason_label(reason))


def read_doorbell_counts() -> collections.Counter:
    """The shared totals, ``{"outcome|reason": count}`` (this process's own counts flushed
    first)."""
    return _tally.read()


class DoorbellCollector:
    def describe(self):
        return []  # no Redis round trip at registration

    def collect(self):
        counts = read_doorbell_counts()
        for outcome, (name, documentation) in DOORBELL_SERIES.items():
            labels = [] if outcome == "sent" else ["reason"]
            family = CounterMetricFamily(name, documentation, labels=labels)
            if outcome == "sent":
                family.add_metric([], counts.get("sent|", 0))
            for field, count in sorted(counts.items()):
                kind, _, reason = field.partition("|")
                if kind == outcome and outcome != "sent":
                    family.add_metric([reason], count)
            yield family


REGISTRY.register(DoorbellCollector())
