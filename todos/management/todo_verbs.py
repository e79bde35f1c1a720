"""The shape ``manage.py cancel``, ``approve``, ``promote`` and ``reject`` share: todo ids in, one
transition per id as the todo's operator, ``{"<done>": [ids], "skipped": [{"id", "code"}]}``
out (docs/commands.md). Ids that are not todo ids at all stop the command before anything is
written; a todo that cannot take the verb (not found, wrong state) is skipped with its refusal
code, printed with the rest, and makes the exit code 1."""

from django.core.management.base import CommandError

from switchboard.commands import JsonCommand
from todos import transitions
from todos.models import Todo

MAX_TODO_ID = 2**63 - 1


class TodoVerbCommand(JsonCommand):
    verb = ""        # the transition: transitions.<verb>_todo
    done_key = ""    # "cancelled", "approved", "promoted", "rejected"
    takes_reason = False

    def add_arguments(self, parser):
        parser.add_argument("ids", nargs="+", help="todo ids")
        if self.takes_reason:
            parser.add_argument("--reason", help="why (kept in the todo's event)")

    def handle(self, *args, ids, **options):
        bad = [i for i in ids if not (i.isascii() and i.isdigit() and 0 < int(i) <= MAX_TODO_ID)]
        if bad:
            raise CommandError(f"not todo ids: {bad}")
        found = {t.pk: t for t in Todo.objects.filter(pk__in=ids).select_related("endpoint")}
        transition = getattr(transitions, f"{self.verb}_todo")
        reason = {"reason": options.get("reason")} if self.takes_reason else {}
        done, skipped = [], []
        for todo_id in dict.fromkeys(int(i) for i in ids):  # once each, in the order given
            todo = found.get(todo_id)
            try:
                if todo is None:
                    raise transitions.Refusal("not_found", f"no todo {todo_id}")
                caller = transitions.Caller.operator(todo.endpoint, f"manage.py {self.verb}")
                transition(caller, todo_id, **reason)
            except transitions.Refusal as refusal:
                skipped.append({"id": str(todo_id), "code": refusal.code,
                                "message": refusal.message})
            else:
                done.append(str(todo_id))
        # Nothing taken: the error below says it all ("cancelled 0:" above it said nothing).
        human = f"{self.done_key} {len(done)}: {' '.join(done)}" if done else None
        self.emit(options, {self.done_key: done,
                            "skipped": [{"id": s["id"], "code": s["code"]} for s in skipped]},
                  human)
        if skipped:
            raise CommandError(f"not {self.done_key}:\n  "
                               + "\n  ".join(f"{s['id']}: {s['message']} ({s['code']})"
                                             for s in skipped))
