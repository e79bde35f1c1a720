"""A doorbell's ``meta``: identifier-safe keys and values (``switchboard.harness_text``'s
alphabet), a list of names as one value. Pure functions, no Django."""

import re

from switchboard.harness_text import META_VALUE_MAX_CHARS, sanitize_meta_value

META_KEY_RE = re.compile(r"^[a-z_][a-z0-9_]*$")
# Joins the names of a list-valued meta entry (the digest's ``queues``). A comma never
# comes from a value itself (values are held to the alphabet), so splitting on it is exact.
META_LIST_SEPARATOR = ","


def sanitize_meta_list(values) -> str:
    """Several names as one meta value: each sanitised, joined by META_LIST_SEPARATOR, the
    whole clipped to META_VALUE_MAX_CHARS."""
    return META_LIST_SEPARATOR.join(
        sanitize_meta_value(value) for value in values)[:META_VALUE_MAX_CHARS]


def build_meta(pairs) -> dict:
    """String meta from ``(key, value)`` pairs: keys must be identifier-safe (they are ours,
    so a bad one is a bug), values sanitised, empty values left out. A list or tuple value is
    a list (see sanitize_meta_list)."""
    meta = {}
    for key, value in pairs:
        if not META_KEY_RE.match(key):
            raise ValueError(f"meta key {key!r} is not identifier-safe")
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            text = sanitize_meta_list(value)
        else:
            text = sanitize_meta_value(value)
        if text:
            meta[key] = text
    return meta
