"""Prometheus series for /metrics (docs/operating.md#metrics): the registry, and the
in-process counters.

Two kinds of series, on purpose:

* Queue series derived from the database at scrape time (``todos.metrics``, which registers
  them here): the backlog, and the transition counters counted from the todo event audit
  trail. Several web processes share one database, so every process answers the same totals
  and a restart loses nothing; in-process counters could not promise either.
* In-process counters for things the database does not record (a doorbell written to a stream,
  a webhook rejected before anything is stored). Other apps import and increment them:

      from switchboard import metrics
      metrics.DOORBELLS_SENT.inc()
      metrics.DOORBELLS_DROPPED.inc()
      metrics.INGEST_ACCEPTED.labels(source="github").inc()
      metrics.INGEST_REJECTED.labels(reason="bad_signature").inc()

  They count per process: scrape every web process (Prometheus sums them with ``sum()``).
"""

from prometheus_client import CollectorRegistry, Counter

REGISTRY = CollectorRegistry(auto_describe=True)

DOORBELLS_SENT = Counter(
    "switchboard_doorbells_sent", "Doorbell notifications written to an MCP session stream.",
    registry=REGISTRY,
)
DOORBELLS_DROPPED = Counter(
    "switchboard_doorbells_dropped", "Doorbell notifications dropped (no stream, full buffer, channel layer down).",
    registry=REGISTRY,
)
INGEST_ACCEPTED = Counter(
    "switchboard_ingest_accepted", "Webhook deliveries and operator todos accepted.",
    ["source"], registry=REGISTRY,
)
INGEST_REJECTED = Counter(
    "switchboard_ingest_rejected", "Webhook deliveries rejected (signature, size, rate, body).",
    ["reason"], registry=REGISTRY,
)
