from datetime import timedelta

from django.core.management.base import CommandError

from endpoints import transitions
from endpoints.models import Endpoint
from switchboard.commands import JsonCommand


# A grace longer than a month is a rotation that never finishes (and a huge number overflowed
# the date arithmetic into a traceback), as for a webhook's secret.
MAX_GRACE_SECONDS = 30 * 86_400


class Command(JsonCommand):
    help = "Mint a new credential for an endpoint; old ones keep working for the grace period."

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--grace-seconds", type=int,
                            default=int(transitions.DEFAULT_ROTATION_GRACE.total_seconds()))

    def handle(self, *args, slug, grace_seconds, **options):
        if not 0 <= grace_seconds <= MAX_GRACE_SECONDS:
            raise CommandError(f"--grace-seconds must be between 0 and {MAX_GRACE_SECONDS} "
                               "(30 days)")
        try:
            endpoint = Endpoint.objects.get(slug=slug)
        except Endpoint.DoesNotExist:
            raise CommandError(f"no endpoint {slug!r}") from None
        credential = transitions.rotate_credential(endpoint, grace=timedelta(seconds=grace_seconds))
        self.emit(options, {"slug": slug, "credential": credential},
                  f"new credential for {slug}: {credential}\n(old credentials expire in {grace_seconds} s)")
