"""Usage and budgets (docs/reference.md#usage-and-budgets): usage reported on complete and fail is
validated, kept per attempt and summed per todo and per endpoint-day; a daily budget stops
claims inside the claim statement; max_cost_usd dead-letters; the day's turn lifts the hold."""

import threading
import time
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.test.utils import CaptureQueriesContext

from endpoints.models import Endpoint
from tests.factories import EndpointFactory, UserFactory
from todos import queries, statements, transitions, usage
from todos.models import DailySpend, State, Todo, TodoEvent
from todos.tests.test_concurrency import bulk_create_todos, run_threads

NOON = datetime(2026, 12, 7, 12, 0, tzinfo=dt_timezone.utc)


def budgeted(**fields):
    return EndpointFactory(owner=UserFactory(), **fields)


def make(endpoint, count=1, **kwargs):
    return [transitions.create_todo(endpoint=endpoint, queue="inbox", title=f"t {i}", actor="test",
                                    now=kwargs.get("now"))[0] for i in range(count)]


def spend(endpoint, day=NOON.date()):
    row = DailySpend.objects.filter(endpoint=endpoint, day=day).first()
    return (row.cost_microusd, row.tokens) if row else (0, 0)


def work_once(agent, *, cost, now=NOON, tokens=(0, 0), fail=False):
    todo = transitions.claim_next_todo(agent, now=now)
    assert todo is not None
    report = {"cost_usd": cost, "input_tokens": tokens[0], "output_tokens": tokens[1]}
    verb = transitions.fail_todo if fail else transitions.complete_todo
    return verb(agent, todo.pk, lease_id=todo.lease_id, now=now, usage_reported=report)


# -- usage: validation and sums -------------------------------------------------------------------


@pytest.mark.parametrize("report,field", [
    ({"input_tokens": -1}, "usage.input_tokens"),
    ({"output_tokens": 1.5}, "usage.output_tokens"),
    ({"input_tokens": True}, "usage.input_tokens"),
    ({"input_tokens": 10**9 + 1}, "usage.input_tokens"),
    ({"cost_usd": -0.01}, "usage.cost_usd"),
    ({"cost_usd": 10001}, "usage.cost_usd"),
    ({"cost_usd": float("nan")}, "usage.cost_usd"),
    ({"cost_usd": "0.5"}, "usage.cost_usd"),
    ({"turns": 100_001}, "usage.turns"),
    ({"model": ""}, "usage.model"),
    ({"model": "x" * 101}, "usage.model"),
    ({"model": "gpt\n5"}, "usage.model"),
    ({"tokens": 5}, "usage: unknown field 'tokens'"),
    (["cost_usd"], "usage: an object"),
])
@pytest.mark.django_db
def test_a_bad_usage_report_is_refused_naming_the_field_and_changes_nothing(agent, make_todo,
                                                                          report, field):
    todo = make_todo()
    held = transitions.claim_todo(agent, todo.pk)
    for verb in (transitions.complete_todo, transitions.fail_todo):
        with pytest.raises(transitions.Refusal) as refused:
            verb(agent, todo.pk, lease_id=held.lease_id, usage_reported=report)
        assert refused.value.code == "invalid_argument"
        assert refused.value.message.startswith(field)
    row = Todo.objects.get(pk=todo.pk)
    assert row.state == State.CLAIMED and row.usage_reports == 0
    assert not DailySpend.objects.exists()


