from todos.management.todo_verbs import TodoVerbCommand


class Command(TodoVerbCommand):
    help = ("Approve todos awaiting approval: each becomes pending and is rung like a new todo "
            "(an unverified one is promoted to trust operator).")
    verb, done_key = "approve", "approved"
