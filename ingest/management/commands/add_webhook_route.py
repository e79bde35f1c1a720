from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.core.management.base import CommandError

from endpoints.models import Endpoint
from ingest import threads, transitions
from ingest.models import FollowUps, Webhook
from ingest.senders import github
from todos.models import WriteBack as WriteBackLevel
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
        parser.add_argument("--priority", type=int, default=0,
                            help="priority of the todos it creates, -100..100 (higher is claimed "
                                 "first); default 0")
        parser.add_argument("--delay-seconds", type=int, default=0,
                            help="its todos become ready this many seconds after they arrive "
                                 "(0..2592000, 30 days); default 0: at once")
        parser.add_argument("--actors", help="comma-separated logins whose events may create todos "
                                             "here (GitHub/Gitea sender.login, GitLab "
                                             "user.username, Slack user ids; a Slack bot's id "
                                             "lets its messages in)")
        parser.add_argument("--author-association",
                            help="comma-separated roles whose events may create todos here, "
                                 "e.g. OWNER,MEMBER,COLLABORATOR (GitHub's author_association; "
                                 "Gitea: admin counts as OWNER, push as COLLABORATOR)")
        parser.add_argument("--requires-approval", action="store_true",
                            help="create this route's todos awaiting an operator's approval "
                                 "(manage.py approve|reject, the board, the API)")
        parser.add_argument("--write-back", choices=WriteBackLevel.values,
                            default=WriteBackLevel.STATUS,
                            help="what the source hears of this route's todos when the webhook "
                                 "has a connection: off, ack (a reaction) or status (the "
                                 "reaction and one living status comment; the default)")
        parser.add_argument("--follow-ups", choices=FollowUps.values,
                            help="a delivery on a thread whose todo is still live: coalesce "
                                 "(a follow-up of that todo), new (a todo of its own) or skip "
                                 "(dropped); default coalesce for a source with threads, new "
                                 "for the others")
        parser.add_argument("--thread-key", default="",
                            help="the thread key from payload fields, e.g. "
                                 "'{repository.full_name}#{issue.number}'; default: the "
                                 "sender's own")
        parser.add_argument("--stop-kinds",
                            help="comma-separated kinds that also end a thread (as --kinds "
                                 "matches), besides the sender's own (an issue closed …)")
        parser.add_argument("--no-stop", action="store_true",
                            help="no delivery ends a thread on this route")

        parser.add_argument("--agent-permissions",
                            help="a repository token for the agent holding one of this route's "
                                 "todos (GitHub App connections only): comma-separated "
                                 "permission:level, e.g. contents:write,pull_requests:write "
                                 "(GitHub's App permission names; levels read, write, admin "
                                 "where GitHub has it); default: none, repo_token is refused")

    def handle(self, *args, webhook, endpoint, queue, kinds, priority, delay_seconds, actors,
               author_association, requires_approval, write_back, follow_ups, thread_key,
               stop_kinds, no_stop, agent_permissions=None, **options):
        try:
            hook = Webhook.objects.get(slug=webhook)
        except Webhook.DoesNotExist:
            raise CommandError(f"no webhook {webhook!r}") from None
        try:
            target = Endpoint.objects.get(slug=endpoint)
        except Endpoint.DoesNotExist:
            raise CommandError(f"no endpoint {endpoint!r}") from None
        for flag, value in (("--actors", actors), ("--author-association", author_association)):
            # Given but empty ('' from an unset shell variable, say) must not mean "anyone".
            if value is not None and not csv_list(value):
                raise CommandError(f"{flag} is empty: name at least one, or leave the flag out "
                                   "for a route that takes every sender")
        try:
            permissions = github.parse_agent_permissions(agent_permissions or "")
        except ValueError as bad:
            raise CommandError(f"--agent-permissions: {bad}") from None
        if agent_permissions is not None and not permissions:
            raise CommandError("--agent-permissions is empty: name at least one permission, "
                               "or leave the flag out")
        try:
            route = transitions.add_webhook_route(
                webhook=hook, endpoint=target, queue=queue,
                kinds=csv_list(kinds) if kinds else None,
                priority=priority, delay_seconds=delay_seconds,
                actors_allowed=csv_list(actors) if actors else None,
                author_associations=csv_list(author_association) if author_association else None,
                requires_approval=requires_approval, write_back=write_back,
                agent_permissions=permissions,
                follow_ups=follow_ups or "", thread_key=thread_key,
                stop_kinds=csv_list(stop_kinds) if stop_kinds else None, stop=not no_stop)
        except ValidationError as exc:
            raise CommandError("; ".join(_field_messages(exc))) from None
        self.emit(
            options, {"webhook": hook.slug, "endpoint": target.slug, "queue": route.queue,
                      "priority": route.priority, "delay_seconds": route.delay_seconds,
                      "requires_approval": route.requires_approval,
                      "write_back": route.write_back,
                      "agent_permissions": route.agent_permissions,
                      "follow_ups": threads.follow_up_policy(route, hook.source),
                      "thread_key": route.thread_key,
                      "stop": threads.stop_kinds(route, hook.source)},
            f"route {hook.slug} -> {target.slug}/{route.queue}"
            + (f" (kinds: {', '.join(route.kinds)})" if route.kinds else " (all kinds)")
            + (f", priority {route.priority}" if route.priority else "")
            + (f", ready {route.delay_seconds} s after arrival" if route.delay_seconds else "")
            + (f", only from {', '.join(route.actors + route.author_associations)}"
               if route.actors or route.author_associations else "")
            + (" (each todo awaits approval)" if route.requires_approval else "")
            + ("" if route.write_back == WriteBackLevel.STATUS
               else f", write-back {route.write_back}")
            + (", agents get a repository token: " + ",".join(
                f"{name}:{level}" for name, level in route.agent_permissions.items())
               if route.agent_permissions else "")
            + f", follow-ups {threads.follow_up_policy(route, hook.source)}"
            + (f", thread key {route.thread_key}" if route.thread_key else "")
            + ("" if route.stop else ", never stopped by its source"),
        )


def _field_messages(exc: ValidationError) -> list:
    """Each message prefixed with the flag it is about (``--priority: …``), so a bad flag is
    named, not only described."""
    if not hasattr(exc, "error_dict"):
        return exc.messages
    return [(f"--{FLAG_OF_FIELD.get(field, field.replace('_', '-'))}: " if field != NON_FIELD_ERRORS
             else "") + message
            for field, errors in exc.error_dict.items()
            for error in errors for message in error.messages]


# Route fields whose flag is not simply the field name with hyphens.
FLAG_OF_FIELD = {"author_associations": "author-association"}
