"""Strict JSON for everything that arrives from outside (webhooks, the operator API, MCP, the
board's result field).

Python's json accepts ``NaN``, ``Infinity`` and number literals that overflow to ``inf``; none
of them is JSON and neither database can store them, so they are refused at the door with a
ValueError, like any other malformed text. Over-deep nesting raises ValueError too (not
RecursionError), so callers have one exception to turn into a 400 / -32700.
"""

import json
import math


def _refuse_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text):
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def loads_strict(text):
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
