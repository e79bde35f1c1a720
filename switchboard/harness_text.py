"""Untrusted text an agent's harness can show without being steered by it
(docs/reference.md#doorbells).

A doorbell's ``content`` and ``meta`` are rendered by the agent's harness inside a
``<channel …>…</channel>`` wrapper, next to the harness's own tags (``<system-reminder>`` and
the like). Titles, kinds and sources come from the open internet, so no spelling of a tag may
survive: blocklisting ``</channel>`` lost to zero-width characters, fullwidth forms and
attributes. Instead every ``<`` and ``>`` is replaced, after NFKC — NFKC turns
``＜`` (U+FF1C), ``﹤`` (U+FE64) and friends INTO ``<``, so replacing first would let them back
in — and control, format, private-use and surrogate characters (ANSI escapes, bidi overrides,
zero-width joiners) are removed. Meta values are held to a small alphabet, so a value can never
close an attribute or open a tag whatever the harness does with quoting.

Pure functions, no Django, below every app: ingest stores titles through ``sanitize_content``,
the MCP session keeps its client's name and version through ``sanitize_meta_value``, and every
doorbell frame (``channels_push.doorbells``, whose ``text`` builds the meta from these) passes
all of its text through here.
"""

import re
import unicodedata

# Visible stand-ins for the angle brackets: single guillemets read as brackets to a human and
# to a model, and NFKC leaves them alone (they are not compatibility forms of < or >).
LESS_THAN_SUBSTITUTE = "\u2039"  # ‹
GREATER_THAN_SUBSTITUTE = "\u203a"  # ›
_ANGLE_BRACKETS = str.maketrans({"<": LESS_THAN_SUBSTITUTE, ">": GREATER_THAN_SUBSTITUTE})
# Cc: C0/C1 controls (ESC of an ANSI sequence, NUL, DEL); Cf: format characters (bidi overrides
# and isolates, zero-width space/joiners, soft hyphen, tag characters); Co: private use; Cs:
# lone surrogates (not even encodable as UTF-8).
REMOVED_CATEGORIES = frozenset({"Cc", "Cf", "Co", "Cs"})
META_VALUE_ALPHABET_RE = re.compile(r"^[A-Za-z0-9_.:/@#+\-]*$")
_OFF_ALPHABET_RE = re.compile(r"[^A-Za-z0-9_.:/@#+\-]")
META_VALUE_SUBSTITUTE = "_"
META_VALUE_MAX_CHARS = 200


def _fold_whitespace(text: str) -> str:
    # str.split() splits on every Unicode whitespace, line and paragraph separators included.
    return " ".join(text.split())


def sanitize_content(text) -> str:
    """One line of untrusted text, safe inside ``<channel>…</channel>``: whitespace runs
    (newlines included) folded to one space, NFKC-normalised, Cc/Cf/Co/Cs characters removed,
    and every ``<`` / ``>`` replaced by ‹ / ›. Idempotent."""
    text = unicodedata.normalize("NFKC", _fold_whitespace(str(text)))
    text = "".join(ch for ch in text if unicodedata.category(ch) not in REMOVED_CATEGORIES)
    # Folded again: NFKC turns compatibility spaces (U+3000, U+00A0) into plain ones.
    return _fold_whitespace(text.translate(_ANGLE_BRACKETS))


def sanitize_meta_value(value) -> str:
    """A meta value over ``[A-Za-z0-9_.:/@#+-]``, at most META_VALUE_MAX_CHARS: whitespace
    trimmed and folded, NFKC (so fullwidth letters stay legible), then every other character
    replaced by ``_``. Clipped without an ellipsis, which would itself be off the alphabet."""
    text = unicodedata.normalize("NFKC", _fold_whitespace(str(value)))
    return _OFF_ALPHABET_RE.sub(META_VALUE_SUBSTITUTE, text)[:META_VALUE_MAX_CHARS]
