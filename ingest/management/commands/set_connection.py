from django.core.exceptions import ValidationError
from django.core.management.base import CommandError

from ingest import connections, queries
from ingest.models import Webhook
from switchboard.commands import JsonCommand, validation_text


class Command(JsonCommand):
    help = ("Choose the connection a webhook writes back under (one of its source's and its "
            "owner's), or 'none' to write nothing back.")

    def add_arguments(self, parser):
        parser.add_argument("webhook")
        parser.add_argument("connection", help="a connection's name, or none")

    def handle(self, *args, webhook, connection, **options):
        hook = Webhook.objects.filter(slug=webhook).first()
        if hook is None:
            raise CommandError(f"no webhook {webhook!r}")
        chosen = None
        if connection != "none":
            chosen = queries.find_connection(connection)
            if chosen is None:
                raise CommandError(f"no connection {connection!r}")
        try:
            connections.set_webhook_connection(hook, chosen)
        except ValidationError as exc:
            raise CommandError(validation_text(exc)) from None
        name = chosen.name if chosen else None
        self.emit(options, {"webhook": hook.slug, "connection": name},
                  f"webhook {hook.slug} writes back as {name}" if name
                  else f"webhook {hook.slug} writes nothing back")
