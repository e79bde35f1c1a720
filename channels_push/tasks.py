"""Celery wrappers: each task calls one sweep function and nothing else."""

from celery import shared_task

from . import sweeps


@shared_task(name="channels_push.tasks.expire_idle_sessions")
def expire_idle_sessions():
    return sweeps.expire_idle_sessions()


@shared_task(name="channels_push.tasks.ring_due_todos")
def ring_due_todos():
    return sweeps.ring_due_todos()


@shared_task(name="channels_push.tasks.announce_presence_boundaries")
def announce_presence_boundaries():
    return sweeps.announce_presence_boundaries()
