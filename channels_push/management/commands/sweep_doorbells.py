"""``manage.py sweep_doorbells``: run the doorbell heartbeat sweep once
(docs/commands.md#sweep_doorbells)."""

from channels_push.doorbells import sweeps
from channels_push.bus import publish
from switchboard.commands import JsonCommand


class Command(JsonCommand):
    help = ("Run the doorbell heartbeat sweep once: re-ring up to 3 due pending todos on "
            "endpoints with an attached session. Prints {\"rung\": n} with --json.")

    def handle(self, *args, **options):
        if not publish.can_reach_streams():
            # The embedded default (in-memory layer, no REDIS_URL): only the server process can
            # reach its streams, and its own scheduler runs this sweep every 30 s.
            self.stderr.write("sweep_doorbells: no stream is reachable from this process "
                              "(in-memory channel layer, REDIS_URL unset); the server's own "
                              "scheduler runs the sweep. Nothing rung.")
            self.emit(options, {"rung": 0}, "rung 0 todo(s)")
            return
        rung = sweeps.ring_due_todos()
        self.emit(options, {"rung": rung}, f"rung {rung} todo(s)")
