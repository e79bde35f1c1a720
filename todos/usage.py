"""Usage and budgets (docs/reference.md#usage-and-budgets): what an agent reports spending on
an attempt, the per-todo and per-day sums, and the budget guard every claim carries.

An attempt's usage arrives with ``complete`` or ``fail`` and is written by that transition's
own statement: added to the todo's sums, kept in its event, and added to the endpoint's row of
the day (``DailySpend``, an upsert). The claim statements read that row in their guard, so a
claim never starts on a read taken before it (no read-then-claim race); spend is reported
after the work, so what was in flight when a budget was reached may still pass it.
"""

import json
from datetime import date
from datetime import timezone as dt_timezone
from decimal import ROUND_HALF_UP, Decimal
from types import SimpleNamespace

from django.db.models import OuterRef, Subquery, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from endpoints import transitions as endpoint_transitions
from switchboard import harness_text
from switchboard.db import sql as dialect

from .models import DailySpend

USAGE_KEYS = ("input_tokens", "output_tokens", "cost_usd", "turns", "model")
# Per attempt. Wide enough for the longest agent run, narrow enough that a unit mistake (cost
# in cents, tokens in bytes) is refused instead of spending a day's budget in one report.
MAX_TOKENS_PER_ATTEMPT = 10**9
MAX_COST_USD_PER_ATTEMPT = Decimal("10000")
MAX_TURNS_PER_ATTEMPT = 100_000
MAX_MODEL_CHARS = 100
MICROUSD_PER_USD = 1_000_000


class UsageError(ValueError):
    """A usage report that is refused: the message names the field and its range."""


def _whole(value, name: str, maximum: int) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise UsageError(f"usage.{name}: a whole number from 0 to {maximum}; got {value!r}")
    return value


