"""Shared shape of switchboard's management commands (CONTRACT §11).

Every command that prints accepts ``--json`` and then prints exactly one JSON object on stdout;
errors go to stderr with a non-zero exit (``CommandError``).
"""

import json

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError


class JsonCommand(BaseCommand):
    def create_parser(self, prog_name, subcommand, **kwargs):
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        return parser

    def emit(self, options, data: dict, human: str):
        if options.get("json"):
            self.stdout.write(json.dumps(data))
        else:
            self.stdout.write(human)


def get_user(username: str):
    try:
        return get_user_model().objects.get(username=username)
    except get_user_model().DoesNotExist:
        raise CommandError(
            f"no user {username!r} (create one: manage.py createsuperuser)"
        ) from None


def csv_list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]
