"""The one SSE framer every stream uses (switchboard/http/sse.py): the bytes of an event, a
comment and a retry hint, read back with the line rules of the SSE spec (CR, LF and CRLF all
end a line)."""

import json
import re
from datetime import timedelta

from switchboard.http import sse


def parse_stream(raw: bytes) -> list[dict]:
    """Blocks of ``field -> [values]``, comments under ``":"``, as an EventSource reads them."""
    blocks, fields = [], {}
    for line in re.split(r"\r\n|\r|\n", raw.decode()):
        if line == "":
            if fields:
                blocks.append(fields)
            fields = {}
            continue
        name, _, value = line.partition(":")
        fields.setdefault(name or ":", []).append(value[1:] if value.startswith(" ") else value)
    assert not fields, "the stream must end with a blank line"
    return blocks


def test_an_event_has_its_id_type_and_json_data_on_one_line():
    assert sse.event("todo", {"a": 1}, event_id=7) == b'id: 7\nevent: todo\ndata: {"a":1}\n\n'
    assert sse.event("sync", {}) == b"event: sync\ndata: {}\n\n"


def test_newlines_in_event_data_stay_inside_the_json_string():
    frame = sse.event("message", {"title": "a\nb\r\nc\rd"})
    (block,) = parse_stream(frame)
    assert block["event"] == ["message"]
    (data,) = block["data"]
    assert json.loads(data) == {"title": "a\nb\r\nc\rd"}


def test_event_data_is_utf8_not_escaped():
    frame = sse.event("message", {"title": "café ✓"})
    assert "café ✓".encode() in frame


def test_a_comment_of_several_lines_keeps_each_line_and_cannot_make_a_field():
    assert sse.comment("keep-alive") == b": keep-alive\n\n"
    assert sse.comment("two\nlines") == b": two\n: lines\n\n"
    text = "one\rdata: smuggled\r\nevent: x\n\nretry: 1"
    (block,) = parse_stream(sse.comment(text))
    assert set(block) == {":"}
    assert block[":"] == ["one", "data: smuggled", "event: x", "", "retry: 1"]


def test_an_empty_comment_is_one_comment_line():
    assert sse.comment() == b": \n\n"
    assert sse.comment("") == b": \n\n"


def test_the_retry_hint_is_in_milliseconds():
    assert sse.retry(timedelta(seconds=2)) == b"retry: 2000\n\n"
    assert sse.retry(timedelta(milliseconds=1500)) == b"retry: 1500\n\n"
