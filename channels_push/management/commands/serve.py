"""``manage.py serve``: the embedded default in one process
(docs/operating.md#the-embedded-default).

Creates and migrates the database, then runs daphne with the periodic sweeps inside the same
process. With REDIS_URL set (production) the sweeps are Celery beat's job, so they are not
started here unless --sweeps is given.
"""

import logging

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand

log = logging.getLogger("switchboard.serve")


class Command(BaseCommand):
    help = "Run switchboard (daphne + in-process sweeps). Migrates the database first."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument(
            "--sweeps", choices=["auto", "on", "off"], default="auto",
            help="run the periodic sweeps in this process (auto: only without REDIS_URL)",
        )

    def handle(self, *args, host, port, sweeps, **options):
        call_command("migrate", interactive=False, verbosity=0)
        from daphne.endpoints import build_endpoint_description_strings
        from daphne.server import Server

        from switchboard import scheduler
        from switchboard.asgi import application

        run_sweeps = sweeps == "on" or (sweeps == "auto" and not settings.REDIS_URL)
        base = f"http://{host}:{port}"

        def ready():
            if run_sweeps:
                scheduler.start()
            mode = "embedded (SQLite)" if settings.EMBEDDED else "database from DATABASE_URL"
            self.stdout.write(
                f"switchboard is up — {mode}; sweeps {'in this process' if run_sweeps else 'by Celery beat'}\n"
                f"  board:  {base}/todos/\n  admin:  {base}/admin/\n  health: {base}/healthz\n"
                "  Ctrl-C stops it.",
            )
            self.stdout.flush()

        Server(
            application=application,
            endpoints=build_endpoint_description_strings(host=host, port=port),
            ready_callable=ready,
            # Long-lived MCP and board streams: never cut them for being slow.
            http_timeout=None,
        ).run()