@pytest.mark.django_db
def test_usage_is_kept_per_attempt_summed_on_the_todo_and_added_to_the_days_spend():
    endpoint = budgeted(max_attempts=3)
    todo, = make(endpoint)
    agent = transitions.Caller.agent(endpoint, "s-1")
    held = transitions.claim_todo(agent, todo.pk, now=NOON)
    transitions.fail_todo(agent, todo.pk, lease_id=held.lease_id, error="flaky", now=NOON,
                          usage_reported={"input_tokens": 1000, "output_tokens": 200,
                                          "cost_usd": 0.1234565, "turns": 3, "model": "claude-x"})
    Todo.objects.filter(pk=todo.pk).update(state=State.PENDING, retry_at=None)
    held = transitions.claim_todo(agent, todo.pk, now=NOON)
    done = transitions.complete_todo(agent, todo.pk, lease_id=held.lease_id, now=NOON,
                                     usage_reported={"input_tokens": 10, "output_tokens": 5,
                                                     "cost_usd": 0.5, "turns": 1})
    assert queries.todo_as_dict(done)["usage"] == {
        "input_tokens": 1010, "output_tokens": 205, "cost_usd": 0.623457, "turns": 4,
        "model": "claude-x"}
    events = {e.action: e.detail for e in TodoEvent.objects.filter(todo=todo)}
    assert events["fail"]["usage"] == {"input_tokens": 1000, "output_tokens": 200,
                                       "cost_usd": 0.123457, "turns": 3, "model": "claude-x"}
    assert events["fail"]["error"] == "flaky"
    assert events["complete"]["usage"] == {"input_tokens": 10, "output_tokens": 5,
                                           "cost_usd": 0.5, "turns": 1}
    assert spend(endpoint) == (623457, 1215)
    assert usage.spend_report(endpoint, NOON) == {
        "usd_today": 0.623457, "tokens_today": 1215, "budget_usd_per_day": None,
        "budget_tokens_per_day": None, "over_budget": False}


def settled_by_agent(agent, todo, settle: str, now=NOON):
    """``todo`` claimed and settled (``settle``) by ``agent`` without usage, as an agent
    run with --require-settled does; the claim's lease."""
    held = transitions.claim_todo(agent, todo.pk, now=now)
    if settle == "complete":
        transitions.complete_todo(agent, todo.pk, lease_id=held.lease_id, result={"ok": 1},
                                  now=now)
    else:
        transitions.fail_todo(agent, todo.pk, lease_id=held.lease_id, error="gave up", now=now)
    return held.lease_id


def repeat(verb, agent, todo, lease_id, report=None, now=NOON):
    """A complete or fail repeated under ``lease_id``: its refusal."""
    with pytest.raises(transitions.Refusal) as refused:
        getattr(transitions, f"{verb}_todo")(agent, todo.pk, lease_id=lease_id, now=now,
                                             usage_reported=report)
    return refused.value


# The refusal a repeat gets (unchanged by the usage it carries): only a complete after the
# lease's own complete is already_done.
REPEAT_CODES = {("complete", "complete"): "already_done", ("complete", "fail"): "lease_lost",
                ("fail", "complete"): "lease_lost", ("fail", "fail"): "lease_lost"}


@pytest.mark.parametrize("settle,verb", sorted(REPEAT_CODES))
@pytest.mark.django_db
def test_a_repeat_by_the_settling_lease_records_its_usage_on_that_attempt_once(settle, verb):
    """The runner's report of a run whose agent settled the todo itself: the lease repeats
    complete or fail with the usage; the answer is the refusal it always was, saying
    usage_recorded, and the todo changes in nothing but its usage."""
    endpoint = budgeted(max_attempts=3)
    todo, = make(endpoint)
    agent = transitions.Caller.agent(endpoint, "s-agent")
    lease_id = settled_by_agent(agent, todo, settle)
    before = Todo.objects.get(pk=todo.pk)
    runner = transitions.Caller.agent(endpoint, "s-runner")
    report = {"input_tokens": 1000, "output_tokens": 200, "cost_usd": 0.25, "turns": 3,
              "model": "claude-x"}

    refused = repeat(verb, runner, todo, lease_id, report, now=NOON + timedelta(seconds=5))
    assert (refused.code, refused.data) == (REPEAT_CODES[settle, verb], {"usage_recorded": True})
    row = Todo.objects.get(pk=todo.pk)
    assert queries.todo_as_dict(row)["usage"] == report
    assert spend(endpoint) == (250000, 1200)
    settle_event = TodoEvent.objects.get(todo=todo, action=settle)
    assert settle_event.detail["usage"] == {"input_tokens": 1000, "output_tokens": 200,
                                            "cost_usd": 0.25, "turns": 3, "model": "claude-x"}
    assert TodoEvent.objects.filter(todo=todo).count() == 3  # create, claim, settle: no new one
    for field in ("state", "result", "last_error", "attempts", "retry_at", "dead_lettered_at",
                  "lease_id", "lease_owner", "updated_at"):
        assert getattr(row, field) == getattr(before, field), field

    # A second repeat (either verb) finds the attempt's usage there and records nothing.
    for again in ("complete", "fail"):
        refused = repeat(again, runner, todo, lease_id, {"cost_usd": 1.0, "input_tokens": 5})
        assert (refused.code, refused.data) == (REPEAT_CODES[settle, again],
                                                {"usage_recorded": False})
    assert Todo.objects.get(pk=todo.pk).usage_reports == 1
    assert spend(endpoint) == (250000, 1200)


