"""Property: whatever bytes and headers arrive, the hook endpoint never answers 5xx and never
writes without a valid signature (unsigned webhooks have none to check). Requests go through
the real ASGI app (hook_client)."""

import json

import pytest
from django.test import override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ingest.models import DeliveryEvent
from todos.models import Todo

from . import hook_client, signing
from .conftest import SECRETS

HEADER_NAMES = {
    "github": ["HTTP_X_HUB_SIGNATURE_256", "HTTP_X_GITHUB_EVENT", "HTTP_X_GITHUB_DELIVERY"],
    "standard": ["HTTP_WEBHOOK_ID", "HTTP_WEBHOOK_TIMESTAMP", "HTTP_WEBHOOK_SIGNATURE"],
    "stripe": ["HTTP_STRIPE_SIGNATURE"],
    "gitlab": ["HTTP_X_GITLAB_TOKEN", "HTTP_X_GITLAB_EVENT", "HTTP_IDEMPOTENCY_KEY"],
    "gitea": ["HTTP_X_GITEA_SIGNATURE", "HTTP_X_GITEA_EVENT", "HTTP_X_GITEA_DELIVERY",
              "HTTP_X_FORGEJO_SIGNATURE"],
    "linear": ["HTTP_LINEAR_SIGNATURE", "HTTP_LINEAR_DELIVERY", "HTTP_LINEAR_EVENT"],
    "slack": ["HTTP_X_SLACK_SIGNATURE", "HTTP_X_SLACK_REQUEST_TIMESTAMP",
              "HTTP_X_SLACK_RETRY_NUM"],
    "sentry": ["HTTP_SENTRY_HOOK_SIGNATURE", "HTTP_SENTRY_HOOK_RESOURCE", "HTTP_REQUEST_ID"],
    "unsigned": ["HTTP_X_GITHUB_EVENT", "HTTP_WEBHOOK_ID"],
}
header_text = st.one_of(
    st.text(max_size=80),
    st.sampled_from(["sha256=", "v1,", "t=1,v1=", "sha256=" + "0" * 64, "v1,AAAA", ""]),
    st.builds(lambda a, b: a + b, st.sampled_from(["sha256=", "v1,", "t=", "whsec_"]), st.text(max_size=70)),
)
# Valid JSON number literals that overflow a double (Python parses them to inf; jsonb cannot
# store that), spliced into an otherwise ordinary object.
overflowing_numbers = st.one_of(
    st.builds(lambda sign, exponent: f"{sign}1e{exponent}", st.sampled_from(["", "-"]),
              st.integers(min_value=309, max_value=100_000)),
    st.builds(lambda digits: "9" * digits + ".5", st.integers(min_value=310, max_value=2000)),
    st.sampled_from(["1.8e308", "-1.7976931348623159e308", "1E400", "2e+999"]),
)
# Text that PostgreSQL cannot store: NUL characters among ordinary ones.
nul_text = st.text(alphabet=st.sampled_from(["a", " ", "\x00", "é", "\n"]), min_size=1, max_size=12)
bodies = st.one_of(
    st.binary(max_size=2048),
    st.builds(lambda key, literal: f'{{"action": "opened", {key}: {literal}}}'.encode(),
              st.text(max_size=8).map(lambda key: json.dumps(key)), overflowing_numbers),
    st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                  st.text(max_size=20), nul_text),
        lambda children: st.one_of(st.lists(children, max_size=4),
                                   st.dictionaries(st.one_of(st.text(max_size=10), nul_text),
                                                   children, max_size=4)),
        max_leaves=20,
    ).map(lambda value: signing.body_of({"v": value})),
)
content_types = st.one_of(
    st.sampled_from(["application/json", "application/json; charset=utf-8",
                     "application/x-www-form-urlencoded", "text/plain", "", "application/cloudevents+json"]),
    st.text(max_size=30),
)


@pytest.fixture
def webhooks(make_webhook, endpoint):
    return {source: make_webhook(source) for source in HEADER_NAMES}


@pytest.mark.django_db
# Every example comes from one address: its failure budget (60 a minute) would run out as soon
# as the examples run faster than the budget refills, and answer 429 where 401 is the property.
@override_settings(SWITCHBOARD_INGEST_RATE_PER_MINUTE=1_000_000,
                   SWITCHBOARD_INGEST_FAILURES_PER_MINUTE=1_000_000)
@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_arbitrary_requests_never_500_and_never_write_unsigned(webhooks, data):
    source = data.draw(st.sampled_from(sorted(HEADER_NAMES)), label="source")
    body = data.draw(bodies, label="body")
    meta = {
        name: value for name, value in data.draw(
            st.dictionaries(st.sampled_from(HEADER_NAMES[source]), header_text), label="headers"
        ).items()
    }
    signed = source == "unsigned" or data.draw(st.booleans(), label="validly signed")
    if signed and source != "unsigned":
        meta.update(signing.SIGNERS[source](SECRETS[source], body))
    content_type = data.draw(content_types, label="content type")
    before = (Todo.objects.count(), DeliveryEvent.objects.count())
    answer = hook_client.post(webhooks[source].slug, body, content_type=content_type, **meta)
    after = (Todo.objects.count(), DeliveryEvent.objects.count())
    assert answer.status_code < 500, answer.content[:300]
    assert answer["Content-Type"] == "application/json"
    if not signed:
        assert answer.status_code == 401
        assert after == before
    elif answer.status_code != 202:
        assert after == before
