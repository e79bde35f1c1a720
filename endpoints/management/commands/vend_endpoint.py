from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.management.base import CommandError
from django.db import IntegrityError

from endpoints import connect_snippets, transitions
from endpoints.models import ALL_QUEUES
from switchboard.commands import JsonCommand, csv_list, get_user, validation_text


class Command(JsonCommand):
    help = "Vend an endpoint to an agent and print its MCP URL and credential (shown once)."

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--owner", required=True, help="username of the operator who owns it")
        parser.add_argument("--queues", default=ALL_QUEUES,
                            help="comma-separated queue names, or '*' for all (default)")
        parser.add_argument("--verbs", help="comma-separated verb allowlist (default: all)")
        parser.add_argument("--lease-seconds", type=int, help="default lease (server default if unset)")
        parser.add_argument("--max-attempts", type=int, default=5)
        parser.add_argument("--max-claimed", type=int,
                            help="at most this many todos claimed at once (default: unlimited)")
        parser.add_argument("--no-unverified", dest="accept_unverified", action="store_false",
                            help="never hand unverified todos (from unsigned webhooks) to the "
                                 "agent; they wait on the board until an operator promotes one")

    def handle(self, *args, **options):
        owner = get_user(options["owner"])
        queues = csv_list(options["queues"])
        if ALL_QUEUES in queues:
            queues = [ALL_QUEUES]
        try:
            endpoint, credential = transitions.vend_endpoint(
                slug=options["slug"], owner=owner, scope=queues,
                verbs=csv_list(options["verbs"]) if options["verbs"] is not None else None,
                default_lease_seconds=options["lease_seconds"],
                max_attempts=options["max_attempts"],
                accept_unverified=options["accept_unverified"],
                max_claimed=options["max_claimed"],
            )
        except ValidationError as exc:
            raise CommandError(validation_text(exc)) from None
        except IntegrityError:
            raise CommandError(f"endpoint {options['slug']!r} already exists")
        mcp_url = f"{settings.SWITCHBOARD_PUBLIC_URL}/mcp/{endpoint.slug}"
        self.emit(
            options,
            {"slug": endpoint.slug, "mcp_url": mcp_url, "credential": credential,
             "mcp_json": connect_snippets.mcp_json(mcp_url), "max_claimed": endpoint.max_claimed},
            f"endpoint {endpoint.slug}\n  MCP URL:    {mcp_url}\n  credential: {credential}\n"
            "  (the credential is shown only now; store it in your agent's environment)\n\n"
            + connect_snippets.connect_text(mcp_url, credential),
        )
