"""Celery wrappers: each task calls one sweep function and nothing else."""

from celery import shared_task

from . import sweeps


@shared_task(name="ingest.tasks.prune_history")
def prune_history():
    return sweeps.prune_history_sweep()
