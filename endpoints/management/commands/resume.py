"""``manage.py resume SLUG [--queue Q]`` (docs/reference.md#pausing, docs/commands.md#resume)."""

from endpoints import transitions

from . import pause


class Command(pause.Command):
    help = ("Resume an endpoint's paused work (every pause), or one paused queue. Waiting work "
            "arrives as one digest (reason 'resumed'). Prints "
            '{"endpoint", "paused": [queues or "*"]} (what stays paused) with --json.')
    change = staticmethod(transitions.resume_work)
    queue_help = "resume only this queue (default: everything)"
