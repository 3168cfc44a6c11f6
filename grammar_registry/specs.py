"""Grammar specs: what a caller wants compiled, in one canonical form, and the cache key for it.

A spec is the grammar itself plus the options that change the compiled result. Options that only
change how the result is judged (fidelity policy) or used (whitespace-run guard) stay out of the
key, so one compiled grammar serves them all.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

GrammarKind = Literal[
    "json_schema", "json_object", "regex", "choice", "ebnf", "lark", "structural_tag"
]

# Bumped when the canonical form or the cached verdict layout changes: old entries are then unseen.
KEY_FORMAT = "v1"


class GrammarOptions(BaseModel):
    """Options that change the compiled grammar (JSON kinds only; others normalize to defaults)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_whitespace_cnt: int | None = Field(default=8, ge=1)
    compact: bool = False
    strict: bool = True


class GrammarSpec(BaseModel):
    """`source`: a JSON Schema dict, a regex / EBNF / Lark string, a list of choices, a structural
    tag dict, or None for `json_object`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: GrammarKind
    source: Any = None
    options: GrammarOptions = GrammarOptions()

    @model_validator(mode="after")
    def _source_matches_kind(self) -> GrammarSpec:
        expected: dict[str, type | None] = {
            "json_schema": dict,
            "json_object": None,
            "regex": str,
            "choice": list,
            "ebnf": str,
            "lark": str,
            "structural_tag": dict,
        }
        want = expected[self.kind]
        if want is None and self.source is not None:
            raise ValueError(f"{self.kind}: takes no source")
        if want is not None and not isinstance(self.source, want):
            raise ValueError(f"{self.kind}: source must be a {want.__name__}")
        if self.kind == "choice" and not all(isinstance(c, str) for c in self.source):
            raise ValueError("choice: every choice must be a string")
        return self

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_schema", "json_object")

    def canonical(self) -> str:
        """Sorted, separator-free JSON; options normalized where they cannot matter."""
        options = self.options if self.is_json else GrammarOptions()
        if self.is_json and options.compact:
            options = GrammarOptions(max_whitespace_cnt=None, compact=True, strict=options.strict)
        body = {"kind": self.kind, "source": self.source, "options": options.model_dump()}
        return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    def digest(self) -> str:
        return hashlib.sha256(self.canonical().encode()).hexdigest()

    def size_bytes(self) -> int:
        return len(self.canonical().encode())


def grammar_key(
    spec: GrammarSpec, *, backend_version: str, serialization: str, tokenizer: str, scope: str
) -> str:
    """`structserve:grammar:<format>:<backend>:<serialization>:<tokenizer>:<scope>:<kind>:<sha>`.

    `scope` is `shared` for inline grammars and the tenant for registered ones, so one tenant can
    never observe (by timing) whether another registered the same grammar.
    """
    parts = (KEY_FORMAT, backend_version, serialization, tokenizer[:16], scope, spec.kind)
    return "structserve:grammar:" + ":".join(parts) + ":" + spec.digest()
