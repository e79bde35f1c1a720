from switchboard.commands import JsonCommand

from ingest import sweeps


class Command(JsonCommand):
    help = ("Delete history past retention once (done todos with their events, secrets and "
            "delivery events; dead letters only when SWITCHBOARD_RETAIN_DEAD_DAYS is set; ended "
            "MCP sessions), in bounded batches. Prints rows per kind.")

    def add_arguments(self, parser):
        parser.add_argument("--dry-run", action="store_true",
                            help="count what would be deleted; delete nothing")

    def handle(self, *args, dry_run=False, **options):
        counts = sweeps.prune_history(dry_run=dry_run)
        key = "would_prune" if dry_run else "pruned"
        summary = ", ".join(f"{kind} {n}" for kind, n in counts.items())
        self.emit(options, {key: counts}, f"{key.replace('_', ' ')}: {summary}")
