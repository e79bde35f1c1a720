"""The console's pages of ingest drive webhooks made by ingest's own test fixtures."""

from ingest.tests.conftest import client, forget_found_slugs, make_webhook  # noqa: F401
from ingest.tests.conftest import app_connection, github  # noqa: F401,E402
