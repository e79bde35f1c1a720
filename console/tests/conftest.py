"""The console's pages of ingest drive webhooks made by ingest's own test fixtures, and write
back to its GitHub stand-in."""

from ingest.tests.conftest import (app_connection, client, forget_found_slugs,  # noqa: F401
                                   github, make_webhook)
