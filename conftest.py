import pytest
import redis
from django.conf import settings

from tests.factories import EndpointFactory, UserFactory
from todos import transitions

# -- the two passes of a run (docs/testing.md "Parallel and serial") -------------------------
# bash scripts/test runs the suite twice over: `--part parallel` under pytest-xdist
# (--dist loadgroup), then `--part serial` on its own, for the tests marked serial: those that
# must not share the machine with other tests. Without --part every test is collected.
#
# The system suite runs in the parallel pass, as one group on one worker (its topology is
# session-scoped, and private: its own PostgreSQL, Redis and free ports); loadgroup hands out
# the largest groups first, so it starts at once and the other workers share the rest.


def pytest_addoption(parser):
    parser.addoption("--part", choices=("parallel", "serial"), default=None,
                     help="collect only the tests safe to run beside others (not marked "
                          "serial), or only those marked serial")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("system"):
            item.add_marker(pytest.mark.xdist_group("system"))
    part = config.getoption("--part")
    if part is None:
        return
    want_serial = part == "serial"
    kept, dropped = [], []
    for item in items:
        serial = item.get_closest_marker("serial") is not None
        (kept if serial == want_serial else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


# The system suite's observed numbers, from the worker that ran it (tests/system/conftest.py).
SYSTEM_RECORDS: list[str] = []


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, on the controller
def pytest_testnodedown(node, error):
    SYSTEM_RECORDS.extend(getattr(node, "workeroutput", {}).get("system_records", ()))


def pytest_terminal_summary(terminalreporter):
    if SYSTEM_RECORDS:
        terminalreporter.section("system suite: observed numbers")
        for line in SYSTEM_RECORDS:
            terminalreporter.write_line(line)


@pytest.fixture
def operator(db):
    return UserFactory(username="alice")


@pytest.fixture
def endpoint(db, operator):
    return EndpointFactory(slug="agent", owner=operator)


@pytest.fixture
def agent(endpoint):
    """An agent session on ``endpoint`` (scope '*')."""
    return transitions.Caller.agent(endpoint, "session-a")


@pytest.fixture
def make_todo(endpoint):
    def make(queue="inbox", title="a todo", *, on=None, **kwargs):
        todo, _ = transitions.create_todo(
            endpoint=on or endpoint, queue=queue, title=title, actor="test", **kwargs
        )
        return todo

    return make


@pytest.fixture
def published():
    """Every change announced after commit, in order."""
    from channels_push.bus import publish

    seen = []

    def listener(todo, change):
        seen.append(change)

    publish.add_listener(listener)
    yield seen
    publish.remove_listener(listener)

# Live-server fixtures (daphne subprocess on the test database): see tests/servers.py.
pytest_plugins = ["tests.servers"]


@pytest.fixture(autouse=True)
def fresh_rate_limits():
    """Rate-limit buckets, failure budgets and log counters live in Redis for minutes (and
    in-process): start every test with none."""
    from switchboard import ratelimit

    ratelimit.reset_local_state()
    if settings.REDIS_URL:
        client = redis.Redis.from_url(settings.REDIS_URL)
        keys = list(client.scan_iter(ratelimit._redis_key("*", "*")))
        if keys:
            client.delete(*keys)
        client.close()
    yield
    ratelimit.reset_local_state()