@pytest.mark.django_db
def test_a_repeat_records_nothing_from_another_lease_without_a_lease_or_after_a_reported_settle():
    endpoint = budgeted()
    first, second, third = make(endpoint, 3)
    agent = transitions.Caller.agent(endpoint, "s-agent")
    lease_id = settled_by_agent(agent, first, "complete")
    assert repeat("complete", agent, first, "another-lease", {"cost_usd": 1}).data == {
        "usage_recorded": False}
    # Without lease_id nothing names the attempt: the session may have settled others since.
    refused = repeat("complete", agent, first, None, {"cost_usd": 1})
    assert (refused.code, refused.data) == ("already_done", {"usage_recorded": False})
    # Without usage the refusal is exactly what it was.
    assert repeat("complete", agent, first, lease_id).data == {}
    # An attempt that reported usage when it settled keeps that report alone.
    held = transitions.claim_todo(agent, second.pk, now=NOON)
    transitions.complete_todo(agent, second.pk, lease_id=held.lease_id, now=NOON,
                              usage_reported={"cost_usd": 0.5})
    assert repeat("complete", agent, second, held.lease_id, {"cost_usd": 2}).data == {
        "usage_recorded": False}
    # A lease an operator's override ended did not settle the todo.
    held = transitions.claim_todo(agent, third.pk, now=NOON)
    operator = transitions.Caller.operator(endpoint, "olga")
    transitions.complete_todo(operator, third.pk, now=NOON,
                              overriding=transitions.HeldLease.of(held))
    refused = repeat("complete", agent, third, held.lease_id, {"cost_usd": 3})
    assert (refused.code, refused.data) == ("lease_lost", {"usage_recorded": False})
    assert [Todo.objects.get(pk=t.pk).usage_reports for t in (first, second, third)] == [0, 1, 0]
    assert spend(endpoint) == (500000, 0)


@pytest.mark.django_db
def test_a_failed_todo_handed_out_again_takes_no_usage_from_the_lease_before():
    """The row names the lease that settled it until the todo is handed out again: the
    usage of an attempt whose todo has since gone back to the queue is not recorded."""
    endpoint = budgeted(max_attempts=3)
    todo, = make(endpoint)
    agent = transitions.Caller.agent(endpoint, "s-agent")
    lease_id = settled_by_agent(agent, todo, "fail")
    transitions.promote_due_retries(now=NOON + timedelta(minutes=1), limit=10)
    held = transitions.claim_todo(agent, todo.pk, now=NOON + timedelta(minutes=1))
    refused = repeat("fail", agent, todo, lease_id, {"cost_usd": 1},
                     now=NOON + timedelta(minutes=1))
    assert (refused.code, refused.data) == ("lease_lost", {"usage_recorded": False})
    row = Todo.objects.get(pk=todo.pk)
    assert (row.state, row.lease_id, row.usage_reports) == (State.CLAIMED, held.lease_id, 0)
    assert not DailySpend.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_eight_racing_repeats_of_the_settling_lease_record_its_usage_once():
    endpoint = budgeted()
    todo, = make(endpoint)
    lease_id = settled_by_agent(transitions.Caller.agent(endpoint, "s-agent"), todo, "complete")
    recorded = []

    def send(i):
        refused = repeat("complete", transitions.Caller.agent(endpoint, f"s-{i}"), todo, lease_id,
                         {"cost_usd": 0.1, "output_tokens": 10})
        recorded.append(refused.data["usage_recorded"])

    run_threads(8, send)
    assert sorted(recorded) == [False] * 7 + [True]
    assert Todo.objects.get(pk=todo.pk).usage_reports == 1
    assert spend(endpoint) == (100000, 10)


