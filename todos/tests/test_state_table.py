"""The transition functions take exactly the edges written down in todos.models.EDGES."""

from datetime import timedelta

import pytest
from django.utils import timezone

from todos import sweeps, transitions
from todos.models import EDGES, TodoEvent
from todos.transitions import Caller, Refusal

pytestmark = pytest.mark.django_db


def recorded_edges():
    return {(a, f, t) for a, f, t in TodoEvent.objects.values_list("action", "from_state", "to_state")}


def test_every_edge_is_taken_and_no_other(agent, endpoint, make_todo):
    endpoint.max_attempts = 2
    endpoint.save()
    operator = Caller.operator(endpoint, "alice")
    now = timezone.now()

    done = make_todo()
    transitions.claim_todo(agent, done.pk, now=now)
    transitions.heartbeat_todo(agent, done.pk, now=now)
    transitions.complete_todo(agent, done.pk, now=now)

    released = make_todo()
    transitions.claim_todo(agent, released.pk, now=now)
    transitions.release_todo(agent, released.pk, now=now)

    retried = make_todo()
    transitions.claim_todo(agent, retried.pk, now=now)
    transitions.fail_todo(agent, retried.pk, now=now)                 # fail
    sweeps.promote_due_retries(now=now + timedelta(hours=1))           # retry
    transitions.claim_todo(agent, retried.pk, now=now)
    transitions.fail_todo(agent, retried.pk, now=now)                 # dead_letter
    transitions.requeue_todo(operator, retried.pk, now=now)           # requeue

    promoted = make_todo(trust="unverified")
    transitions.promote_todo(operator, promoted.pk, now=now)            # promote

    lapsed = make_todo()
    for _ in range(2):
        transitions.claim_todo(agent, lapsed.pk, lease_ttl_seconds=1, now=now)
        now += timedelta(seconds=5)
        sweeps.expire_lapsed_leases(now=now)                           # lapse, then lapse to dead

    assert recorded_edges() == set(EDGES)


def test_a_refused_transition_records_no_event(agent, make_todo):
    todo = make_todo()
    before = TodoEvent.objects.count()
    for call in (transitions.complete_todo, transitions.heartbeat_todo, transitions.release_todo,
                 transitions.fail_todo):
        with pytest.raises(Refusal):
            call(agent, todo.pk)
    with pytest.raises(Refusal):
        transitions.requeue_todo(agent, todo.pk)
    assert TodoEvent.objects.count() == before
