"""``manage.py shift_schedule SLUG [--timezone TZ] (--windows JSON | --clear)``
(docs/reference.md#presence)."""

import json

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError
from django.utils import timezone

from endpoints import transitions
from endpoints.models import Endpoint
from switchboard.commands import JsonCommand, validation_text


class Command(JsonCommand):
    help = ("Set an endpoint's weekly shift schedule: --windows is a JSON list of "
            '{"day": "mon".."sun", "start": "HH:MM", "end": "HH:MM"} (at most '
            "SWITCHBOARD_MAX_SHIFT_WINDOWS, default 50) in --timezone (an IANA zone; default: the "
            "endpoint's current one); --clear removes the schedule. Prints "
            '{"endpoint", "timezone", "windows", "presence"} with --json.')

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--timezone", dest="zone_name", help="IANA time zone, e.g. Europe/Berlin")
        which = parser.add_mutually_exclusive_group(required=True)
        which.add_argument("--windows", help='JSON list, e.g. \'[{"day": "mon", "start": "09:00", '
                                             '"end": "17:00"}]\'')
        which.add_argument("--clear", action="store_true", help="remove the schedule")

    def handle(self, *args, slug, zone_name, windows, clear, **options):
        try:
            endpoint = Endpoint.objects.get(slug=slug)
        except Endpoint.DoesNotExist:
            raise CommandError(f"no endpoint {slug!r}") from None
        try:
            parsed = [] if clear else json.loads(windows)
        except ValueError as exc:
            raise CommandError(f"--windows: not JSON ({exc})") from None
        zone = "" if clear else (zone_name if zone_name is not None else endpoint.shift_timezone)
        now = timezone.now()
        try:
            before, after = transitions.set_shift_schedule(endpoint, timezone_name=zone,
                                                           windows=parsed, now=now)
        except ValidationError as exc:
            raise CommandError(validation_text(exc)) from None
        self.emit(options, {"endpoint": endpoint.slug, "timezone": zone, "windows": parsed,
                            "presence": after},
                  f"{endpoint.slug}: {len(parsed)} shift window(s) in {zone or '-'}; now {after}")

