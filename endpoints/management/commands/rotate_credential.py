from datetime import timedelta

from django.core.management.base import CommandError

from endpoints import transitions
from endpoints.models import Endpoint
from switchboard.commands import JsonCommand


class Command(JsonCommand):
    help = "Mint a new credential for an endpoint; old ones keep working for the grace period."

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--grace-seconds", type=int,
                            default=int(transitions.DEFAULT_ROTATION_GRACE.total_seconds()))

    def handle(self, *args, slug, grace_seconds, **options):
        if grace_seconds < 0:
            raise CommandError("--grace-seconds must be >= 0")
        try:
            endpoint = Endpoint.objects.get(slug=slug)
        except Endpoint.DoesNotExist:
            raise CommandError(f"no endpoint {slug!r}") from None
        credential = transitions.rotate_credential(endpoint, grace=timedelta(seconds=grace_seconds))
        self.emit(options, {"slug": slug, "credential": credential},
                  f"new credential for {slug}: {credential}\n(old credentials expire in {grace_seconds} s)")
