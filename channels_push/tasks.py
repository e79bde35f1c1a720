"""Celery wrappers: each task calls one sweep function and nothing else."""

from celery import shared_task

from .doorbells import sweeps as doorbell_sweeps
from .sessions import sweeps as session_sweeps


@shared_task(name="channels_push.tasks.expire_idle_sessions")
def expire_idle_sessions():
    return session_sweeps.expire_idle_sessions()


@shared_task(name="channels_push.tasks.ring_due_todos")
def ring_due_todos():
    return doorbell_sweeps.ring_due_todos()


@shared_task(name="channels_push.tasks.announce_presence_boundaries")
def announce_presence_boundaries():
    return doorbell_sweeps.announce_presence_boundaries()


@shared_task(name="channels_push.tasks.announce_budget_day_turns")
def announce_budget_day_turns():
    return doorbell_sweeps.announce_budget_day_turns()
