"""The queue series of /metrics, derived from the database at every scrape
(docs/operating.md#metrics): the backlog by endpoint, queue and state, and the transition
counters (claims, completions, failures, dead letters, lease lapses) counted from the todo
event audit trail. Both stay cheap as history grows (``EventTally``,
``queries.count_backlog_by_queue``). Registered in ``switchboard.metrics.REGISTRY`` when this
module is imported (the /metrics view does).
"""

import collections
import threading
from datetime import timedelta

from django.utils import timezone
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from endpoints.models import Endpoint
from ingest import queries as ingest_queries, write_back
from switchboard.metrics import REGISTRY

from todos import queries, usage
from todos.models import State

# Audit-trail actions -> counter name. The reaper writes "lease_lapsed" for both its outcomes;
# the one that lands in "failed" is also a dead letter.
TRANSITION_COUNTERS = {
    "claim": ("switchboard_todo_claims", "Todos claimed (by agents or operators)."),
    "complete": ("switchboard_todo_completions", "Todos completed."),
    "fail": ("switchboard_todo_failures", "Todos failed (including those dead-lettered)."),
    "lease_lapsed": ("switchboard_todo_lease_lapses", "Leases that lapsed and were reaped."),
    "create": ("switchboard_todos_created", "Todos created."),
    "requeue": ("switchboard_todo_requeues", "Failed todos re-queued by a human."),
    "due": ("switchboard_todos_scheduled_due", "Scheduled todos that came due (made ready by "
                                               "the due sweep)."),
    "run_now": ("switchboard_todo_runs_now", "Scheduled todos an operator made ready at once."),
    "prioritize": ("switchboard_todo_priority_changes", "Priorities an operator changed."),
    "cancel": ("switchboard_todo_cancellations",
               "Todos cancelled: by an operator, rejected, or their approval timed out."),
    "approve": ("switchboard_todo_approvals", "Todos awaiting approval that an operator approved."),
}
# Actions counted under another's counter: a rejection ends the todo cancelled.
COUNTED_AS = {"reject": "cancel"}
DEAD_LETTERS = ("switchboard_todo_dead_letters", "Todos dead-lettered (attempts spent).")

# How long after its ``at`` an event's transaction may still be open. Transitions are single
# statements inside short transactions (milliseconds); a minute is a wide margin.
EVENT_SETTLE_TIME = timedelta(seconds=60)


