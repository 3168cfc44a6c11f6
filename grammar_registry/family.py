"""Families of grammars: the same structure with other counts.

A grammar refused because its masks proved too slow can come back with one repetition more or
one less: a new grammar, a new key, a new compile, and (before decoding held masks to a deadline)
a new stall each. A grammar's family is its canonical form with every count taken out: the
bounds of regex quantifiers (`{m}`, `{m,}`, `{m,n}`, in a regex, a JSON Schema `pattern` or a
grammar's text) and JSON Schema's size keywords (`minLength`, `maxItems`, ...). Its counts are
those numbers in order.

What a family's slow member teaches the others (services/compiler/service.py):
- **Dominated members are refused without a compile**: those whose upper bounds (the `n` of
  `{m,n}`, the `max*` keywords) are each at least the slow member's, every other count equal.
  Raising an upper bound only adds optional copies of the repeated part: the slow member's slow
  text is still a path of the member, and at each point of it the member's parser holds every
  state the slow member's did, and more. Lower bounds and exact counts make copies mandatory
  rather than adding them, so no such order holds for them; numeric values (`minimum`,
  `multipleOf`) and literals are not counts at all and stay part of the structure.
- **The others are probed where the slow member was slow.** The text that reached the slow mask
  is replayed first by their probe (`probe.py`), so a member with a smaller bound, or another
  exact count, is refused for masks it shows itself, never for its family's alone.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from grammar_registry.specs import GrammarSpec

COUNT_KEYWORDS = (
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
)
# A quantifier's bounds (in JSON text: a regex's braces are never escaped there), or a size
# keyword's value; one pass, so the counts come out in the text's order.
_COUNTS = re.compile(
    r"\{(?P<low>\d{1,9})(?P<comma>,(?P<high>\d{1,9})?)?\}"
    r'|"(?P<keyword>' + "|".join(COUNT_KEYWORDS) + r')":(?P<value>\d{1,18})(?=[,}])'
)
MAX_FAMILY_PATHS = 8  # slow paths kept per family (the newest)
MAX_PATH_CHARS = 4096  # a longer path is not kept (the counts still are)


@dataclass(frozen=True)
class Family:
    key: str  # sha256 of the canonical form with its counts taken out
    counts: tuple[int, ...]
    upper: tuple[bool, ...]  # which counts are upper bounds (the same in the whole family)

    def dominates(self, slow: list[int] | tuple[int, ...]) -> bool:
        """Upper bounds each at least the slow member's, every other count equal: its masks
        along the slow member's slow text are at least as slow."""
        if len(slow) != len(self.counts):
            return False
        pairs = zip(self.counts, slow, self.upper, strict=True)
        return all(c >= s if up else c == s for c, s, up in pairs)


def family_of(spec: GrammarSpec) -> Family | None:
    """The spec's family, or None when it has no counts (its family is itself)."""
    counts: list[int] = []
    upper: list[bool] = []

    def take(m: re.Match[str]) -> str:
        keyword = m["keyword"]
        if keyword is not None:
            counts.append(int(m["value"]))
            upper.append(keyword.startswith("max"))
            return f'"{keyword}":#'
        counts.append(int(m["low"]))
        upper.append(False)
        if m["high"] is not None:
            counts.append(int(m["high"]))
            upper.append(True)
        return "{#" + ("" if m["comma"] is None else ",#" if m["high"] is not None else ",") + "}"

    text = _COUNTS.sub(take, spec.canonical())
    if not counts:
        return None
    return Family(hashlib.sha256(text.encode()).hexdigest(), tuple(counts), tuple(upper))
