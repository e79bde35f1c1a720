"""Celery app: the worker runs the periodic sweeps that beat schedules (production mode).

The schedule is switchboard/schedule.py's table, which the embedded scheduler under
``manage.py serve`` reads too. The tasks are thin wrappers (``*/tasks.py``) around the same
plain sweep functions the embedded scheduler calls.
"""

import os

from celery import Celery

from switchboard import schedule

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "switchboard.settings")

app = Celery("switchboard")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
app.conf.beat_schedule = schedule.beat_schedule()
