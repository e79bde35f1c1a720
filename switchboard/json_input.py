"""Strict JSON for everything that arrives from outside (webhooks, the operator API, MCP, the
board's result field).

Python's json accepts ``NaN``, ``Infinity`` and number literals that overflow to ``inf``; none
of them is JSON and neither database can store them, so they are refused at the door with a
ValueError, like any other malformed text. Nesting deeper than ``MAX_JSON_DEPTH`` raises
``TooDeep`` (a ValueError naming the limit) before the decoder runs, so callers have one
exception to turn into a 400 / -32700 and no deep document ever reaches code that walks it
recursively (or a later check that would refuse it as a 500).
"""

import json
import math
import re

from django import forms
from django.core.exceptions import ValidationError
from django.db import models
from django.forms.fields import InvalidJSONInput

# Arrays and objects inside one another (docs/security.md#bad-input-is-a-400-never-a-500); no real
# payload comes close.
MAX_JSON_DEPTH = 100

# A JSON string literal, removed before counting brackets. It cannot fail to match (an
# unterminated string runs to the end), so the scan stays one pass: a failing pattern restarted
# at every later quote, quadratic in the body (bench/PROFILES.md).
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.|\\\Z)*(?:"|\Z)', re.DOTALL)
_NOT_BRACKET_RE = re.compile(r"[^\[\]{}]+")
# The escapes that decode to NUL or to a surrogate (``is_plainly_storable``).
_RISKY_ESCAPE_RE = re.compile(r"\\u(?:0000|[dD][89a-fA-F])")
# An innermost pair once everything but brackets is gone: peeling them off once per level.
_INNERMOST_PAIR_RE = re.compile(r"\[\]|\{\}")


class TooDeep(ValueError):
    def __init__(self, limit: int = MAX_JSON_DEPTH):
        super().__init__(f"JSON nested deeper than {limit} levels (the limit is {limit})")
        self.limit = limit


def check_depth(text: str, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise TooDeep when ``text`` nests arrays/objects more than ``limit`` deep. Malformed text
    is left to the decoder (an unbalanced bracket just stops the peeling)."""
    if text.count("[") + text.count("{") <= limit:
        return  # cannot nest deeper than it has openers: the common small body costs nothing
    brackets = _NOT_BRACKET_RE.sub("", _STRING_RE.sub("", text))
    for _ in range(limit):
        peeled = _INNERMOST_PAIR_RE.sub("", brackets)
        if not peeled or peeled == brackets:
            return
        brackets = peeled
    # ``limit`` levels peeled and brackets remain: is there one more balanced level?
    if _INNERMOST_PAIR_RE.search(brackets):
        raise TooDeep(limit)


def count_containers(text: str, limit: int) -> int:
    """How many arrays and objects ``text`` opens, brackets inside strings not counted, exactly
    when that is more than ``limit`` (else a number at most ``limit``). C-speed passes only:
    it runs before the decoder, on text nobody vouches for."""
    quick = text.count("[") + text.count("{")
    if quick <= limit:
        return quick
    outside_strings = _STRING_RE.sub("", text)
    return outside_strings.count("[") + outside_strings.count("{")


def _refuse_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text):
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def is_plainly_storable(text: str) -> bool:
    """True when the value ``loads_strict(text)`` returns needs no walk to know that both
    databases store it (``unstorable_reason`` is None for it), decided on the
    text at C speed. What that walk looks for, and why none of it can be there:

    * NUL or a lone surrogate in a string or key: the decoder refuses raw control characters in
      strings, ``text`` encoding as UTF-8 means it holds no raw lone surrogate, and the only
      escapes that decode to either are ``\\u0000`` and ``\\uD800``-``\\uDFFF``
      (``_RISKY_ESCAPE_RE``; a surrogate pair is walked too, the price of a one-pass check);
    * a number that is not finite: ``loads_strict`` refuses NaN, Infinity and overflows;
    * nesting deeper than MAX_JSON_DEPTH: impossible with at most that many openers.

    False says only "walk it"; callers run the full check then."""
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH or (
            "\\" in text and _RISKY_ESCAPE_RE.search(text)):
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unstorable_reason(value) -> str | None:
    """Why ``value`` (JSON-shaped: dicts, lists, str, numbers) cannot be stored as given by both
    databases, or None. PostgreSQL's text and jsonb refuse NUL characters and lone surrogates,
    and neither database stores NaN or Infinity as JSON; refusing them up front turns a failed
    write (a 5xx the sender would retry forever) into a clear argument error. Callers say
    which field: ``f"{name} {reason}"``."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return f"is nested deeper than {MAX_JSON_DEPTH} levels"
        if isinstance(item, str):
            if "\x00" in item:
                return "contains a NUL character (\\u0000)"
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return "is not valid Unicode (a lone surrogate)"
        elif isinstance(item, float):
            if not math.isfinite(item):
                return "contains a number that is not finite (NaN, Infinity or out of range)"
        elif isinstance(item, dict):
            stack.extend((key, depth + 1) for key in item)
            stack.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((child, depth + 1) for child in item)
    return None


def find_unstorable(values: dict) -> str | None:
    """The first of ``values`` (name -> JSON-shaped value) that cannot be stored, as
    ``"<name> <reason>"`` for an argument error naming it, or None."""
    for name, value in values.items():
        reason = unstorable_reason(value)
        if reason is not None:
            return f"{name} {reason}"
    return None


def loads_strict(text):
    # Bytes are counted as latin-1: brackets, quotes and backslashes are ASCII, and no byte of a
    # UTF-8 multi-byte character is; the decoder still gets the bytes as given.
    check_depth(text.decode("latin-1") if isinstance(text, (bytes, bytearray)) else text)
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise TooDeep() from None


class StorableJSONFormField(forms.JSONField):
    """The admin's JSON field, held to what the database stores: strict JSON (no NaN or
    Infinity) without NUL characters or lone surrogates, refused as a form error on the field
    instead of failing the write, and shown back as typed (Django's own field would decode a
    lone surrogate for display and fail to encode the page)."""

    def to_python(self, value):
        if self.disabled or value in self.empty_values or not isinstance(value, str):
            return super().to_python(value)
        try:
            converted = loads_strict(value)
        except ValueError as exc:
            raise ValidationError(f"not valid JSON ({exc})", code="invalid") from None
        reason = unstorable_reason(converted)
        if reason is not None:
            raise ValidationError(f"this value {reason}", code="unstorable")
        return super().to_python(value)

    def bound_data(self, data, initial):
        value = super().bound_data(data, initial)
        if not isinstance(value, InvalidJSONInput) and unstorable_reason(value) is not None:
            return InvalidJSONInput(data)
        return value


# Give every JSONField of a ModelAdmin or inline the storable form field.
ADMIN_FORMFIELD_OVERRIDES = {models.JSONField: {"form_class": StorableJSONFormField}}
