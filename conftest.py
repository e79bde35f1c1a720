import pytest
import redis
from django.conf import settings

from tests.factories import EndpointFactory, UserFactory
from todos import transitions


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