@pytest.mark.django_db
def test_a_todo_without_usage_reports_none(agent, make_todo):
    todo = make_todo()
    held = transitions.claim_todo(agent, todo.pk)
    done = transitions.complete_todo(agent, todo.pk, lease_id=held.lease_id)
    assert queries.todo_as_dict(done)["usage"] is None
    assert "usage" not in TodoEvent.objects.get(todo=todo, action="complete").detail
    assert not DailySpend.objects.exists()


@pytest.mark.django_db
def test_spend_counts_on_the_utc_day_of_the_report():
    endpoint = budgeted()
    agent = transitions.Caller.agent(endpoint, "s-1")
    make(endpoint, 2)
    late = datetime(2026, 12, 7, 23, 59, 59, tzinfo=dt_timezone.utc)
    work_once(agent, cost=1, now=late)
    work_once(agent, cost=2, now=late + timedelta(seconds=2))
    assert spend(endpoint, late.date()) == (1_000_000, 0)
    assert spend(endpoint, late.date() + timedelta(days=1)) == (2_000_000, 0)


# -- budgets ---------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_at_the_daily_budget_claims_are_refused_over_budget_and_held_leases_go_on():
    endpoint = budgeted(budget_usd_per_day=Decimal("1.00"))
    first, second, third = make(endpoint, 3)
    agent = transitions.Caller.agent(endpoint, "s-1")
    held = transitions.claim_todo(agent, first.pk, now=NOON)
    kept = transitions.claim_todo(agent, second.pk, now=NOON)
    transitions.complete_todo(agent, first.pk, lease_id=held.lease_id, now=NOON,
                              usage_reported={"cost_usd": 1.0})
    with pytest.raises(transitions.Refusal) as refused:
        transitions.claim_next_todo(agent, now=NOON)
    assert refused.value.code == "over_budget"
    with pytest.raises(transitions.Refusal) as refused:
        transitions.claim_todo(agent, third.pk, now=NOON)
    assert refused.value.code == "over_budget"
    assert Todo.objects.get(pk=third.pk).state == State.PENDING
    # The lease held when the budget was reached goes on, and its report still counts.
    transitions.heartbeat_todo(agent, second.pk, lease_id=kept.lease_id, now=NOON)
    transitions.complete_todo(agent, second.pk, lease_id=kept.lease_id, now=NOON,
                              usage_reported={"cost_usd": 0.25})
    assert spend(endpoint) == (1_250_000, 0)


@pytest.mark.parametrize("budget", [{"budget_usd_per_day": Decimal("0")},
                                    {"budget_tokens_per_day": 0}], ids=["usd", "tokens"])
@pytest.mark.django_db
def test_a_budget_of_zero_stops_claims_before_the_days_first_report(budget):
    """No spend row exists before the day's first report: a budget of 0 is spent already."""
    endpoint = budgeted(**budget)
    [todo] = make(endpoint)
    agent = transitions.Caller.agent(endpoint, "s-1")
    for claim in (lambda: transitions.claim_next_todo(agent, now=NOON),
                  lambda: transitions.claim_todo(agent, todo.pk, now=NOON)):
        with pytest.raises(transitions.Refusal) as refused:
            claim()
        assert refused.value.code == "over_budget"
    assert Todo.objects.get(pk=todo.pk).state == State.PENDING
    assert not DailySpend.objects.exists()


@pytest.mark.django_db
def test_a_token_budget_stops_claims_too():
    endpoint = budgeted(budget_tokens_per_day=1000)
    make(endpoint, 2)
    agent = transitions.Caller.agent(endpoint, "s-1")
    work_once(agent, cost=0, tokens=(900, 99))
    assert transitions.claim_next_todo(agent, now=NOON) is not None  # 999 < 1000


@pytest.mark.django_db
def test_the_days_turn_lifts_the_budget_with_the_clock_moved():
    endpoint = budgeted(budget_usd_per_day=Decimal("0.50"))
    make(endpoint, 3)
    agent = transitions.Caller.agent(endpoint, "s-1")
    work_once(agent, cost=0.5)
    last_second = datetime(2026, 12, 7, 23, 59, 59, 999999, tzinfo=dt_timezone.utc)
    with pytest.raises(transitions.Refusal):
        transitions.claim_next_todo(agent, now=last_second)
    midnight = datetime(2026, 12, 8, tzinfo=dt_timezone.utc)
    assert transitions.claim_next_todo(agent, now=midnight) is not None