def to_microusd(value, name: str = "cost_usd", maximum: Decimal = MAX_COST_USD_PER_ATTEMPT) -> int:
    """A dollar amount (number) as whole millionths of a dollar, rounded half up."""
    bad = UsageError(f"usage.{name}: a number of US dollars from 0 to {maximum}; got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float, Decimal)):
        raise bad
    number = Decimal(str(value))
    if not number.is_finite() or not 0 <= number <= maximum:
        raise bad
    return int((number * MICROUSD_PER_USD).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def usd(microusd) -> float:
    """Millionths of a dollar as a JSON number of dollars."""
    return round((microusd or 0) / MICROUSD_PER_USD, 6)


def validate_usage(usage) -> dict | None:
    """The usage object of a complete or fail, checked: ``{"input_tokens", "output_tokens",
    "cost_usd", "turns", "model"}``, each optional (None: nothing reported). Returns it
    normalized (cost as ``cost_microusd``); raises UsageError naming the first bad field."""
    if usage is None:
        return None
    if not isinstance(usage, dict):
        raise UsageError("usage: an object of input_tokens, output_tokens, cost_usd, turns, model")
    unknown = sorted(set(usage) - set(USAGE_KEYS))
    if unknown:
        raise UsageError(f"usage: unknown field {unknown[0]!r} (known: {', '.join(USAGE_KEYS)})")
    report = {"input_tokens": 0, "output_tokens": 0, "cost_microusd": 0, "turns": 0, "model": None}
    for name in ("input_tokens", "output_tokens"):
        if usage.get(name) is not None:
            report[name] = _whole(usage[name], name, MAX_TOKENS_PER_ATTEMPT)
    if usage.get("turns") is not None:
        report["turns"] = _whole(usage["turns"], "turns", MAX_TURNS_PER_ATTEMPT)
    if usage.get("cost_usd") is not None:
        report["cost_microusd"] = to_microusd(usage["cost_usd"])
    model = usage.get("model")
    if model is not None:
        if (not isinstance(model, str) or not 1 <= len(model) <= MAX_MODEL_CHARS
                or harness_text.sanitize_meta_value(model) != model):
            raise UsageError(f"usage.model: a model name of 1-{MAX_MODEL_CHARS} characters of "
                             "A-Z a-z 0-9 _ . : / @ # + -")
        report["model"] = model
    return report


def as_detail(report: dict) -> dict:
    """An attempt's usage as its todo event keeps it (the wire shape)."""
    detail = {"input_tokens": report["input_tokens"], "output_tokens": report["output_tokens"],
              "cost_usd": usd(report["cost_microusd"]), "turns": report["turns"]}
    if report["model"]:
        detail["model"] = report["model"]
    return detail


def todo_usage(todo) -> dict | None:
    """The ``usage`` of the todo JSON: the sums over its attempts' reports (None: none
    reported); ``model`` is the last one named."""
    if not todo.usage_reports:
        return None
    return {"input_tokens": todo.usage_input_tokens, "output_tokens": todo.usage_output_tokens,
            "cost_usd": usd(todo.usage_cost_microusd), "turns": todo.usage_turns,
            "model": todo.usage_model or None}


def spend_day(now) -> date:
    """The UTC day ``now`` falls on: budgets are per UTC day."""
    return now.astimezone(dt_timezone.utc).date()


# -- SQL the transitions run (todos.transitions) ------------------------------------------------


def usage_params(report: dict | None, now) -> dict:
    if report is None:
        return {}
    return {"usage_in": report["input_tokens"], "usage_out": report["output_tokens"],
            "usage_cost": report["cost_microusd"], "usage_turns": report["turns"],
            "usage_model": report["model"], "spend_day": dialect.db_date(spend_day(now)),
            "spend_tokens": report["input_tokens"] + report["output_tokens"]}


def usage_set_sql(report: dict | None) -> str:
    """The SET clauses that add an attempt's report to the todo's sums ("" without one)."""
    if report is None:
        return ""
    return ("usage_reports = usage_reports + 1,"
            " usage_input_tokens = usage_input_tokens + %(usage_in)s,"
            " usage_output_tokens = usage_output_tokens + %(usage_out)s,"
            " usage_cost_microusd = usage_cost_microusd + %(usage_cost)s,"
            " usage_turns = usage_turns + %(usage_turns)s,"
            " usage_model = COALESCE(%(usage_model)s, usage_model)")


def over_max_cost_sql(endpoint, params: dict, *, after: str = "") -> str:
    """SQL true when the todo's cost (``after``: plus this attempt's, in a SET where the
    columns still hold the old row) is past its ``max_cost_usd``, else its endpoint's; NULL
    (not true) when neither has one."""
    params["endpoint_max_cost"] = (None if endpoint.max_cost_usd is None
                                   else to_microusd(endpoint.max_cost_usd, "max_cost_usd"))
    # Rounded, not truncated: SQLite keeps the decimal as a float (0.256229 reads 256228.99…).
    return (f"(usage_cost_microusd{after} > COALESCE("
            f"CAST(ROUND(max_cost_usd * {MICROUSD_PER_USD}) AS BIGINT),"
            f" {dialect.bigint('endpoint_max_cost')}))")


def spend_upsert_sql(report: dict | None, source: str) -> str | None:
    """The statement that adds the attempt's spend to its endpoint's row of the day, over the
    updated todo rows ``source`` (PostgreSQL: the CTE ``t``; SQLite: a select of them with its
    own WHERE, which also keeps the upsert's ON CONFLICT unambiguous). None when nothing was
    spent."""
    if report is None or not (report["cost_microusd"] or report["input_tokens"]
                              or report["output_tokens"]):
        return None
    return (
        "INSERT INTO todos_dailyspend (endpoint_id, day, cost_microusd, tokens)"
        f" SELECT t.endpoint_id, %(spend_day)s, %(usage_cost)s, %(spend_tokens)s FROM {source}"
        " ON CONFLICT (endpoint_id, day) DO UPDATE SET"
        " cost_microusd = todos_dailyspend.cost_microusd + excluded.cost_microusd,"
        " tokens = todos_dailyspend.tokens + excluded.tokens"
    )


def settled_usage_sql(params: dict, todo_guard: str, report: dict, now) -> tuple[str, str]:
    """``(event_sql, todo_sql)``: the late report of an attempt that settled without one.
    ``event_sql`` adds ``report`` to the settle event (``complete``, ``fail`` or
    ``dead_letter``, the latest) of the todo ``%(todo_id)s`` while its row still matches
    ``todo_guard`` (SQL over the row, which names the settling lease), and only when that
    event holds no usage yet: it RETURNs the todo's id, or nothing. ``todo_sql`` adds it to
    the sums of the todo ``%(todo_id)s``; ``spend_upsert_sql`` to the day's spend."""
    params.update(usage_params(report, now))
    params["usage_patch"] = json.dumps({"usage": as_detail(report)})
    settle_event = ("SELECT e.id FROM todos_todoevent e WHERE e.todo_id = (SELECT id FROM"
                    f" todos_todo WHERE {todo_guard})"
                    " AND e.action IN ('complete', 'fail', 'dead_letter')"
                    " ORDER BY e.at DESC, e.id DESC LIMIT 1")
    event_sql = (f"UPDATE todos_todoevent SET detail = "
                 f"{dialect.json_merge('detail', dialect.jsonb('usage_patch'))}"
                 f" WHERE id = ({settle_event}) AND {dialect.json_key_missing('detail', 'usage')}"
                 " RETURNING todo_id")
    todo_sql = f"UPDATE todos_todo SET {usage_set_sql(report)} WHERE id = %(todo_id)s"
    return event_sql, todo_sql


def budget_guard_sql(endpoint, params: dict, now) -> str:
    """The claim guard's budget clause ("" for an endpoint without a budget): nothing is
    claimed while the endpoint's spend of the day is at or over either budget. One probe of
    ``daily_spend_key``, uncorrelated (evaluated once per statement), read in the claim
    statement's own snapshot: a report committed before the claim began is counted."""
    if not endpoint.has_budget:
        return ""
    return " AND NOT " + over_budget_sql(endpoint, params, now)


def over_budget_sql(endpoint, params: dict, now) -> str:
    """SQL true when ``endpoint`` (which has a budget) is at or over one at ``now``."""
    params["budget_endpoint_id"] = endpoint.pk
    params["budget_day"] = dialect.db_date(spend_day(now))
    params["budget_microusd"] = _budget_microusd(endpoint)
    params["budget_tokens"] = endpoint.budget_tokens_per_day
    # A budget of 0 is spent before the day's first report, when no spend row exists yet.
    return (f"(COALESCE({dialect.bigint('budget_microusd')} <= 0, FALSE)"
            f" OR COALESCE({dialect.bigint('budget_tokens')} <= 0, FALSE)"
            " OR EXISTS (SELECT 1 FROM todos_dailyspend s"
            " WHERE s.endpoint_id = %(budget_endpoint_id)s AND s.day = %(budget_day)s"
            f" AND (s.cost_microusd >= {dialect.bigint('budget_microusd')}"
            f" OR s.tokens >= {dialect.bigint('budget_tokens')})))")


# -- reads ----------------------------------------------------------------------------------------


def spent_on(endpoint_ids, day) -> dict:
    """``{endpoint_id: (cost_microusd, tokens)}`` spent on ``day`` (absent: nothing)."""
    return {endpoint_id: (cost, tokens) for endpoint_id, cost, tokens in
            DailySpend.objects.filter(endpoint_id__in=list(endpoint_ids), day=day)
            .values_list("endpoint_id", "cost_microusd", "tokens")}


def _budget_microusd(endpoint) -> int | None:
    if endpoint.budget_usd_per_day is None:
        return None
    return to_microusd(endpoint.budget_usd_per_day, "budget_usd_per_day", Decimal(10**12))


def is_over(endpoint, spent: tuple) -> bool:
    """Whether ``spent`` (cost_microusd, tokens) is at or over either of ``endpoint``'s
    budgets."""
    cost, tokens = spent
    budget = _budget_microusd(endpoint)
    if budget is not None and cost >= budget:
        return True
    return endpoint.budget_tokens_per_day is not None and tokens >= endpoint.budget_tokens_per_day


def over_budget(endpoint, now) -> bool:
    """Whether ``endpoint`` is at or over a daily budget at ``now`` (a read: the claim guard
    is what enforces it; doorbells, digests and answers ask here)."""
    if not endpoint.has_budget:
        return False
    return is_over(endpoint, spent_on([endpoint.pk], spend_day(now)).get(endpoint.pk, (0, 0)))


def _budget_usd(value):
    return None if value is None else float(value)


def _spend(endpoint, spent: tuple) -> dict:
    cost, tokens = spent
    return {"usd_today": usd(cost), "tokens_today": tokens,
            "budget_usd_per_day": _budget_usd(endpoint.budget_usd_per_day),
            "budget_tokens_per_day": endpoint.budget_tokens_per_day,
            "over_budget": is_over(endpoint, spent)}


def spend_report(endpoint, now) -> dict:
    """The stats API's ``spend``: today's spend, the budgets, and ``over_budget``."""
    return _spend(endpoint, spent_on([endpoint.pk], spend_day(now)).get(endpoint.pk, (0, 0)))


def with_spend_today(endpoints, now):
    """The queryset ``endpoints`` reading each one's spend of the UTC day of ``now`` in the
    same query (a probe of ``daily_spend_key`` per endpoint row), for ``spend_today``: the
    board's header, the endpoints index and the ring sweep's receivers list endpoints anyway,
    so their spend costs no query of its own."""
    today = DailySpend.objects.filter(endpoint_id=OuterRef("pk"), day=spend_day(now))
    return endpoints.annotate(
        spent_microusd_today=Coalesce(Subquery(today.values("cost_microusd")), 0),
        spent_tokens_today=Coalesce(Subquery(today.values("tokens")), 0))


def spend_today(endpoint) -> dict:
    """``spend_report`` of an endpoint read through ``with_spend_today``."""
    return _spend(endpoint, (endpoint.spent_microusd_today, endpoint.spent_tokens_today))


def total_spend_by_endpoint() -> list:
    """``[(endpoint slug, cost_microusd, tokens)]`` over every day: /metrics' counters."""
    return list(DailySpend.objects.values("endpoint__slug")
                .annotate(cost=Sum("cost_microusd"), tokens=Sum("tokens"))
                .values_list("endpoint__slug", "cost", "tokens").order_by("endpoint__slug"))


# -- setting a budget -----------------------------------------------------------------------------


def set_endpoint_budget(endpoint, *, actor: str, now=None, **changes) -> dict:
    """Set ``endpoint``'s budgets (``endpoints.transitions.set_budget``: ``budget_usd_per_day``,
    ``budget_tokens_per_day``, ``max_cost_usd``; ValidationError naming a bad one) and return
    the ``manage.py budget`` report. When the change lifts the endpoint from over budget to
    under it, the push layer sends the waiting work as one digest (reason ``budget``)."""
    now = now or timezone.now()
    endpoint_transitions.set_budget(endpoint, actor=actor, now=now, **changes)
    return budget_report(endpoint, now)


def was_lifted(endpoint, before: dict, now) -> bool:
    """Whether ``endpoint`` was over the daily budgets ``before`` (``{field: value}``) and is
    under its own now: a raise that lets held work be claimed."""
    held = SimpleNamespace(**{name: before.get(name) for name in
                              ("budget_usd_per_day", "budget_tokens_per_day")})
    spent = spent_on([endpoint.pk], spend_day(now)).get(endpoint.pk, (0, 0))
    return is_over(held, spent) and not is_over(endpoint, spent)


def budget_report(endpoint, now) -> dict:
    """``{"endpoint", "budget_usd_per_day", "budget_tokens_per_day", "max_cost_usd",
    "spent_usd_today", "spent_tokens_today", "over_budget"}``."""
    spend = spend_report(endpoint, now)
    return {"endpoint": endpoint.slug, "budget_usd_per_day": spend["budget_usd_per_day"],
            "budget_tokens_per_day": spend["budget_tokens_per_day"],
            "max_cost_usd": _budget_usd(endpoint.max_cost_usd),
            "spent_usd_today": spend["usd_today"], "spent_tokens_today": spend["tokens_today"],
            "over_budget": spend["over_budget"]}
