"""Hostile bodies (CONTRACT §12; issue 15 items 2 and 3): JSON nested deeper than 100 levels is a
400 naming the limit — never a 500 — on /hooks and the operator API, checked while parsing
(switchboard/json_input.py); ``unsigned`` webhooks take at most 64 KiB by default."""

import json

import pytest
from django.test import Client, override_settings
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from ingest import hook, transitions
from ingest.models import DeliveryRecord
from switchboard import json_input
from todos.models import Todo

from . import signing
from .conftest import SECRETS
from .test_views import post_hook

pytestmark = pytest.mark.django_db

MAX_DEPTH = json_input.MAX_JSON_DEPTH  # 100


def nested(depth: int) -> bytes:
    """An object whose ``payload`` value nests arrays to ``depth`` levels in all (the outer
    object counts as one), with a string at the bottom."""
    inner = "[" * (depth - 1) + '"x"' + "]" * (depth - 1)
    return ('{"type": "deep", "payload": ' + inner + "}").encode() if depth > 1 else b'{"type": "deep"}'


def check_answer(answer_status: int, body: dict, depth: int, ok: int, max_containers=None):
    assert answer_status != 500
    if depth <= MAX_DEPTH:
        assert answer_status == ok, (depth, body)
    elif max_containers is not None and depth > max_containers:
        # As many arrays as levels: past an anonymous body's cap on them, that refusal comes
        # first (it is counted before the depth).
        assert answer_status == 400 and body["error"]["code"] == "too_complex", (depth, body)
    else:
        assert answer_status == 400, (depth, body)
        assert body["error"]["code"] == "too_deep"
        assert f"the limit is {MAX_DEPTH}" in body["error"]["message"]


@override_settings(SWITCHBOARD_INGEST_RATE_PER_MINUTE=100_000,
                   SWITCHBOARD_DELIVERY_LOG_REFUSED_PER_MINUTE=0)
def test_hook_depth_sweep_1_to_2000_is_202_up_to_the_limit_then_400(make_webhook):
    webhook = make_webhook("unsigned")
    for depth in range(1, 2001):
        answer = post_hook(webhook.slug, nested(depth), {})
        check_answer(answer.status_code, answer.json(), depth, 202,
                     max_containers=hook.UNSIGNED_MAX_JSON_CONTAINERS)
    assert Todo.objects.count() == MAX_DEPTH


@override_settings(SWITCHBOARD_INGEST_RATE_PER_MINUTE=100_000)
def test_operator_api_depth_sweep_1_to_2000_is_201_up_to_the_limit_then_400(operator, endpoint):
    client = Client()
    _, token = transitions.mint_operator_token(user=operator)
    for depth in range(1, 2001):
        # {"queue", "title", "payload": <depth - 1 levels>}: the body nests ``depth`` in all.
        payload = "[" * (depth - 2) + "1" + "]" * (depth - 2) if depth > 2 else "1"
        body = (f'{{"queue": "inbox", "title": "deep {depth}", "idempotency_key": "k{depth}", '
                f'"payload": {{"v": {payload}}}}}') if depth > 1 else '{"queue": "inbox"}'
        answer = client.post(f"/api/v1/endpoints/{endpoint.slug}/todos", body,
                             content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token}")
        if depth == 1:
            assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_argument"
            continue
        check_answer(answer.status_code, answer.json(), depth, 201)


def test_depth_is_counted_outside_strings_only():
    json_input.loads_strict('{"a": "' + "[" * 5000 + '"}')  # brackets inside a string: depth 1
    json_input.loads_strict("[" * MAX_DEPTH + "]" * MAX_DEPTH)
    with pytest.raises(json_input.TooDeep):
        json_input.loads_strict("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))
    with pytest.raises(json_input.TooDeep):
        json_input.loads_strict(b'{"a":' * (MAX_DEPTH + 1) + b"1" + b"}" * (MAX_DEPTH + 1))
    with pytest.raises(json_input.TooDeep):  # escaped quotes do not end a string early
        json_input.loads_strict('["\\"",' + "[" * 200 + "]" * 200 + "]")
    with pytest.raises(ValueError):  # unbalanced: the decoder's own error
        json_input.loads_strict("[" * 500)


def test_an_unsigned_body_over_64_kib_is_413_and_at_the_cap_is_accepted(make_webhook, settings):
    assert settings.SWITCHBOARD_UNSIGNED_MAX_BODY_BYTES == 64 * 1024
    webhook = make_webhook("unsigned")
    head = b'{"type": "big", "pad": "'
    at_cap = head + b"x" * (64 * 1024 - len(head) - 2) + b'"}'
    assert len(at_cap) == 64 * 1024
    assert post_hook(webhook.slug, at_cap, {}).status_code == 202
    over = head + b"x" * (64 * 1024 - len(head) - 1) + b'"}'
    answer = post_hook(webhook.slug, over, {})
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "too_large"
    assert "65536" in answer.json()["error"]["message"]
    assert Todo.objects.count() == 1
    assert DeliveryRecord.objects.filter(outcome="too_large", size=len(over)).exists()


def test_an_unsigned_body_of_more_arrays_and_objects_than_its_cap_is_400_before_decoding(
        make_webhook, monkeypatch):
    """Decoding and checking a body costs per array or object in it: 64 KiB of ``[1],`` cost
    an anonymous sender's server twenty tiny posts. An unsigned body holds at most
    UNSIGNED_MAX_JSON_CONTAINERS of them, counted at C speed before anything decodes it."""
    cap = hook.UNSIGNED_MAX_JSON_CONTAINERS
    webhook = make_webhook("unsigned")
    signed = make_webhook("github", slug="signed-hook")

    def body_with(containers: int) -> bytes:
        # The outer object and array are two of them.
        return b'{"type":"t","a":[' + b",".join([b"[1]"] * (containers - 2)) + b"]}"

    assert post_hook(webhook.slug, body_with(cap), {}).status_code == 202
    # Brackets inside strings are text, not containers.
    text = json.dumps({"type": "t", "s": "[{" * (4 * cap), "n": 2}).encode()
    assert post_hook(webhook.slug, text, {}).status_code == 202
    decoded = []
    real = json_input.loads_strict
    monkeypatch.setattr(json_input, "loads_strict", lambda text: decoded.append(1) or real(text))
    answer = post_hook(webhook.slug, body_with(cap + 1), {})
    assert answer.status_code == 400, answer.content
    assert answer.json()["error"]["code"] == "too_complex"
    assert f"at most {cap} JSON arrays and objects" in answer.json()["error"]["message"]
    assert decoded == [] and Todo.objects.count() == 2
    assert DeliveryRecord.objects.filter(webhook=webhook, outcome="malformed").count() == 1
    # A signed sender's body is not anonymous: its shape is its own business.
    body = body_with(4 * cap)
    assert post_hook(signed.slug, body, signing.github(SECRETS["github"], body)).status_code == 202


@pytest.mark.timeout(30)
def test_the_depth_check_is_one_pass_over_unterminated_strings():
    """Review finding: the string-removal pattern restarted at every quote of an unterminated
    string and rescanned to the end — quadratic (64 KB: 7 s of CPU, a blocked process; 1 MiB,
    an authenticated body size, would have taken half an hour). One pass finishes 1 MiB well
    inside this test's timeout; the quadratic scan would not."""
    from switchboard import json_input

    for tail in ('\\"' * (512 * 1024), 'x' * (1024 * 1024) + "\\"):
        body = "[" * 101 + '"' + tail
        json_input.check_depth(body)  # an unterminated string: the decoder will refuse it
        with pytest.raises(ValueError):
            json_input.loads_strict(body)


# -- the plain-text fast path (json_input.is_plainly_storable) ---------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF)),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=5),
        children, max_size=4),
    max_leaves=30)


