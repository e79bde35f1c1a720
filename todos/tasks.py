"""Celery wrappers: each task calls one sweep function and nothing else."""

from celery import shared_task

from . import sweeps


@shared_task(name="todos.tasks.expire_lapsed_leases")
def expire_lapsed_leases():
    return sweeps.expire_lapsed_leases()


@shared_task(name="todos.tasks.promote_due_retries")
def promote_due_retries():
    return sweeps.promote_due_retries()


@shared_task(name="todos.tasks.fold_throughput")
def fold_throughput():
    return sweeps.fold_throughput()


@shared_task(name="todos.tasks.release_due_scheduled_todos")
def release_due_scheduled_todos():
    return sweeps.release_due_scheduled_todos()


@shared_task(name="todos.tasks.cancel_stale_approvals")
def cancel_stale_approvals():
    return sweeps.cancel_stale_approvals()
