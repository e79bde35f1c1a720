from django.core.management.base import CommandError

from endpoints.models import Endpoint
from switchboard.commands import JsonCommand
from todos import queries, transitions
from todos.models import State, Todo

MAX_TODO_ID = 2**63 - 1


class Command(JsonCommand):
    help = ("Return failed todos (waiting or dead-lettered) to pending with a fresh attempt "
            "budget: by id, or every dead letter of an endpoint (and queue). Prints what was "
            "requeued; any todo that could not be is named on stderr and the exit code is 1.")

    def add_arguments(self, parser):
        parser.add_argument("ids", nargs="*", help="todo ids")
        parser.add_argument("--dead-letters", action="store_true",
                            help="requeue every dead letter of --endpoint (and --queue)")
        parser.add_argument("--endpoint", help="endpoint slug (with --dead-letters)")
        parser.add_argument("--queue", help="queue name (with --dead-letters)")
        parser.add_argument("--dry-run", action="store_true", help="list what would be requeued")

    def handle(self, *args, ids, dead_letters, endpoint, queue, dry_run, **options):
        todos = self._select(ids, dead_letters, endpoint, queue)
        requeued, refused = [], []
        for todo in todos:
            caller = transitions.Caller.operator(todo.endpoint, "manage.py requeue")
            try:
                if dry_run:
                    self._check_requeueable(todo)
                else:
                    transitions.requeue_todo(caller, todo.pk)
                requeued.append(str(todo.pk))
            except transitions.Refusal as refusal:
                refused.append(f"{todo.pk}: {refusal.message}")
        if refused and not requeued:
            raise CommandError("nothing requeued:\n  " + "\n  ".join(refused))
        verb = "would requeue" if dry_run else "requeued"
        key = "would_requeue" if dry_run else "requeued"  # a dry run says what it would do
        self.emit(options, {key: requeued}, f"{verb} {len(requeued)}: {' '.join(requeued)}")
        if refused:  # some were requeued (printed above); the rest are errors
            raise CommandError("not requeued:\n  " + "\n  ".join(refused))

    def _select(self, ids, dead_letters, endpoint, queue):
        if bool(ids) == bool(dead_letters):
            raise CommandError("give todo ids, or --dead-letters --endpoint SLUG [--queue NAME]")
        if dead_letters:
            if not endpoint:
                raise CommandError("--dead-letters needs --endpoint SLUG")
            try:
                target = Endpoint.objects.get(slug=endpoint)
            except Endpoint.DoesNotExist:
                raise CommandError(f"no endpoint {endpoint!r}") from None
            return list(queries.dead_letters(endpoint=target, queue=queue).select_related("endpoint"))
        if endpoint or queue:
            raise CommandError("--endpoint/--queue go with --dead-letters")
        bad = [i for i in ids if not (i.isascii() and i.isdigit() and 0 < int(i) <= MAX_TODO_ID)]
        if bad:
            raise CommandError(f"not todo ids: {bad}")
        found = {str(t.pk): t for t in Todo.objects.filter(pk__in=ids).select_related("endpoint")}
        missing = [i for i in ids if str(int(i)) not in found]
        if missing:
            raise CommandError(f"no such todos: {missing}")
        return [found[str(int(i))] for i in ids]

    @staticmethod
    def _check_requeueable(todo):
        """What requeue_todo would refuse, without writing (the dry run)."""
        if todo.state != State.FAILED:
            raise transitions.Refusal("not_claimable", f"todo {todo.pk} is {todo.state}, not failed")
        if todo.idempotency_key and queries.live_todo_holding_key(todo.endpoint, todo.idempotency_key):
            raise transitions.Refusal(
                "conflict", f"todo {todo.pk}'s idempotency key is held by a newer live todo")
