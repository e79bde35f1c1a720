"""Celery app: the worker runs the periodic sweeps that beat schedules (production mode).

The schedule is switchboard/schedule.py's table, which the embedded scheduler under
``manage.py serve`` reads too. The tasks are thin wrappers (``*/tasks.py``) around the same
plain sweep functions the embedded scheduler calls.
"""

import os

from celery import Celery, signals

from switchboard import schedule, tracing

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "switchboard.settings")

app = Celery("switchboard")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
app.conf.beat_schedule = schedule.beat_schedule()


# Traces (docs/operating.md#traces): each process exports its own spans when
# OTEL_EXPORTER_OTLP_ENDPOINT is set. The span processor's thread is restarted in each forked
# pool process by the SDK itself; what a process still holds is flushed as it stops.
@signals.worker_init.connect
def _trace_worker(**_):
    tracing.start("worker")


@signals.beat_init.connect
def _trace_beat(**_):
    tracing.start("beat")


@signals.worker_process_shutdown.connect
@signals.worker_shutdown.connect
def _flush_traces(**_):
    tracing.shutdown()
