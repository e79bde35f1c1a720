"""A key=value log formatter (logfmt), so every line can be grepped and parsed.

Call sites pass context as ``extra={"endpoint": slug, "todo_id": id}``; those keys are printed
after the message. Nothing here redacts: the rule is that callers never pass a bearer, a secret
or a body, and tests capture logs to hold them to it.
"""

import logging
import re

_STANDARD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}
# A value with any of these is quoted. One regex search, not a generator per value: every
# request logs a line or two, and the per-character loop showed in the hook's profile.
_NEEDS_QUOTES = re.compile(r'[ "=\n]')


def _quote(value):
    text = str(value)
    if not text or _NEEDS_QUOTES.search(text):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
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
