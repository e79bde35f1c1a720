from django.core.exceptions import ValidationError
from django.core.management.base import CommandError

from endpoints.models import Endpoint
from ingest import transitions
from ingest.models import Webhook
from switchboard.commands import JsonCommand, csv_list


class Command(JsonCommand):
    help = ("Route a webhook's deliveries to an endpoint's queue (one todo per route per "
            "delivery), optionally only for some event kinds.")

    def add_arguments(self, parser):
        parser.add_argument("webhook", help="webhook slug")
        parser.add_argument("endpoint", help="endpoint slug")
        parser.add_argument("--queue", required=True, help="queue name on the endpoint")
        parser.add_argument("--kinds", help="comma-separated kinds, e.g. issues,pull_request.opened "
                                            "(an event name also matches its actions); default: all")

    def handle(self, *args, webhook, endpoint, queue, kinds, **options):
        try:
            hook = Webhook.objects.get(slug=webhook)
        except Webhook.DoesNotExist:
            raise CommandError(f"no webhook {webhook!r}") from None
        try:
            target = Endpoint.objects.get(slug=endpoint)
        except Endpoint.DoesNotExist:
            raise CommandError(f"no endpoint {endpoint!r}") from None
        try:
            route = transitions.add_webhook_route(webhook=hook, endpoint=target, queue=queue,
                                                  kinds=csv_list(kinds) if kinds else None)
        except ValidationError as exc:
            raise CommandError("; ".join(exc.messages)) from None
        self.emit(
            options, {"webhook": hook.slug, "endpoint": target.slug, "queue": route.queue},
            f"route {hook.slug} -> {target.slug}/{route.queue}"
            + (f" (kinds: {', '.join(route.kinds)})" if route.kinds else " (all kinds)"),
        )
