"""Each tenant's record of the grammar families whose members proved too slow to mask
(grammar_registry/family.py says what a family is and what a slow member teaches the others).

A record is a `Verdict` whose `slow` lists the members (their counts, and the text that reached
their slow mask), kept in the verdict cache beside the tenant's own refusals: like them it is the
tenant's alone, since decoding it steered or the load it ran under may have caused it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grammar_registry.cache import Verdict
from grammar_registry.family import MAX_FAMILY_PATHS, MAX_PATH_CHARS, Family, family_of
from grammar_registry.specs import GrammarSpec

DOMINATED = (
    "masks were too slow for a grammar of the same structure whose upper bounds are at most "
    "these (and other counts equal)"
)


class FamilyRecords:
    def __init__(
        self,
        key: Callable[[str, Family, str, str], str],
        get: Callable[[str], Verdict | None],
        put: Callable[[str, Verdict], None],
    ) -> None:
        self._key = key  # (kind, family, scope, tenant) -> where the tenant's record lives
        self._get, self._put = get, put

    def judge(self, spec: GrammarSpec, scope: str, tenant: str) -> tuple[Verdict | None, list[str]]:
        """A refusal when a slow member of the tenant's record is dominated by `spec`; else
        None and the slow texts its probe should replay first."""
        family = family_of(spec)
        slow = self._slow(spec.kind, family, scope, tenant)
        if family is not None and any(family.dominates(m["counts"]) for m in slow):
            return Verdict(ok=False, reason="slow_mask", error=DOMINATED), []
        return None, [m["path"] for m in slow if m.get("path")]

    def add(self, spec: GrammarSpec, scope: str, tenant: str, path: str) -> None:
        """Adds a slow member to the tenant's record of its family (the newest
        `MAX_FAMILY_PATHS` are kept; a path past `MAX_PATH_CHARS` is dropped, its counts kept)."""
        family = family_of(spec)
        if family is None:
            return
        member = {
            "counts": list(family.counts),
            "path": path if len(path) <= MAX_PATH_CHARS else "",
        }
        slow = [m for m in self._slow(spec.kind, family, scope, tenant) if m != member]
        record = Verdict(
            ok=False, reason="slow_mask", error="family", slow=[*slow, member][-MAX_FAMILY_PATHS:]
        )
        self._put(self._key(spec.kind, family, scope, tenant), record)

    def _slow(self, kind: str, family: Family | None, scope: str, tenant: str) -> list[Any]:
        if family is None:
            return []
        found = self._get(self._key(kind, family, scope, tenant))
        return list(found.slow) if found is not None else []
