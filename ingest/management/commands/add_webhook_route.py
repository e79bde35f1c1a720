from django.core.exceptions import ValidationError
from django.core.management.base import CommandError

from endpoints.models import Endpoint
from ingest import transitions
from ingest.models import Webhook
from switchboard.commands import JsonCommand, csv_list


class Command(JsonCommand):
    help = ("Route a webhook's deliveries to an endpoint's queue (one todo per route per "
            "delivery), optionally only for some event kinds, and only from trusted actors "
            "(--actors logins and/or --author-association roles; a delivery from anyone else "
            "creates nothing on the route and is logged 'filtered').")

    def add_arguments(self, parser):
        parser.add_argument("webhook", help="webhook slug")
        parser.add_argument("endpoint", help="endpoint slug")
        parser.add_argument("--queue", required=True, help="queue name on the endpoint")
        parser.add_argument("--kinds", help="comma-separated kinds, e.g. issues,pull_request.opened "
                                            "(an event name also matches its actions); default: all")
        parser.add_argument("--actors", help="comma-separated logins whose events may create todos "
                                             "here (GitHub/Gitea sender.login, GitLab user.username)")
        parser.add_argument("--author-association",
                            help="comma-separated roles whose events may create todos here, "
                                 "e.g. OWNER,MEMBER,COLLABORATOR (GitHub's author_association; "
                                 "Gitea: admin counts as OWNER, push as COLLABORATOR)")
        parser.add_argument("--requires-approval", action="store_true",
                            help="create this route's todos awaiting an operator's approval "
                                 "(manage.py approve|reject, the board, the API)")

    def handle(self, *args, webhook, endpoint, queue, kinds, actors, author_association,
               requires_approval, **options):
        try:
            hook = Webhook.objects.get(slug=webhook)
        except Webhook.DoesNotExist:
            raise CommandError(f"no webhook {webhook!r}") from None
        try:
            target = Endpoint.objects.get(slug=endpoint)
        except Endpoint.DoesNotExist:
            raise CommandError(f"no endpoint {endpoint!r}") from None
        try:
            route = transitions.add_webhook_route(
                webhook=hook, endpoint=target, queue=queue,
                kinds=csv_list(kinds) if kinds else None,
                actors_allowed=csv_list(actors) if actors else None,
                author_associations=csv_list(author_association) if author_association else None,
                requires_approval=requires_approval)
        except ValidationError as exc:
            raise CommandError("; ".join(
                f"{field}: {' '.join(messages)}" for field, messages in exc.message_dict.items())
                if hasattr(exc, "error_dict") else "; ".join(exc.messages)) from None
        self.emit(
            options, {"webhook": hook.slug, "endpoint": target.slug, "queue": route.queue,
                      "requires_approval": route.requires_approval},
            f"route {hook.slug} -> {target.slug}/{route.queue}"
            + (f" (kinds: {', '.join(route.kinds)})" if route.kinds else " (all kinds)")
            + (f", only from {', '.join(route.actors + route.author_associations)}"
               if route.actors or route.author_associations else "")
            + (" (each todo awaits approval)" if route.requires_approval else ""),
        )
