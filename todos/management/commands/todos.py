from django.core.management.base import CommandError

from endpoints.models import Endpoint
from switchboard.commands import JsonCommand
from switchboard.harness_text import sanitize_content
from todos import queries
from todos.models import THREAD_MAX_CHARS, State

DEFAULT_LIMIT = 50
MAX_LIMIT = 1000


class Command(JsonCommand):
    help = ("Print the latest todos, newest first, in the todo JSON of docs/reference.md#todos "
            "(follow-ups as a count: followup_count): of every endpoint, or of one endpoint, "
            "queue, state or thread.")

    def add_arguments(self, parser):
        parser.add_argument("--endpoint", help="only this endpoint's (its slug)")
        parser.add_argument("--queue", help="only this queue's")
        parser.add_argument("--state", choices=State.values, help="only this state")
        parser.add_argument("--thread", help="only this thread's (e.g. owner/repo#12)")
        parser.add_argument("--limit", type=int, default=DEFAULT_LIMIT,
                            help=f"at most this many (1-{MAX_LIMIT}, default {DEFAULT_LIMIT})")

    def handle(self, *args, endpoint, queue, state, thread, limit, **options):
        if not 1 <= limit <= MAX_LIMIT:
            raise CommandError(f"--limit must be between 1 and {MAX_LIMIT}")
        if thread is not None and len(thread) > THREAD_MAX_CHARS:
            raise CommandError(f"--thread must be at most {THREAD_MAX_CHARS} characters")
        owner = None
        if endpoint is not None:
            owner = Endpoint.objects.filter(slug=endpoint).first()
            if owner is None:
                raise CommandError(f"no endpoint {endpoint!r}")
        rows = [queries.todo_as_dict(todo) for todo in queries.operator_todos(
            endpoint=owner, queue=queue, state=state, thread=thread, limit=limit)]
        # A todo's title and thread are its sender's text: one line each, no control characters.
        human = "\n".join(
            f"#{r['id']} {r['endpoint']}/{r['queue']} {r['state']}"
            + (" cancel_requested" if r["cancel_requested"] else "")
            + (f" thread={sanitize_content(r['thread'])}" if r["thread"] else "")
            + (f" followups={r['followup_count']}" if r["followup_count"] else "")
            + f" {sanitize_content(r['title'])}"
            for r in rows) or "no todos"
        self.emit(options, {"todos": rows}, human)
