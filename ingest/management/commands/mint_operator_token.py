from ingest import transitions
from switchboard.commands import JsonCommand, get_user


class Command(JsonCommand):
    help = ("Mint a personal API token for an operator (for POST /api/v1/endpoints/<slug>/todos "
            "with Authorization: Bearer <token>). Shown only now; stored hashed.")

    def add_arguments(self, parser):
        parser.add_argument("user", help="username of the operator")
        parser.add_argument("--name", default="", help="a label to tell tokens apart")

    def handle(self, *args, user, name, **options):
        operator = get_user(user)
        row, token = transitions.mint_operator_token(user=operator, name=name)
        self.emit(options, {"user": operator.get_username(), "token": token},
                  f"API token for {operator.get_username()}: {token}\n(shown only now)")
