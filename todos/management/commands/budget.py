"""``manage.py budget SLUG [--usd N|none] [--tokens N|none] [--max-cost-usd N|none]``: an
endpoint's daily budgets and its per-todo cost limit (docs/reference.md#usage-and-budgets)."""

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError
from django.utils import timezone

from endpoints.management.commands.pause import COMMAND_ACTOR, get_endpoint
from switchboard.commands import JsonCommand, validation_text
from todos import usage


def _unset_or(text: str, field: str, parse):
    """``none`` (no budget) or the number; anything else is the operator's typo, named."""
    if text.lower() == "none":
        return None
    try:
        return parse(text)
    except ValueError:
        raise CommandError(f"{field}: a number or 'none', got {text!r}") from None


class Command(JsonCommand):
    help = ("Set an endpoint's daily budgets (UTC days): at or over one, claim_next answers "
            "over_budget and doorbells hold until the next day or a raise (which sends one "
            "digest); leases already held go on. --usd and --tokens set them ('none' removes "
            "one), --max-cost-usd the per-todo cost past which a failing todo is dead-lettered; "
            'none given prints them. Prints {"endpoint", "budget_usd_per_day", '
            '"budget_tokens_per_day", "spent_usd_today", "spent_tokens_today", "max_cost_usd", '
            '"over_budget"} with --json.')

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--usd", help="N or none: budget_usd_per_day (0-1000000)")
        parser.add_argument("--tokens", help="N or none: budget_tokens_per_day (0-10^12)")
        parser.add_argument("--max-cost-usd", help="N or none: max_cost_usd per todo (0-10000)")

    def handle(self, *args, slug, usd, tokens, max_cost_usd, **options):
        endpoint = get_endpoint(slug)
        changes = {}
        if usd is not None:
            changes["budget_usd_per_day"] = _unset_or(usd, "budget_usd_per_day", str)
        if tokens is not None:
            changes["budget_tokens_per_day"] = _unset_or(tokens, "budget_tokens_per_day", int)
        if max_cost_usd is not None:
            changes["max_cost_usd"] = _unset_or(max_cost_usd, "max_cost_usd", str)
        now = timezone.now()
        try:
            report = (usage.set_endpoint_budget(endpoint, actor=COMMAND_ACTOR, now=now, **changes)
                      if changes else usage.budget_report(endpoint, now))
        except ValidationError as error:
            raise CommandError(validation_text(error)) from None

        def shown(value, unit):
            return "none" if value is None else f"{value}{unit}"

        self.emit(options, report,
                  f"{endpoint.slug}: today {report['spent_usd_today']} USD of "
                  f"{shown(report['budget_usd_per_day'], ' USD')}, {report['spent_tokens_today']} "
                  f"tokens of {shown(report['budget_tokens_per_day'], '')}; max per todo "
                  f"{shown(report['max_cost_usd'], ' USD')}"
                  + ("; OVER BUDGET" if report["over_budget"] else ""))
