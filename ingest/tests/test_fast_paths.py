"""Fast paths on the hook's hot path give exactly the slow path's answer (issue 17): the
printable-text cleaners skip their character walk only when there is nothing to drop."""

from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from ingest import problems, titles, transitions

any_text = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=600)


def walk(value: str) -> str:
    """The cleaners' slow path: every printable character, in order."""
    return "".join(ch for ch in value if ch.isprintable())


@given(value=any_text | st.text(max_size=600), limit=st.integers(min_value=0, max_value=400))
@hypothesis_settings(max_examples=400, deadline=None)
def test_the_printable_cleaners_equal_their_character_walk(value, limit):
    assert problems.one_line(value, limit) == walk(value).strip()[:limit]
    assert transitions._printable(value, limit) == walk(value[:limit * 2])[:limit]
    assert titles._clean_kind(value) == walk(value).strip()[:titles.MAX_KIND_CHARS]


def test_control_characters_are_still_dropped():
    assert problems.one_line(" a\x00b\nc ", 10) == "abc"
    assert transitions._printable("d-\x1b[31m1", 10) == "d-[31m1"
    assert titles._clean_kind("issues\t.opened") == "issues.opened"


@given(value=any_text)
@hypothesis_settings(max_examples=300, deadline=None)
def test_log_values_are_quoted_exactly_when_they_need_it(value):
    from switchboard import logfmt

    needs = not value or any(ch in value for ch in ' "=\n')
    expected = ('"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
                if needs else value)
    assert logfmt._quote(value) == expected
