import sys

from django.core.management.base import CommandError

from ingest import connections, queries
from switchboard.commands import JsonCommand


class Command(JsonCommand):
    help = ("Test a connection: call the source's identity endpoint (GitHub: GET /app or "
            "GET /user) and record who it says we are, or the error. Exits 1 when it fails.")

    def add_arguments(self, parser):
        parser.add_argument("name")

    def handle(self, *args, name, **options):
        connection = queries.find_connection(name)
        if connection is None:
            raise CommandError(f"no connection {name!r}")
        test = connections.test_connection(connection)
        self.emit(options, {"name": connection.name, "ok": test.ok, "identity": test.identity,
                            "error": test.error},
                  f"connection {connection.name}: writes back as {test.identity}" if test.ok
                  else None)
        if not test.ok:
            self.stderr.write(f"connection {connection.name}: the test failed: {test.error}")
            sys.exit(1)