@pytest.mark.django_db
def test_an_endpoint_without_a_budget_claims_with_the_statement_unchanged():
    endpoint = budgeted()
    make(endpoint)
    with CaptureQueriesContext(connection) as captured:
        assert transitions.claim_next_todo(transitions.Caller.agent(endpoint, "s-1")) is not None
    assert not any("todos_dailyspend" in q["sql"] for q in captured.captured_queries)


@pytest.mark.django_db
def test_the_budget_is_checked_inside_the_claim_statement():
    endpoint = budgeted(budget_usd_per_day=Decimal("5"))
    make(endpoint)
    with CaptureQueriesContext(connection) as captured:
        assert transitions.claim_next_todo(transitions.Caller.agent(endpoint, "s-1")) is not None
    claims = [q["sql"] for q in captured.captured_queries if "UPDATE todos_todo" in q["sql"]]
    assert len(claims) == 1 and "todos_dailyspend" in claims[0]


@pytest.mark.parametrize("verb", ["claim", "claim_next"])
@pytest.mark.django_db
def test_a_report_that_lands_just_before_the_claim_statement_stops_the_claim(monkeypatch, verb):
    """No read-then-claim: a report that reaches the budget after the claim began, but before
    its statement ran, is seen by that statement. A check read earlier (in Python, before the
    statement) would let this claim through."""
    endpoint = budgeted(budget_usd_per_day=Decimal("1"))
    working, waiting = make(endpoint, 2)
    agent = transitions.Caller.agent(endpoint, "s-1")
    held = transitions.claim_todo(agent, working.pk, now=NOON)
    apply_transition = statements.apply_transition
    landed = []

    def report_lands_first(**statement):
        if statement["action_sql"] == "'claim'" and not landed:
            landed.append(transitions.complete_todo(agent, working.pk, lease_id=held.lease_id,
                                                    now=NOON, usage_reported={"cost_usd": 1}))
        return apply_transition(**statement)

    monkeypatch.setattr(statements, "apply_transition", report_lands_first)
    with pytest.raises(transitions.Refusal) as refused:
        if verb == "claim":
            transitions.claim_todo(agent, waiting.pk, now=NOON)
        else:
            transitions.claim_next_todo(agent, now=NOON)
    assert refused.value.code == "over_budget" and landed
    assert Todo.objects.get(pk=waiting.pk).state == State.PENDING


@pytest.mark.parametrize("fields,name", [
    ({"budget_usd_per_day": Decimal("-1")}, "budget_usd_per_day"),
    ({"budget_usd_per_day": Decimal("1000000.5")}, "budget_usd_per_day"),
    ({"budget_tokens_per_day": -5}, "budget_tokens_per_day"),
    ({"budget_tokens_per_day": 10**12 + 1}, "budget_tokens_per_day"),
    ({"max_cost_usd": Decimal("10000.01")}, "max_cost_usd"),
])
@pytest.mark.django_db
def test_a_budget_out_of_range_is_refused_naming_the_field(fields, name):
    endpoint = budgeted()
    with pytest.raises(ValidationError) as refused:
        usage.set_endpoint_budget(endpoint, actor="test", **fields)
    assert name in refused.value.message_dict
    row = Endpoint.objects.get(pk=endpoint.pk)
    assert row.budget_usd_per_day is None and row.budget_tokens_per_day is None
    assert row.max_cost_usd is None and not row.events.exists()


def run_budget(*args):
    import io
    import json

    from django.core.management import call_command

    out = io.StringIO()
    call_command("budget", *args, "--json", stdout=out)
    return json.loads(out.getvalue())


