"""switchboard/http/daphne_tuning.py against a real daphne: twisted no longer parses POST forms."""

import httpx
import pytest

from ingest import transitions as ingest_transitions
from tests.factories import UserFactory
from tests.processes import DEADLINE_SECONDS

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_malformed_multipart_post_reaches_the_application(daphne_server):
    """twisted's own form parse answered a malformed multipart body with a bare 400 before the
    application ran; now the hook answers it, with its JSON error (415: not a content type a
    webhook sends)."""
    webhook, _ = ingest_transitions.create_webhook(slug="form-tuning", owner=UserFactory(),
                                                   source="github", secret="s3cret-value-0123456789")
    # No boundary: twisted's multipart parser refuses it ("Not a multipart.").
    answer = httpx.post(f"{daphne_server.url}/hooks/{webhook.slug}", content=b"garbage",
                        headers={"Content-Type": "multipart/form-data"},
                        timeout=DEADLINE_SECONDS)
    assert answer.headers["content-type"].startswith("application/json"), answer.text
    assert answer.status_code in (401, 415) and "error" in answer.json()
