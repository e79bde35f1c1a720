from switchboard.commands import JsonCommand
from todos import sweeps


class Command(JsonCommand):
    help = ("Run the lease reaper, the retry promoter and the due sweep (scheduled todos whose "
            "time came) once.")

    def handle(self, *args, **options):
        moved = (sweeps.expire_lapsed_leases() + sweeps.promote_due_retries()
                 + sweeps.release_due_scheduled_todos())
        self.emit(options, {"moved": moved}, f"moved {moved} todos")