class EventTally:
    """Counts of the audit trail by (action, to_state), kept per process and brought up to date
    on each scrape by counting only the events written since the last one.

    Why not one GROUP BY over the whole table per scrape: it reads every event ever written
    (bench/metrics_scrape.py measures it: linear in the table). Why the settle margin:
    event ids are taken before commit, so an id below the newest visible one may still be
    uncommitted and invisible. Every id below that of an event written more than twice the
    settle time ago was taken, and its transaction finished, over one settle time ago; only
    ids up to there are folded into the running total. Events after it are recounted on every
    scrape (a primary-key range of the last couple of minutes).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._forget_settled(pruned_total=0)

    def _forget_settled(self, *, pruned_total):
        self._settled_through = 0
        self._settled = collections.Counter()
        self._pruned_total = pruned_total

    def counts(self, *, now=None) -> collections.Counter:
        now = now or timezone.now()
        with self._lock, queries.metrics_snapshot():
            # Retention folds the events it deletes into a tally. The running total
            # cached here still holds those events, so after a prune it is recounted once:
            # remaining events + tally, never both for the same event.
            pruned = queries.count_pruned_events()
            if sum(pruned.values()) != self._pruned_total:
                self._forget_settled(pruned_total=sum(pruned.values()))
            settled_id = queries.find_settled_event_id(
                after_id=self._settled_through, written_before=now - 2 * EVENT_SETTLE_TIME
            )
            if settled_id is not None:
                for action, to_state, n in queries.count_todo_events(
                    after_id=self._settled_through, up_to_id=settled_id
                ):
                    self._settled[(action, to_state)] += n
                self._settled_through = settled_id
            totals = collections.Counter(self._settled)
            totals.update(pruned)
            for action, to_state, n in queries.count_todo_events(after_id=self._settled_through):
                totals[(action, to_state)] += n
            return totals


class QueueCollector:
    """Reads the queue series from the database on every scrape."""

    def __init__(self):
        self.tally = EventTally()

    def describe(self):
        return []  # no scrape-time queries at registration

    def collect(self):
        backlog = GaugeMetricFamily(
            "switchboard_todos",
            "Todos waiting or in flight by endpoint, queue and state (awaiting_approval, "
            "pending, claimed, failed; failed includes dead letters). Done todos: "
            "switchboard_todo_completions_total; cancelled: switchboard_todo_cancellations_total.",
            labels=["endpoint", "queue", "state"],
        )
        for endpoint, queue, state, count in queries.count_backlog_by_queue():
            backlog.add_metric([endpoint, queue, state], count)
        yield backlog

        scheduled = GaugeMetricFamily(
            "switchboard_todos_scheduled",
            "Pending todos not ready before their not_before, by endpoint and queue (they are "
            'also in switchboard_todos{state="pending"}).',
            labels=["endpoint", "queue"],
        )
        for endpoint, queue, count in queries.count_scheduled_by_queue():
            scheduled.add_metric([endpoint, queue], count)
        yield scheduled

        totals = dict.fromkeys(TRANSITION_COUNTERS, 0)
        dead = 0
        for (action, to_state), count in self.tally.counts().items():
            if action == "dead_letter":
                # A dead letter is the failure of the last attempt: count it as both.
                totals["fail"] += count
                dead += count
            elif COUNTED_AS.get(action, action) in totals:
                totals[COUNTED_AS.get(action, action)] += count
                if action == "lease_lapsed" and to_state == State.FAILED:
                    dead += count
        for action, (name, documentation) in TRANSITION_COUNTERS.items():
            family = CounterMetricFamily(name, documentation)
            family.add_metric([], totals[action])
            yield family
        family = CounterMetricFamily(*DEAD_LETTERS)
        family.add_metric([], dead)
        yield family

        # Summed from the days' spend rows, which retention never prunes: never going down.
        cost = CounterMetricFamily(
            "switchboard_agent_cost_usd", "US dollars agents reported spending (usage of "
            "complete and fail), by endpoint.", labels=["endpoint"])
        tokens = CounterMetricFamily(
            "switchboard_agent_tokens", "Tokens (input + output) agents reported using, by "
            "endpoint.", labels=["endpoint"])
        for slug, cost_microusd, token_count in usage.total_spend_by_endpoint():
            cost.add_metric([slug], usage.usd(cost_microusd))
            tokens.add_metric([slug], token_count)
        yield cost
        yield tokens

        paused = GaugeMetricFamily(
            "switchboard_paused_queues",
            'Paused work by endpoint and queue (1 while paused; queue "*": the whole endpoint).',
            labels=["endpoint", "queue"],
        )
        for slug, queues in (Endpoint.objects.exclude(paused_queues=[])
                             .values_list("slug", "paused_queues")):
            for queue in queues or []:
                paused.add_metric([slug, str(queue)], 1)
        yield paused


class WriteBackCollector:
    """The write-back sender's outcomes and ack latency, read from its durable tally
    (``ingest.models.WriteBackTally``: a few rows per source) on every scrape, so every web
    process answers the same counts, whichever process or worker sent."""

    def describe(self):
        return []  # no scrape-time queries at registration

    def collect(self):
        outcomes = CounterMetricFamily(
            "switchboard_write_backs",
            "Sends of write-backs to their source, by source and outcome: sent (the source "
            "took it), retried (a network error, 5xx or rate limit: it goes again), failed "
            "(the source refused it), abandoned (failing for 24 h).", labels=["source", "outcome"])
        latency = HistogramMetricFamily(
            "switchboard_write_back_ack_seconds",
            "Seconds from a todo's creation (its delivery's 202) to its source taking the ack.",
            labels=["source"])
        by_source = collections.defaultdict(dict)
        for source, series, label, count, total_seconds in (
                ingest_queries.count_write_back_outcomes()):
            if series == "outcome":
                outcomes.add_metric([source, label], count)
            else:
                by_source[source][label] = (count, total_seconds)
        for source, buckets in by_source.items():
            running, cumulative = 0, []
            for bound in write_back.ACK_SECONDS_LABELS:
                running += buckets.get(bound, (0, 0.0))[0]
                cumulative.append((bound, running))
            latency.add_metric([source], cumulative,
                               sum(seconds for _, seconds in buckets.values()))
        yield outcomes
        yield latency


class AgentCredentialCollector:
    """Todo tokens and repository tokens issued to agents and revoked since
    (docs/security.md#agent-credentials), counted from their rows on every scrape."""

    def describe(self):
        return []

    def collect(self):
        issued = CounterMetricFamily(
            "switchboard_agent_credentials_issued",
            "Credentials given to agents: todo tokens (one per claim) and repository tokens, "
            "over the kept history.", labels=["kind"])
        revoked = CounterMetricFamily(
            "switchboard_agent_credentials_revoked",
            "Of those, the ones revoked once their lease ended.", labels=["kind"])
        for kind, issued_count, revoked_count in ingest_queries.count_agent_credentials():
            issued.add_metric([kind], issued_count)
            revoked.add_metric([kind], revoked_count)
        yield issued
        yield revoked


REGISTRY.register(QueueCollector())
REGISTRY.register(AgentCredentialCollector())
REGISTRY.register(WriteBackCollector())
