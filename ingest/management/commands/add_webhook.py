from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.management.base import CommandError
from django.db import IntegrityError

from ingest import queries, sender_setup, senders, transitions
from ingest.models import Source
from switchboard.commands import JsonCommand, get_user, validation_text


class Command(JsonCommand):
    help = ("Create a webhook and print its URL and secret (a minted secret is shown only now; "
            "or pass --secret to use the one the sender already has).")

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--owner", required=True, help="username of the operator who owns it")
        parser.add_argument("--source", required=True, choices=Source.values)
        parser.add_argument("--secret", help="use this secret instead of minting one")
        parser.add_argument("--connection", help="write back under this connection "
                                                 "(add_connection; one of the source's)")

    def handle(self, *args, slug, owner, source, secret, connection=None, **options):
        if source in sender_setup.SENDER_MINTED and not secret:
            # These senders mint the signing secret and accept none of ours.
            sender = senders.get_sender(source)
            raise CommandError(
                f"--source {source} needs --secret: {source} mints the signing secret itself "
                f"and will not take one from switchboard. Copy it from {source} and pass it: "
                f"add_webhook {slug} --owner {owner} --source {source} "
                f"--secret '{sender.secret_example}'"
                + (f" (locally, `{sender.local_forwarder} URL` prints one)"
                   if sender.local_forwarder else ""))
        user = get_user(owner)
        chosen = None
        if connection:
            chosen = queries.find_connection(connection)
            if chosen is None:
                raise CommandError(f"no connection {connection!r}")
        try:
            webhook, secret = transitions.create_webhook(slug=slug, owner=user, source=source,
                                                         secret=secret, connection=chosen)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        except ValidationError as exc:
            raise CommandError(validation_text(exc)) from None
        except IntegrityError:
            raise CommandError(f"webhook {slug!r} already exists") from None
        hook_url = f"{settings.SWITCHBOARD_PUBLIC_URL}/hooks/{webhook.slug}"
        self.emit(
            options, {"slug": webhook.slug, "hook_url": hook_url, "secret": secret,
                      "connection": chosen.name if chosen else None},
            f"webhook {webhook.slug} ({source})\n  URL:    {hook_url}\n"
            + (f"  writes back as connection {chosen.name}\n" if chosen else "")
            + (("  secret: the one you pasted from the sender (installed; never shown here)"
                if source in sender_setup.SENDER_MINTED
                else f"  secret: {secret}\n  (configure it at the sender; it is not shown again)")
               if secret else "  " + transitions.unsigned_warning()),
        )
        if not secret and options.get("json"):
            self.stderr.write(transitions.unsigned_warning())  # stdout holds only the JSON object
