from todos.management.todo_verbs import TodoVerbCommand


class Command(TodoVerbCommand):
    help = ("Promote unverified todos (pending or awaiting approval) to trust operator: the "
            "operator vouches for the sender. Approving is separate and keeps trust.")
    verb, done_key = "promote", "promoted"