@pytest.mark.django_db
def test_the_budget_command_sets_removes_and_prints_todays_spend():
    from django.core.management.base import CommandError

    endpoint = budgeted(slug="spender")
    assert run_budget("spender", "--usd", "2.5", "--tokens", "50000") == {
        "endpoint": "spender", "budget_usd_per_day": 2.5, "budget_tokens_per_day": 50000,
        "spent_usd_today": 0.0, "spent_tokens_today": 0, "max_cost_usd": None,
        "over_budget": False}
    make(endpoint)
    agent = transitions.Caller.agent(endpoint, "s-1")
    held = transitions.claim_next_todo(agent)
    transitions.complete_todo(agent, held.pk, lease_id=held.lease_id,
                              usage_reported={"cost_usd": 3, "input_tokens": 7})
    report = run_budget("spender", "--tokens", "none", "--max-cost-usd", "1.25")
    assert report["budget_tokens_per_day"] is None and report["max_cost_usd"] == 1.25
    assert (report["spent_usd_today"], report["spent_tokens_today"]) == (3.0, 7)
    assert report["over_budget"] is True
    assert run_budget("spender")["budget_usd_per_day"] == 2.5  # no flag: prints only
    for args, named in ((("--usd", "-1"), "budget_usd_per_day"),
                        (("--usd", "lots"), "budget_usd_per_day"),
                        (("--tokens", "1.5"), "budget_tokens_per_day"),
                        (("--max-cost-usd", "0.0000001"), "max_cost_usd")):
        with pytest.raises(CommandError, match=named):
            run_budget("spender", *args)
    assert Endpoint.objects.get(pk=endpoint.pk).budget_usd_per_day == Decimal("2.5")


# -- max_cost_usd -----------------------------------------------------------------------------------


@pytest.mark.django_db
def test_an_attempt_taking_the_todo_past_its_max_cost_dead_letters_it_with_the_reason():
    endpoint = budgeted(max_cost_usd=Decimal("1.00"), max_attempts=5)
    todo, = make(endpoint)
    agent = transitions.Caller.agent(endpoint, "s-1")
    failed = work_once(agent, cost=0.6, fail=True)
    assert failed.retry_at is not None and failed.dead_lettered_at is None
    Todo.objects.filter(pk=todo.pk).update(state=State.PENDING, retry_at=None)
    dead = work_once(agent, cost=0.6, fail=True)
    assert dead.is_dead_letter and dead.retry_at is None and dead.attempts == 2
    event = TodoEvent.objects.filter(todo=todo).order_by("-id").first()
    assert event.action == "dead_letter" and event.detail["reason"] == "max_cost_usd"
    assert event.detail["usage"]["cost_usd"] == 0.6


@pytest.mark.django_db
def test_a_todos_own_max_cost_wins_over_the_endpoints():
    endpoint = budgeted(max_cost_usd=Decimal("100"))
    todo, = make(endpoint)
    Todo.objects.filter(pk=todo.pk).update(max_cost_usd=Decimal("0.10"))
    dead = work_once(transitions.Caller.agent(endpoint, "s-1"), cost=0.2, fail=True)
    assert dead.is_dead_letter


@pytest.mark.parametrize("cost,dead", [(0.256229, False), (0.25623, True)])
@pytest.mark.django_db
def test_a_cost_equal_to_a_todos_max_cost_is_not_past_it(cost, dead):
    """Compared to the millionth of a dollar on both backends (SQLite keeps the decimal as a
    float, and 0.256229 x 10^6 truncated to 256228 would dead-letter at exactly the limit)."""
    endpoint = budgeted(max_attempts=5)
    todo, = make(endpoint)
    Todo.objects.filter(pk=todo.pk).update(max_cost_usd=Decimal("0.256229"))
    failed = work_once(transitions.Caller.agent(endpoint, "s-1"), cost=cost, fail=True)
    assert failed.is_dead_letter is dead


@pytest.mark.django_db
def test_a_failure_within_max_cost_retries_and_its_dead_letter_by_attempts_has_no_cost_reason():
    endpoint = budgeted(max_cost_usd=Decimal("1.00"), max_attempts=1)
    todo, = make(endpoint)
    dead = work_once(transitions.Caller.agent(endpoint, "s-1"), cost=0.1, fail=True)
    assert dead.is_dead_letter
    assert "reason" not in TodoEvent.objects.get(todo=todo, action="dead_letter").detail


# -- under concurrency (PostgreSQL) ---------------------------------------------------------------

