from django.core.management.base import CommandError

from ingest import transitions
from ingest.models import OperatorToken
from switchboard.commands import JsonCommand, get_user

MAX_NAME_CHARS = OperatorToken._meta.get_field("name").max_length


class Command(JsonCommand):
    help = ("Mint a personal API token for an operator (for POST /api/v1/endpoints/<slug>/todos "
            "with Authorization: Bearer <token>). Shown only now; stored hashed.")

    def add_arguments(self, parser):
        parser.add_argument("user", help="username of the operator")
        parser.add_argument("--name", default="",
                            help=f"a label to tell tokens apart (at most {MAX_NAME_CHARS} characters)")

    def handle(self, *args, user, name, **options):
        if len(name) > MAX_NAME_CHARS:
            raise CommandError(f"--name must be at most {MAX_NAME_CHARS} characters")
        operator = get_user(user)
        if not operator.is_active:
            # Tokens of inactive users are refused at use; minting one would only mislead.
            raise CommandError(f"user {user!r} is inactive; its tokens would not work")
        _, token = transitions.mint_operator_token(user=operator, name=name)
        self.emit(options, {"user": operator.get_username(), "token": token},
                  f"API token for {operator.get_username()}: {token}\n(shown only now)")
