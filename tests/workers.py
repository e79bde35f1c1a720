"""One pytest-xdist worker's own Redis database and channel-layer prefix (docs/testing.md).

pytest-django gives each worker (``PYTEST_XDIST_WORKER``: gw0, gw1, …) a test database of its
own (``test_<name>_gw0``); ``isolate_xdist_worker`` does the same for Redis, before the
settings read the environment. Redis pub/sub ignores the database number, so the channel
prefix is what keeps one worker's doorbells out of another worker's streams (the rate-limit
keys carry the prefix too); the database number keeps Celery's queues and every other key
apart. Both go into the environment, so the servers and commands a test starts inherit them.
"""

import os
from urllib.parse import urlsplit, urlunsplit

# Redis has 16 databases unless its configuration says otherwise.
REDIS_DATABASES = 16
# Set once a worker's values are in the environment: a child process started with the test
# settings inherits it with them, and must not shift them a second time.
MARKER = "SB_TEST_ISOLATED_WORKER"


def isolate_xdist_worker() -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or os.environ.get(MARKER) == worker:
        return
    number = int(worker[2:])
    os.environ[MARKER] = worker
    os.environ["CHANNEL_PREFIX"] = f"{os.environ.get('CHANNEL_PREFIX', 'sb')}_{worker}"
    url = urlsplit(os.environ["REDIS_URL"])
    if url.scheme not in ("redis", "rediss"):
        return  # a unix socket URL: its database is a query parameter; the prefix suffices
    database = int(url.path.strip("/") or 0) + number
    if database >= REDIS_DATABASES:
        raise RuntimeError(
            f"REDIS_URL: xdist worker {worker} would use Redis database {database}; start"
            f" from a lower database number or run fewer workers (-n)")
    os.environ["REDIS_URL"] = urlunsplit(url._replace(path=f"/{database}"))
