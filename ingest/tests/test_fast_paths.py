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
    assert titles.clean_kind(value) == walk(value).strip()[:titles.MAX_KIND_CHARS]


def test_control_characters_are_still_dropped():
    assert problems.one_line(" a\x00b\nc ", 10) == "abc"
    assert transitions._printable("d-\x1b[31m1", 10) == "d-[31m1"
    assert titles.clean_kind("issues\t.opened") == "issues.opened"


@given(value=any_text)
@hypothesis_settings(max_examples=300, deadline=None)
def test_log_values_are_quoted_exactly_when_they_need_it(value):
    from switchboard import logfmt

    needs = not value or any(ch in ' "=\\' or ch in TERMINAL_ACTS_ON for ch in value)
    expected = '"' + "".join(map(escaped, value)) + '"' if needs else value
    assert logfmt._quote(value) == expected


# What the log escapes, spelled out code point by code point (logfmt keeps it as a regex).
TERMINAL_ACTS_ON = {chr(code) for code in [*range(0x20), *range(0x7f, 0xa0), 0x61c,
                                           *range(0x200b, 0x2010), *range(0x2028, 0x202f),
                                           *range(0x2060, 0x206a), 0xfeff]}


def escaped(character: str) -> str:
    if character in '\\"':
        return "\\" + character
    if character == "\n":
        return "\\n"
    return f"\\u{ord(character):04x}" if character in TERMINAL_ACTS_ON else character


def test_a_logged_value_cannot_act_on_the_operators_terminal():
    from switchboard import logfmt

    assert logfmt._quote("B\u202eX\x07Y") == '"B\\u202eX\\u0007Y"'
    assert logfmt._quote("a\rb\x1b[2Jc") == '"a\\u000db\\u001b[2Jc"'
    assert logfmt._quote("line\nnext") == '"line\\nnext"'
    assert logfmt._quote("plain") == "plain"
    # A sender's literal backslash sequence is quoted and doubled: never mistaken for an escape.
    assert logfmt._quote("B\\u202eX") == '"B\\\\u202eX"'
