import argparse
import os
import sys
from pathlib import Path

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError
from django.db import IntegrityError

from ingest import connections
from ingest.models import ConnectionKind
from switchboard.commands import JsonCommand, get_user, validation_text

# A secret file larger than this is not a key or a token (a PEM of a 4096-bit key is ~3.3 KB).
MAX_SECRET_FILE_BYTES = 64 * 1024


def read_secret(*, env: str | None, path: str | None, what: str) -> str:
    """The secret named by an environment variable or a file (never given on the command line,
    where other users and shell history see it); CommandError naming the flag."""
    if env:
        value = os.environ.get(env, "")
        if not value:
            raise CommandError(f"--token-env: the environment variable {env} is empty or unset")
        return value.strip()
    if path:
        file = Path(path)
        try:
            if file.stat().st_size > MAX_SECRET_FILE_BYTES:
                raise CommandError(f"{what}: {path} is too large to be a key or a token")
            return file.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise CommandError(f"{what}: cannot read {path}: {exc}") from None
    raise CommandError(f"{what}: the secret is read from a file or an environment variable")


class Command(JsonCommand):
    help = ("Create a connection: switchboard's identity at a source, which webhooks write back "
            "under. The secret (an App's private key, or a token) is read from a file or an "
            "environment variable, stored encrypted and never shown again. The connection is "
            "tested at once and saved even when the test fails.")

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("--owner", required=True, help="username of the operator who owns it")
        parser.add_argument("--kind", required=True, choices=ConnectionKind.values)
        parser.add_argument("--app-id", default="", help="github_app: the App's id")
        parser.add_argument("--private-key-file", help="github_app: the App's private key (.pem)")
        secret = parser.add_mutually_exclusive_group()
        secret.add_argument("--token-env", metavar="VAR",
                            help="read the token from this environment variable")
        secret.add_argument("--token-file", metavar="PATH", help="read the token from this file")
        # Not an option: here only to refuse it in words rather than argparse's "ambiguous
        # option" (--token is a prefix of both flags above). Its value is never printed.
        parser.add_argument("--token", dest="token_on_command_line", help=argparse.SUPPRESS)
        parser.add_argument("--api-url", help="the source's API root (GitHub Enterprise Server: "
                                              "https://HOST/api/v3); default the public one")

    def handle(self, *args, name, owner, kind, app_id, private_key_file, token_env, token_file,
               api_url, token_on_command_line, **options):
        if token_on_command_line is not None:
            raise CommandError("--token: secrets are not taken on the command line (other users "
                               "and the shell's history see them); use --token-env VAR or "
                               "--token-file PATH")
        if kind == ConnectionKind.GITHUB_APP:
            if token_env or token_file:
                raise CommandError("--kind github_app takes --app-id and --private-key-file, "
                                   "not a token")
            secret = read_secret(env=None, path=private_key_file, what="--private-key-file")
        else:
            if private_key_file:
                raise CommandError(f"--private-key-file is for --kind github_app, not {kind}")
            secret = read_secret(env=token_env, path=token_file, what="--token-env or --token-file")
        user = get_user(owner)
        try:
            connection, test = connections.create_connection(
                name=name, owner=user, kind=kind, secret=secret, app_id=app_id, api_url=api_url)
        except ValidationError as exc:
            raise CommandError(validation_text(exc)) from None
        except IntegrityError:
            raise CommandError(f"connection {name!r} already exists") from None
        self.emit(
            options, {"name": connection.name, "kind": connection.kind,
                      "api_url": connection.api_url, "ok": test.ok, "identity": test.identity,
                      "error": test.error},
            f"connection {connection.name} ({connection.kind}, {connection.api_url})\n"
            + (f"  tested: writes back as {test.identity}" if test.ok else "  saved"))
        if not test.ok:
            # Exits 1 as test_connection does, so a script notices; the connection is kept.
            self.stderr.write(
                f"connection {connection.name} was saved, but the test failed: {test.error}\n"
                f"fix it at the source, then test it again: manage.py test_connection "
                f"{connection.name}")
            sys.exit(1)
