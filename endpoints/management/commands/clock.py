"""``manage.py clock in|out SLUG [--until ISO-8601]`` (CONTRACT §8, §11)."""

from datetime import datetime, timezone as dt_timezone

from django.core.management.base import CommandError
from django.utils import timezone

from channels_push import doorbells
from endpoints.models import Endpoint
from switchboard.commands import JsonCommand


class Command(JsonCommand):
    help = ("Clock an endpoint in or out. Without --until: its manual state (with a shift "
            "schedule, held until the next shift boundary). With --until: an operator override "
            "until that time. Clocking in sends waiting work as one digest. Prints "
            '{"endpoint", "presence"} (the effective presence) with --json.')

    def add_arguments(self, parser):
        parser.add_argument("state", choices=["in", "out"])
        parser.add_argument("slug")
        parser.add_argument("--until", help="ISO-8601 time the override ends, e.g. 2026-12-01T09:00:00Z")

    def handle(self, *args, state, slug, until, **options):
        try:
            endpoint = Endpoint.objects.get(slug=slug)
        except Endpoint.DoesNotExist:
            raise CommandError(f"no endpoint {slug!r}") from None
        until_at = None
        if until:
            try:
                until_at = datetime.fromisoformat(until.replace("Z", "+00:00"))
            except ValueError:
                raise CommandError(f"--until: not an ISO-8601 time: {until!r}") from None
            if timezone.is_naive(until_at):
                until_at = until_at.replace(tzinfo=dt_timezone.utc)
        try:
            presence = doorbells.clock(endpoint, state, reason="operator", until=until_at)
        except ValueError as error:
            raise CommandError(str(error)) from None
        self.emit(options, {"endpoint": endpoint.slug, "presence": presence},
                  f"{endpoint.slug} is {presence}")
