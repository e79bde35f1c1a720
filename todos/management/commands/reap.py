from switchboard.commands import JsonCommand
from todos import sweeps


class Command(JsonCommand):
    help = "Run the lease reaper and the retry promoter once."

    def handle(self, *args, **options):
        moved = sweeps.expire_lapsed_leases() + sweeps.promote_due_retries()
        self.emit(options, {"moved": moved}, f"moved {moved} todos")
