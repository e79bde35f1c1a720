from todos.management.todo_verbs import TodoVerbCommand


class Command(TodoVerbCommand):
    help = ("Approve todos awaiting approval: each becomes pending and is rung like a new todo, "
            "keeping its trust (manage.py promote raises unverified to operator).")
    verb, done_key = "approve", "approved"
