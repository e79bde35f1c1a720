from django.core.management.base import CommandError

from endpoints.models import Endpoint
from switchboard.commands import JsonCommand
from todos import queries, transitions
from todos.models import Todo


class Command(JsonCommand):
    help = ("Return failed todos (waiting or dead-lettered) to pending with a fresh attempt "
            "budget: by id, or every dead letter of an endpoint (and queue).")

    def add_arguments(self, parser):
        parser.add_argument("ids", nargs="*", help="todo ids")
        parser.add_argument("--dead-letters", action="store_true",
                            help="requeue every dead letter of --endpoint (and --queue)")
        parser.add_argument("--endpoint", help="endpoint slug (with --dead-letters)")
        parser.add_argument("--queue", help="queue name (with --dead-letters)")
        parser.add_argument("--dry-run", action="store_true", help="list what would be requeued")

    def handle(self, *args, ids, dead_letters, endpoint, queue, dry_run, **options):
        if bool(ids) == bool(dead_letters):
            raise CommandError("give todo ids, or --dead-letters --endpoint SLUG [--queue NAME]")
        if dead_letters:
            if not endpoint:
                raise CommandError("--dead-letters needs --endpoint SLUG")
            try:
                target = Endpoint.objects.get(slug=endpoint)
            except Endpoint.DoesNotExist:
                raise CommandError(f"no endpoint {endpoint!r}") from None
            todos = list(queries.dead_letters(endpoint=target, queue=queue).select_related("endpoint"))
        else:
            if endpoint or queue:
                raise CommandError("--endpoint/--queue go with --dead-letters")
            bad = [i for i in ids if not i.isdigit()]
            if bad:
                raise CommandError(f"not todo ids: {bad}")
            found = {str(t.pk): t for t in Todo.objects.filter(pk__in=ids).select_related("endpoint")}
            missing = [i for i in ids if i not in found]
            if missing:
                raise CommandError(f"no such todos: {missing}")
            todos = [found[i] for i in ids]
        requeued, refused = [], []
        for todo in todos:
            if dry_run:
                if todo.state == "failed":
                    requeued.append(str(todo.pk))
                else:
                    refused.append(f"{todo.pk}: is {todo.state}, not failed")
                continue
            caller = transitions.Caller.operator(todo.endpoint, "manage.py requeue")
            try:
                requeued.append(str(transitions.requeue_todo(caller, todo.pk).pk))
            except transitions.Refusal as refusal:
                refused.append(f"{todo.pk}: {refusal.message}")
        for line in refused:
            self.stderr.write(line)
        verb = "would requeue" if dry_run else "requeued"
        self.emit(options, {"requeued": requeued}, f"{verb} {len(requeued)}: {' '.join(requeued)}")
        if refused and not requeued:
            raise CommandError("nothing requeued")
