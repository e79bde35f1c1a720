"""``manage.py sweep_doorbells``: run the doorbell heartbeat sweep once (CONTRACT §7, §11)."""

from channels_push import sweeps
from switchboard.commands import JsonCommand


class Command(JsonCommand):
    help = ("Run the doorbell heartbeat sweep once: re-ring up to 3 due pending todos on "
            "endpoints with an attached session. Prints {\"rung\": n} with --json.")

    def handle(self, *args, **options):
        rung = sweeps.ring_due_todos()
        self.emit(options, {"rung": rung}, f"rung {rung} todo(s)")
