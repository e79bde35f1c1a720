"""A key=value log formatter (logfmt), so every line can be grepped and parsed.

Call sites pass context as ``extra={"endpoint": slug, "todo_id": id}``; those keys are printed
after the message. Nothing here redacts: the rule is that callers never pass a bearer, a secret
or a body, and tests capture logs to hold them to it.
"""

import logging
import re

_STANDARD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}
# What a terminal or log viewer acts on (controls, bidi and zero-width characters, line
# separators): a sender's text in a log value is written as \uXXXX, never raw.
_UNSAFE = "\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff"
# A value with any of these (or a backslash, doubled when quoted, so a literal "\u202e" never
# reads as an escape) is quoted; one regex search, as every request logs a line or two.
_NEEDS_QUOTES = re.compile(f'[ "=\\\\{_UNSAFE}]')
_UNSAFE_CHARACTER = re.compile(f"[{_UNSAFE}]")


def _escape(match) -> str:
    character = match.group()
    return "\\n" if character == "\n" else f"\\u{ord(character):04x}"


def _quote(value):
    text = str(value)
    if not text or _NEEDS_QUOTES.search(text):
        text = text.replace("\\", "\\\\").replace('"', '\\"')
        text = '"' + _UNSAFE_CHARACTER.sub(_escape, text) + '"'
    return text


class KeyValueFormatter(logging.Formatter):
    def format(self, record):
        fields = {
            "at": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                fields[key] = value
        line = " ".join(f"{key}={_quote(value)}" for key, value in fields.items())
        if record.exc_info:
            line += " exc=" + _quote(self.formatException(record.exc_info))
        return line
