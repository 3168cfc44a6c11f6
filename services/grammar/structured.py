"""`StructuredOutput`: what a request's output must parse as, and the backends that may build it.

The grammar layer's one request-side type: the engine, the compile service and the HTTP layer all
take it from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

_STRUCTURED_KINDS = (
    "json_schema",
    "json_object",
    "regex",
    "choice",
    "grammar",
    "structural_tag",
    "grammar_id",
)


GRAMMAR_BACKENDS = ("xgrammar", "llguidance")  # built in services/grammar/backends.py
BACKENDS = (*GRAMMAR_BACKENDS, "auto")  # a request pins one of the first two; an engine any


def check_name(field: str, name: str | None) -> None:
    if name is not None and name not in BACKENDS:
        raise ValueError(f"{field}: {name!r} is not one of {', '.join(BACKENDS)}")


MAX_WHITESPACE_CNT = 8  # whitespace characters in a row inside JSON, by default


@dataclass(frozen=True)
class StructuredOutput:
    """Constrains the output to a grammar: exactly one of the kinds below is set.

    Options:
    - `max_whitespace_cnt`: most whitespace characters in a row inside JSON (None: unbounded);
    - `compact`: JSON without optional whitespace, separators `,` and `:`;
    - `strict`: xgrammar's strict mode: a schema without `additionalProperties` allows none;
    - `fidelity`: `warn` compiles a schema with keywords the grammar cannot enforce and lists them
      in `warnings`; `strict` refuses it;
    - `grammar_syntax`: for `grammar`, `ebnf` (GBNF `::=` rules), `lark`, or `auto` (detected);
    - `max_whitespace_run`: a request whose last tokens are this many whitespace-only tokens ends
      with an error instead of running to `max_tokens`;
    - `bound_numbers`: integers without bounds get the 64-bit range, numbers a cap on digits;
    - `max_repeat_run`: a request whose last this many tokens repeat one short unit inside a
      string ends early with a warning (None: never). Both: services/grammar/finish.py.
    """

    json_schema: dict[str, Any] | str | type | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | None = None
    grammar_id: str | None = None
    max_whitespace_cnt: int | None = MAX_WHITESPACE_CNT
    compact: bool = False
    strict: bool = True
    fidelity: Literal["warn", "strict"] = "warn"
    grammar_syntax: Literal["auto", "ebnf", "lark"] = "auto"
    max_whitespace_run: int = 64
    bound_numbers: bool = True
    max_repeat_run: int | None = 128
    backend: str | None = None  # pins a grammar backend (GRAMMAR_BACKENDS); None: the engine's

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in GRAMMAR_BACKENDS:
            raise ValueError(
                f"structured.backend: {self.backend!r} is not one of xgrammar, llguidance"
            )
        chosen = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(
                f"structured: exactly one of {', '.join(_STRUCTURED_KINDS)} must be set, got "
                f"{chosen or 'none'}"
            )
        if self.choice is not None and not self.choice:
            raise ValueError("structured.choice: must hold at least one string")
        if self.max_whitespace_cnt is not None and self.max_whitespace_cnt < 1:
            raise ValueError("structured.max_whitespace_cnt: must be >= 1 or None")
        if self.fidelity not in ("warn", "strict"):
            raise ValueError(f"structured.fidelity: {self.fidelity!r} is not 'warn' or 'strict'")
        if self.grammar_syntax not in ("auto", "ebnf", "lark"):
            raise ValueError("structured.grammar_syntax: must be 'auto', 'ebnf' or 'lark'")
        if self.max_whitespace_run < 1:
            raise ValueError("structured.max_whitespace_run: must be >= 1")
        if self.max_repeat_run is not None and self.max_repeat_run < 8:
            raise ValueError("structured.max_repeat_run: must be >= 8 or None")

    @property
    def kind(self) -> str:
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))