THREADS = 16
COST = Decimal("0.05")
BUDGET = Decimal("1.00")


@pytest.mark.django_db(transaction=True)
def test_sixteen_claimers_at_the_edge_of_a_budget_start_no_more_than_the_work_in_flight():
    """16 workers claim and complete, each attempt reporting 0.05 USD against a 1.00 budget.
    Claims stop once 20 reports have committed: at most the 15 other workers can hold work
    then, so spend ends at most 15 x 0.05 past the budget. And a claim that began after a
    worker saw the budget reached (its own report committed, the day's row read back) never
    succeeds: the guard reads the committed spend in the claim's own statement."""
    if connection.vendor != "postgresql":
        pytest.skip("the race is PostgreSQL's; SQLite's single writer serializes claims")
    endpoint = budgeted(budget_usd_per_day=BUDGET)
    bulk_create_todos(endpoint, 400)
    lock = threading.Lock()
    reached_at = []  # monotonic times at which a worker had seen spend >= budget
    claims = []  # (started, succeeded)

    def work(i):
        caller = transitions.Caller.agent(endpoint, f"worker-{i}")
        while True:
            started = time.monotonic()
            try:
                todo = transitions.claim_next_todo(caller)
            except transitions.Refusal as refusal:
                assert refusal.code == "over_budget", refusal.code
                with lock:
                    claims.append((started, False))
                return
            assert todo is not None
            with lock:
                claims.append((started, True))
            transitions.complete_todo(caller, todo.pk, lease_id=todo.lease_id,
                                      usage_reported={"cost_usd": float(COST)})
            if spend(endpoint, usage.spend_day(todo.updated_at))[0] >= BUDGET * 1_000_000:
                with lock:
                    reached_at.append(time.monotonic())

    run_threads(THREADS, work)
    completed = Todo.objects.filter(endpoint=endpoint, state=State.DONE).count()
    assert completed >= BUDGET / COST  # the budget was reached, and pressed against
    assert completed <= BUDGET / COST + (THREADS - 1)
    first_seen = min(reached_at)
    assert not [started for started, ok in claims if ok and started > first_seen]
    assert sum(not ok for _, ok in claims) == THREADS


EMBEDDED_USAGE_SCRIPT = """
import django
django.setup()
from decimal import Decimal
from django.core.management import call_command
call_command("migrate", verbosity=0)
from tests.factories import EndpointFactory, UserFactory
from todos import queries, statements, transitions, usage

endpoint = EndpointFactory(owner=UserFactory(), budget_usd_per_day=Decimal("1"),
                           max_cost_usd=Decimal("0.5"))
for i in range(3):
    transitions.create_todo(endpoint=endpoint, queue="inbox", title=str(i), actor="test")
agent = transitions.Caller.agent(endpoint, "s-1")
todo = transitions.claim_next_todo(agent)
dead = transitions.fail_todo(agent, todo.pk, lease_id=todo.lease_id,
                             usage_reported={"cost_usd": 0.6, "input_tokens": 7})
print(dead.is_dead_letter, dead.events.order_by("-id").first().detail.get("reason"))
todo = transitions.claim_next_todo(agent)
done = transitions.complete_todo(agent, todo.pk, lease_id=todo.lease_id,
                                 usage_reported={"cost_usd": 0.4, "output_tokens": 3})
print(queries.todo_as_dict(done)["usage"]["cost_usd"])
try:
    transitions.claim_next_todo(agent)
except transitions.Refusal as refusal:
    print(refusal.code)
print(usage.spend_report(endpoint, done.updated_at)["usd_today"],
      usage.spend_report(endpoint, done.updated_at)["tokens_today"])
"""


def test_usage_and_budgets_hold_on_the_embedded_sqlite_database(tmp_path):
    import subprocess

    from tests.processes import PYTHON, ROOT
    from tests.test_embedded import embedded_env

    env = embedded_env(tmp_path)
    env["DJANGO_SETTINGS_MODULE"] = "switchboard.settings"
    run = subprocess.run([PYTHON, "-c", EMBEDDED_USAGE_SCRIPT], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["True", "max_cost_usd", "0.4", "over_budget", "1.0", "10"]
