"""The sweeps the embedded scheduler runs (``switchboard.scheduler.embedded_sweeps`` finds
this module as ``<app>.sweeps``). The sweeps themselves live with what they sweep:
``sessions/sweeps.py`` and ``doorbells/sweeps.py``."""

from channels_push.doorbells.sweeps import announce_presence_boundaries, ring_due_todos
from channels_push.sessions.sweeps import expire_idle_sessions

# The sweeps the embedded scheduler runs, with their cadence in seconds (the beat schedule in
# switchboard/celery.py names the same cadence).
EMBEDDED_SWEEPS = [
    (expire_idle_sessions, 60.0),
    (ring_due_todos, 30.0),
    (announce_presence_boundaries, 30.0),
]
