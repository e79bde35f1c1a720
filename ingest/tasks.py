"""Celery wrappers: each task calls one sweep function and nothing else."""

from celery import shared_task

from . import sweeps, write_back


@shared_task(name="ingest.tasks.prune_history")
def prune_history():
    return sweeps.prune_history_sweep()


@shared_task(name="ingest.tasks.prune_replay_ledger")
def prune_replay_ledger():
    return sweeps.prune_replay_ledger()


@shared_task(name="ingest.tasks.fold_dropped_delivery_counts")
def fold_dropped_delivery_counts():
    return sweeps.fold_dropped_delivery_counts()


@shared_task(name="ingest.tasks.delete_secrets_of_ended_todos")
def delete_secrets_of_ended_todos():
    return sweeps.delete_secrets_of_ended_todos()


@shared_task(name="ingest.tasks.revoke_ended_agent_tokens")
def revoke_ended_agent_tokens():
    return sweeps.revoke_ended_agent_tokens()


@shared_task(name="ingest.tasks.send_write_backs")
def send_write_backs():
    return write_back.send_due_write_backs()
