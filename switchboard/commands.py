"""Shared shape of switchboard's management commands (docs/commands.md).

Every command that prints accepts ``--json`` and then prints exactly one JSON object on stdout;
errors go to stderr with a non-zero exit (``CommandError``).
"""

import json
import os
import socket
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

# How long the drift check waits for something to answer at the default public URL.
PUBLIC_URL_PROBE_SECONDS = 0.5
# URLs a command prints that are not this server's (a connection's source API).
OTHER_SERVERS_URL_KEYS = frozenset({"api_url"})


class JsonCommand(BaseCommand):
    def create_parser(self, prog_name, subcommand, **kwargs):
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        return parser

    def emit(self, options, data: dict, human: str | None):
        """``data`` as one JSON object under --json, else the ``human`` line (None: nothing)."""
        if any(key.endswith("_url") and key not in OTHER_SERVERS_URL_KEYS for key in data):
            warning = public_url_drift_warning()
            if warning:
                self.stderr.write(warning)  # stderr: stdout keeps exactly what --json promises
        if options.get("json"):
            self.stdout.write(json.dumps(data))
        elif human is not None:
            self.stdout.write(human)


def _answers(url: str) -> bool:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", port),
                                      timeout=PUBLIC_URL_PROBE_SECONDS):
            return True
    except OSError:
        return False


def public_url_drift_warning(environ=None) -> str:
    """A warning for commands that print URLs: SWITCHBOARD_PUBLIC_URL is unset and nothing
    answers at the default it falls back to, so the printed URLs are likely not where this
    server is reached ("" when it is set, or when something answers there)."""
    environ = os.environ if environ is None else environ
    if environ.get("SWITCHBOARD_PUBLIC_URL"):
        return ""
    url = settings.SWITCHBOARD_PUBLIC_URL
    if _answers(url):
        return ""
    return (f"warning: SWITCHBOARD_PUBLIC_URL is unset and nothing answers at {url}: the URLs "
            "printed assume a server there. Set SWITCHBOARD_PUBLIC_URL to the address "
            "agents and senders reach this server at (e.g. https://switchboard.example.com).")


def get_user(username: str):
    try:
        return get_user_model().objects.get(username=username)
    except get_user_model().DoesNotExist:
        raise CommandError(
            f"no user {username!r} (create one: manage.py createsuperuser)"
        ) from None


def validation_text(error) -> str:
    """A model ValidationError as one line, "field: problem; field: problem". Where a field has
    a message of the model's own (``clean()``; its errors carry no code), only those: it names
    the accepted range ("a whole number from 0 to 10000, or unset; got '-1'") where Django's
    validator for the same value says less ("Ensure this value is greater than or equal to 0."). Otherwise
    every distinct message of Django's validators (a slug too long *and* not a slug)."""
    if not hasattr(error, "error_dict"):
        return " ".join(error.messages)
    problems = []
    for field, errors in error.error_dict.items():
        chosen = [e for e in errors if e.code is None] or errors
        messages = dict.fromkeys(message for e in chosen for message in e.messages)
        problems.append(f"{field}: {' '.join(messages)}")
    return "; ".join(problems)


def csv_list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]
