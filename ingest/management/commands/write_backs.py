from django.core.management.base import CommandError

from ingest import queries
from ingest.models import Webhook, WriteBack, WriteBackState
from switchboard.commands import JsonCommand

DEFAULT_LIMIT = 50
MAX_LIMIT = 1000


class Command(JsonCommand):
    help = ("Print the latest write-backs (what switchboard wrote, or is to write, back to the "
            "sources: ack, status, check), newest first: of one todo, of one webhook's todos, "
            "or all; when a pending one goes next, and a connection held by a rate limit.")

    def add_arguments(self, parser):
        parser.add_argument("--todo", help="only this todo's (its id)")
        parser.add_argument("--webhook", help="only those of this webhook's todos (its slug)")
        parser.add_argument("--state", choices=[*WriteBackState.values, WriteBack.RETRYING],
                            help="only this state (retrying: pending or sending after a "
                                 "failed send)")
        parser.add_argument("--limit", type=int, default=DEFAULT_LIMIT,
                            help=f"at most this many (1-{MAX_LIMIT}, default {DEFAULT_LIMIT})")

    def handle(self, *args, todo, webhook, state, limit, **options):
        if not 1 <= limit <= MAX_LIMIT:
            raise CommandError(f"--limit must be between 1 and {MAX_LIMIT}")
        if todo is not None and not (todo.isascii() and todo.isdigit() and len(todo) < 20):
            raise CommandError(f"--todo: not a todo id: {todo[:40]!r}")
        hook = None
        if webhook is not None:
            hook = Webhook.objects.filter(slug=webhook).first()
            if hook is None:
                raise CommandError(f"no webhook {webhook!r}")
        rows = [queries.write_back_as_dict(row) for row in queries.latest_write_backs(
            todo_id=int(todo) if todo else None, webhook=hook, state=state, limit=limit)]
        human = "\n".join(
            f"#{r['id']} todo {r['todo']} {r['action']:<6} "
            f"{WriteBack.RETRYING if r['retrying'] else r['state']:<9} {r['target']} "
            f"attempts={r['attempts']}"
            + (f" next={r['next_attempt_at']}" if r["next_attempt_at"] else "")
            + (f" held until {r['held_until']} (the source's rate limit)"
               if r["held_until"] else "")
            + (f" error: {r['last_error']}" if r["last_error"] else "")
            for r in rows) or "no write-backs"
        self.emit(options, {"write_backs": rows}, human)
