from django.core.management.base import CommandError

from ingest import queries
from ingest.models import Outcome, Webhook
from switchboard.commands import JsonCommand

DEFAULT_LIMIT = 50
MAX_LIMIT = 1000


class Command(JsonCommand):
    help = "Print a webhook's latest deliveries (the delivery log), newest first."

    def add_arguments(self, parser):
        parser.add_argument("webhook", help="webhook slug")
        parser.add_argument("--outcome", choices=Outcome.values, help="only this outcome")
        parser.add_argument("--limit", type=int, default=DEFAULT_LIMIT,
                            help=f"at most this many (1-{MAX_LIMIT}, default {DEFAULT_LIMIT})")

    def handle(self, *args, webhook, outcome, limit, **options):
        if not 1 <= limit <= MAX_LIMIT:
            raise CommandError(f"--limit must be between 1 and {MAX_LIMIT}")
        hook = Webhook.objects.filter(slug=webhook).first()
        if hook is None:
            raise CommandError(f"no webhook {webhook!r}")
        rows = [queries.delivery_as_dict(record)
                for record in queries.latest_deliveries(hook, outcome=outcome, limit=limit)]
        human = "\n".join(
            f"#{r['id']} {r['at']} {r['outcome']:<16} {r['status']} {r['kind'] or '-'} "
            f"{r['delivery_id'] or '-'} {r['size']} B todos={','.join(r['todos']) or '-'}"
            + (f" reason: {r['reason']}" if r["reason"] else "")
            for r in rows) or f"no deliveries for {webhook}"
        self.emit(options, {"deliveries": rows}, human)
