# The senders' tests post through the hook as ingest's own tests do, with the same fixtures.
from ingest.tests.conftest import forget_found_slugs, frozen_now, make_webhook  # noqa: F401
