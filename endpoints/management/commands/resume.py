"""``manage.py resume SLUG [--queue Q]`` (CONTRACT §11, §14)."""

from endpoints import transitions
from switchboard.commands import JsonCommand

from .pause import run


class Command(JsonCommand):
    help = ("Resume an endpoint's paused work (every pause), or one paused queue. Waiting work "
            "arrives as one digest (reason 'resumed'). Prints "
            '{"endpoint", "paused": [queues or "*"]} (what stays paused) with --json.')

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--queue", help="resume only this queue (default: everything)")

    def handle(self, *args, slug, queue, **options):
        run(self, options, transitions.resume_work, slug, queue)
