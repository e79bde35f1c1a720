"""``manage.py pause SLUG [--queue Q]`` (docs/reference.md#pausing, docs/commands.md#pause)."""

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError

from endpoints import transitions
from endpoints.models import Endpoint
from switchboard.commands import JsonCommand

# Who the event names when a command pauses or resumes (there is no signed-in operator).
COMMAND_ACTOR = "manage.py"


def get_endpoint(slug: str) -> Endpoint:
    try:
        return Endpoint.objects.get(slug=slug)
    except Endpoint.DoesNotExist:
        raise CommandError(f"no endpoint {slug!r}") from None


class Command(JsonCommand):
    help = ("Pause an endpoint's work, or one queue of it: claim_next skips it, claim answers "
            "'paused', doorbells and sweeps hold; webhooks keep arriving and held leases keep "
            'working. Prints {"endpoint", "paused": [queues or "*"]} with --json.')
    # The transition this command runs, and its --queue help (``resume`` overrides both).
    change = staticmethod(transitions.pause_work)
    queue_help = "pause only this queue (default: the whole endpoint)"

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--queue", help=self.queue_help)

    def handle(self, *args, slug, queue, **options):
        endpoint = get_endpoint(slug)
        try:
            paused = self.change(endpoint, queue=queue, actor=COMMAND_ACTOR)
        except (ValueError, ValidationError) as error:
            raise CommandError("; ".join(getattr(error, "messages", [str(error)]))) from None
        self.emit(options, {"endpoint": endpoint.slug, "paused": paused},
                  f"{endpoint.slug}: paused {', '.join(paused) or 'nothing'}")
