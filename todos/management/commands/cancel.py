from todos.management.todo_verbs import TodoVerbCommand


class Command(TodoVerbCommand):
    help = ("Cancel todos (awaiting approval, pending, failed, or claimed: an override of the "
            "agent's lease, whose next call is lease_lost). Cancelled is terminal; the todo's "
            "secrets are deleted and its idempotency key is free again.")
    verb, done_key, takes_reason = "cancel", "cancelled", True
