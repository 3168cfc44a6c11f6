"""Outputs that finish: what JSON Schema leaves unbounded, bounded where no client could use more.

With `max_tokens` defaulting to the context left, a loop inside constrained output costs the
whole context: a small model asked for a population writes `1112200000000000000000...` until
the end, because the grammar allows any number of digits. So, unless the caller opts out
(`StructuredOutput.bound_numbers=False`, `max_repeat_run=None`):
- an integer without bounds gets the 64-bit range (what every JSON parser downstream holds);
- a number without bounds gets +-1e15, which xgrammar enforces with a cap on digits (15 before
  the point, 6 after, no exponent);
- a request whose last `max_repeat_run` tokens repeat one unit of up to `MAX_UNIT` tokens inside
  a string (`"hahaha..."`, `"0000..."`, `"image:image:..."`) ends early with a warning instead of
  burning its budget. A unit with a quote crosses strings (the items of an array), and one of
  digits, literals and commas is a list of values: both are data, and left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.grammar.fidelity import VALUE_KEYWORDS

INT64 = (-(2**63), 2**63 - 1)
NUMBER_LIMIT = 1e15
MAX_UNIT = 16  # tokens in the repeated unit (digits are one token each: "1234567890" is 10)
# a bound inside these would widen what the schema allows: `not: {type: integer}` bounded
# refuses only in-range integers, and `if` bounded sends out-of-range ones to `else`
_CONDITIONS = frozenset({"not", "if"})
_VALUES = frozenset("0123456789.-+eE \n\r\t,[]{}truefalsn")  # a list of numbers, literals


def _types(node: dict[str, Any]) -> set[str]:
    kind = node.get("type")
    if isinstance(kind, str):
        return {kind}
    return {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else set()


def _bound(node: dict[str, Any], low: float, high: float) -> dict[str, Any]:
    out = dict(node)
    if "minimum" not in node and "exclusiveMinimum" not in node:
        out["minimum"] = low
    if "maximum" not in node and "exclusiveMaximum" not in node:
        out["maximum"] = high
    return out


def bounded(schema: Any) -> Any:
    """The schema with every unbounded integer and number bounded (a copy; the caller's schema
    is not changed). A node that also allows other types is left as it is."""
    if isinstance(schema, list):
        return [bounded(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: (v if k in VALUE_KEYWORDS or k in _CONDITIONS else bounded(v)) for k, v in schema.items()
    }
    types = _types(schema)
    if types == {"integer"}:
        return _bound(out, *INT64)
    if types == {"number"} or types == {"integer", "number"}:
        return _bound(out, -NUMBER_LIMIT, NUMBER_LIMIT)
    return out


def repeated_unit(tail: list[int], decode: Callable[[list[int]], str]) -> str | None:
    """The unit `tail` repeats throughout, when it is at most `MAX_UNIT` tokens and inside a
    string (`"ha" * 64` is a loop; `0, 0, 0, ...` and `"a", "a", ...` are data); else None."""
    for period in range(1, MAX_UNIT + 1):
        if len(tail) > 2 * period and tail[period:] == tail[:-period]:
            unit = decode(tail[-period:])
            data = '"' in unit or ("," in unit and set(unit) <= _VALUES)
            return None if data else unit
    return None
