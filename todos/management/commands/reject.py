from todos.management.todo_verbs import TodoVerbCommand


class Command(TodoVerbCommand):
    help = "Reject todos awaiting approval: each is cancelled, with the reason in its event."
    verb, done_key, takes_reason = "reject", "rejected", True
