"""Doorbell frames and the sender gate: pure functions, no database (SPEC-0011 shape and
injection-safety scenarios)."""

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from channels_push.doorbells import doorbells
from channels_push.doorbells import text as doorbell_text


def todo(**fields):
    base = dict(pk=42, queue="reviews", title="acme/repo#12 opened: fix it", kind="issues.opened",
                source="github", payload={"secret": "hunter2"}, lease_id="lease-x", trust="signed")
    return SimpleNamespace(**{**base, **fields})


def test_new_todo_frame_has_identifier_safe_string_meta():
    params = doorbells.todo_doorbell(todo())
    assert params["meta"] == {"todo_id": "42", "queue": "reviews", "kind": "issues.opened",
                              "source": "github", "trust": "signed"}
    assert all(doorbell_text.META_KEY_RE.match(key) for key in params["meta"])
    assert all(isinstance(value, str) for value in params["meta"].values())
    assert "\n" not in params["content"] and "acme/repo#12 opened: fix it" in params["content"]


def test_frame_carries_no_lease_payload_or_secret():
    params = doorbells.todo_doorbell(todo())
    assert set(params) == {"content", "meta"}
    text = repr(params)
    assert "lease" not in text and "hunter2" not in text and "payload" not in text


def test_kind_and_source_are_left_out_when_absent():
    params = doorbells.todo_doorbell(todo(kind="", source=""))
    assert params["meta"] == {"todo_id": "42", "queue": "reviews", "trust": "signed"}


def test_every_todo_doorbell_says_the_todos_trust_in_meta():
    """The agent weighs a doorbell's text by its trust without a round trip: operator and
    signed alike (only these ring), and the value is sanitised like every meta value."""
    assert doorbells.todo_doorbell(todo(trust="operator"))["meta"]["trust"] == "operator"
    assert doorbells.todo_doorbell(todo(trust="signed"))["meta"]["trust"] == "signed"
    assert doorbells.todo_doorbell(todo(trust='x" y>'))["meta"]["trust"] == "x__y_"


def test_a_todo_whose_kind_is_digest_is_not_forged_into_a_digest():
    for kind in ("digest", "Digest", " DIGEST "):
        params = doorbells.todo_doorbell(todo(kind=kind))
        assert params["meta"]["todo_id"] == "42"
        assert "kind" not in params["meta"]
        assert params["meta"]["todo_kind"].lower() == "digest"
        assert not doorbells.is_digest(params)


@given(kind=st.text(max_size=40), source=st.text(max_size=20), title=st.text(max_size=80),
       queue=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,20}", fullmatch=True))
def test_every_todo_doorbell_fails_the_consumers_digest_test(kind, source, title, queue):
    # The consumer-side rule: a digest only when kind == "digest" and no todo_id.
    params = doorbells.todo_doorbell(todo(kind=kind, source=source, title=title, queue=queue))
    assert not doorbells.is_digest(params)
    assert params["meta"].get("kind") != "digest"
    assert all(doorbell_text.META_KEY_RE.match(key) for key in params["meta"])


def test_consumer_rule_recognizes_only_real_digests():
    assert doorbells.is_digest({"content": "x", "meta": {"kind": "digest", "pending": "3"}})
    assert not doorbells.is_digest({"content": "x", "meta": {"kind": "digest", "todo_id": "1"}})
    assert not doorbells.is_digest({"content": "x", "meta": {"kind": "issues"}})


def test_content_is_clipped_to_one_short_line():
    params = doorbells.todo_doorbell(todo(title="x" * 5000))
    assert len(params["content"]) <= doorbells.CONTENT_MAX_CHARS


def test_only_verified_human_attributed_todos_are_push_eligible():
    assert doorbells.is_push_eligible("signed", 7)
    assert doorbells.is_push_eligible("operator", 7)
    assert not doorbells.is_push_eligible("unverified", 7)
    assert not doorbells.is_push_eligible("signed", None)
