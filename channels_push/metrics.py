"""Prometheus series for /metrics (CONTRACT §9).

Two kinds, on purpose:

* Queue series derived from the database at scrape time — todos by state and queue, and the
  transition counters (claims, completions, failures, dead letters, lease lapses) counted from
  the todo event audit trail. Several web processes share one database, so every process
  answers the same totals and a restart loses nothing; in-process counters could not promise
  either.
* In-process counters for things the database does not record (a doorbell written to a stream,
  a webhook rejected before anything is stored). Other apps import and increment them:

      from channels_push import metrics
      metrics.DOORBELLS_SENT.inc()
      metrics.DOORBELLS_DROPPED.inc()
      metrics.INGEST_ACCEPTED.labels(source="github").inc()
      metrics.INGEST_REJECTED.labels(reason="bad_signature").inc()

  They count per process: scrape every web process (Prometheus sums them with ``sum()``).
"""

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

REGISTRY = CollectorRegistry(auto_describe=True)

DOORBELLS_SENT = Counter(
    "switchboard_doorbells_sent", "Doorbell notifications written to an MCP session stream.",
    registry=REGISTRY,
)
DOORBELLS_DROPPED = Counter(
    "switchboard_doorbells_dropped", "Doorbell notifications dropped (no stream, full buffer).",
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

# Audit-trail actions -> counter name. The reaper writes "lease_lapsed" for both its outcomes;
# the one that lands in "failed" is also a dead letter.
TRANSITION_COUNTERS = {
    "claim": ("switchboard_todo_claims", "Todos claimed (by agents or operators)."),
    "complete": ("switchboard_todo_completions", "Todos completed."),
    "fail": ("switchboard_todo_failures", "Todos failed (including those dead-lettered)."),
    "lease_lapsed": ("switchboard_todo_lease_lapses", "Leases that lapsed and were reaped."),
    "create": ("switchboard_todos_created", "Todos created."),
    "requeue": ("switchboard_todo_requeues", "Failed todos re-queued by a human."),
}
DEAD_LETTERS = ("switchboard_todo_dead_letters", "Todos dead-lettered (attempts spent).")


class QueueCollector:
    """Reads the queue series from the database on every scrape."""

    def describe(self):
        return []  # no scrape-time queries at registration

    def collect(self):
        from todos import queries
        from todos.models import State

        by_state = GaugeMetricFamily(
            "switchboard_todos", "Todos by endpoint, queue and state.",
            labels=["endpoint", "queue", "state"],
        )
        for endpoint, queue, state, count in queries.count_todos_by_state():
            by_state.add_metric([endpoint, queue, state], count)
        yield by_state

        totals = dict.fromkeys(TRANSITION_COUNTERS, 0)
        dead = 0
        for action, to_state, count in queries.count_todo_events():
            if action == "dead_letter":
                # A dead letter is the failure of the last attempt: count it as both.
                totals["fail"] += count
                dead += count
            elif action in totals:
                totals[action] += count
                if action == "lease_lapsed" and to_state == State.FAILED:
                    dead += count
        for action, (name, documentation) in TRANSITION_COUNTERS.items():
            family = CounterMetricFamily(name, documentation)
            family.add_metric([], totals[action])
            yield family
        family = CounterMetricFamily(*DEAD_LETTERS)
        family.add_metric([], dead)
        yield family


REGISTRY.register(QueueCollector())