@given(value=json_values, ensure_ascii=st.booleans())
@hypothesis_settings(max_examples=300, deadline=None)
def test_a_plainly_storable_text_holds_nothing_the_storable_checks_would_refuse(value, ensure_ascii):
    """The fast path may skip the walk only where it would find nothing: whenever it says
    "plain", the one storable check (the hook's and the todo's) has nothing to refuse."""
    text = json.dumps({"v": value}, ensure_ascii=ensure_ascii)
    try:
        parsed = json_input.loads_strict(text)
    except ValueError:
        return
    if json_input.is_plainly_storable(text):
        assert json_input.unstorable_reason(parsed) is None


@pytest.mark.parametrize("text", [
    '{"a": "\\u0000"}', '{"\\u0000": 1}', '{"a": "\\ud800"}', '{"a": "\\uDFFF"}',
    "{\"a\": \"\ud800\"}",  # a raw lone surrogate (a str no strict UTF-8 decode returns)
    '{"a": ' + "[" * MAX_DEPTH + "]" * MAX_DEPTH + "}",
])
def test_escapes_surrogates_and_many_brackets_are_walked(text):
    assert not json_input.is_plainly_storable(text)


def test_escapes_that_decode_to_neither_nul_nor_a_surrogate_are_plain():
    # A log line's newlines and an ASCII-escaped accent need no walk: only \u0000 and
    # \uD800-\uDFFF decode to what the databases refuse.
    assert json_input.is_plainly_storable('{"a": "one\\ntwo \\u00e9 \\\\ \\"quoted\\""}')


def test_an_ordinary_delivery_body_is_plain():
    assert json_input.is_plainly_storable(json.dumps(
        {"action": "opened", "issue": {"title": "Ünïcode is fine", "labels": [1, 2.5, None]}},
        ensure_ascii=False))


def test_an_unsigned_body_is_validated_once_however_many_routes_it_matches(
        make_webhook, operator, monkeypatch):
    from tests.factories import EndpointFactory

    targets = [EndpointFactory(slug=f"fan-{n}", owner=operator) for n in range(5)]
    webhook = make_webhook("unsigned", routes=[(target, "inbox", None) for target in targets])
    walks = []
    real = json_input.unstorable_reason

    def counting(value):
        if isinstance(value, dict) and "lines" in value:
            walks.append(value)
        return real(value)

    monkeypatch.setattr(json_input, "unstorable_reason", counting)
    # Surrogate escapes make the body one a walk must check (json_input.is_plainly_storable is
    # False for them: a lone one is unstorable).
    body = json.dumps({"type": "log", "lines": ["a\U0001f600b"] * 2000}).encode()
    answer = post_hook(webhook.slug, body, {})
    assert answer.status_code == 202, answer.content
    assert Todo.objects.count() == 5
    assert len(walks) == 1, f"the anonymous body was walked {len(walks)} times"


def test_an_unsigned_webhooks_answer_says_only_that_it_was_accepted(make_webhook, endpoint):
    webhook = make_webhook("unsigned")
    body = json.dumps({"type": "ping"}).encode()
    answer = post_hook(webhook.slug, body, {})
    assert answer.status_code == 202 and answer.json() == {"accepted": True}
    again = post_hook(webhook.slug, body, {})  # a duplicate reads the same
    assert again.status_code == 202 and again.json() == {"accepted": True}
    (todo,) = Todo.objects.all()
    for secret in (endpoint.slug, "inbox", str(todo.pk), str(todo.delivery_event_id)):
        assert secret not in answer.content.decode() and secret not in again.content.decode()
