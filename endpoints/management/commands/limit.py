"""``manage.py limit SLUG [--queue Q] N|none`` and ``manage.py limit SLUG [--max-claimed N|none]
[--queue Q=N|none …]``: an endpoint's caps on claimed todos (docs/work-control.md#caps)."""

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError

from endpoints import transitions
from endpoints.management.commands.pause import COMMAND_ACTOR, get_endpoint
from endpoints.models import MAX_CLAIM_CAP
from switchboard.commands import JsonCommand, validation_text


def _cap(text: str, field: str):
    """``N`` or ``none`` (unlimited); anything else is the operator's typo, named."""
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise CommandError(f"{field}: a whole number from 0 to {MAX_CLAIM_CAP} or 'none', "
                           f"got {text[:40]!r}") from None


class Command(JsonCommand):
    help = ("Cap how many of an endpoint's todos may be claimed at once (claim_next answers "
            "at_capacity at the cap; claims already held go on). 'limit SLUG 3' caps the "
            "endpoint, 'limit SLUG --queue deploys 1' one queue; or --max-claimed N and "
            "--queue Q=N (repeatable); 'none' removes a cap; no cap given prints them. Prints "
            '{"endpoint", "max_claimed", "queue_limits": {queue: n}} with --json.')

    def create_parser(self, prog_name, subcommand, **kwargs):
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        # 'limit SLUG --queue Q N': the cap comes after an option, which plain parse_args
        # would refuse (it fills positionals only from the first run of them).
        parser.parse_args = parser.parse_intermixed_args
        return parser

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("cap", nargs="?", metavar="N", help="N or none: the endpoint's cap, or with one "
                                                   "--queue Q that queue's")
        parser.add_argument("--max-claimed", help="N or none: the endpoint's cap")
        parser.add_argument("--queue", action="append", default=[],
                            help="Q (with the positional N) or Q=N|none; repeatable")

    def handle(self, *args, slug, cap, max_claimed, queue, **options):
        endpoint = get_endpoint(slug)
        changes, queue_limits = {}, {}
        named = [q for q in queue if "=" not in q]
        for pair in (q for q in queue if "=" in q):
            name, _, value = pair.partition("=")
            queue_limits[name] = _cap(value, f"queue_limits[{name}]")
        if len(named) > 1 or (named and cap is None):
            raise CommandError("--queue Q (without =N) takes exactly one queue and the cap as "
                               "the positional N; or write --queue Q=N")
        if cap is not None:
            if named:
                queue_limits[named[0]] = _cap(cap, f"queue_limits[{named[0]}]")
            elif max_claimed is not None:
                raise CommandError("max_claimed: give it once (positional N or --max-claimed)")
            else:
                max_claimed = cap
        if max_claimed is not None:
            changes["max_claimed"] = _cap(max_claimed, "max_claimed")
        if changes or queue_limits:
            try:
                transitions.set_claim_caps(endpoint, queue_limits=queue_limits,
                                           actor=COMMAND_ACTOR, **changes)
            except ValidationError as error:
                raise CommandError(validation_text(error)) from None
        limits = endpoint.queue_limits or {}
        self.emit(options, {"endpoint": endpoint.slug, "max_claimed": endpoint.max_claimed,
                            "queue_limits": limits},
                  f"{endpoint.slug}: max_claimed "
                  f"{'unlimited' if endpoint.max_claimed is None else endpoint.max_claimed}"
                  + "".join(f", {name} {n}" for name, n in limits.items()))
