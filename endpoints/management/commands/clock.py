"""``manage.py clock in|out SLUG [--until ISO-8601]`` and ``manage.py clock clear-override
SLUG`` (docs/reference.md#presence, docs/commands.md#clock)."""

from datetime import datetime, timezone as dt_timezone

from django.core.management.base import CommandError
from django.utils import timezone

from endpoints import transitions
from endpoints.models import Endpoint
from switchboard.commands import JsonCommand


class Command(JsonCommand):
    help = ("Clock an endpoint in or out. Without --until: its manual state (with a shift "
            "schedule, held until the next shift boundary). With --until: an operator override "
            "until that time (a manual clock never lifts an override: `clock clear-override "
            "SLUG` does). Presence turning in sends waiting work as one digest. Prints "
            '{"endpoint", "presence", "override_until"} (the effective presence, and the '
            "override's end while one decides it) with --json.")

    def add_arguments(self, parser):
        parser.add_argument("state", choices=["in", "out", "clear-override"])
        parser.add_argument("slug")
        parser.add_argument("--until", help="ISO-8601 time the override ends, e.g. 2026-12-01T09:00:00Z")

    def handle(self, *args, state, slug, until, **options):
        try:
            endpoint = Endpoint.objects.get(slug=slug)
        except Endpoint.DoesNotExist:
            raise CommandError(f"no endpoint {slug!r}") from None
        if state == "clear-override":
            if until:
                raise CommandError("--until does not go with clear-override")
            transitions.clear_override(endpoint)
        else:
            try:
                transitions.clock(endpoint, state, reason="operator", until=_parse_until(until))
            except ValueError as error:
                raise CommandError(str(error)) from None
        report = transitions.presence_report(endpoint)
        note = f" (operator override until {report['override_until']})" if report["override_until"] else ""
        self.emit(options, {"endpoint": endpoint.slug, **report},
                  f"{endpoint.slug} is {report['presence']}{note}")


def _parse_until(until):
    if not until:
        return None
    try:
        until_at = datetime.fromisoformat(until.replace("Z", "+00:00"))
    except ValueError:
        raise CommandError(f"--until: not an ISO-8601 time: {until!r}") from None
    if timezone.is_naive(until_at):
        until_at = until_at.replace(tzinfo=dt_timezone.utc)
    return until_at
