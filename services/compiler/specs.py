"""Between the engine's `StructuredOutput` and the registry's `GrammarSpec`."""

from __future__ import annotations

from typing import Any

from grammar_registry.specs import GrammarOptions, GrammarSpec
from services.engine.grammar.backend import GrammarError
from services.engine.grammar.xgrammar_backend import grammar_syntax, json_schema_of
from services.engine.params import StructuredOutput


def to_spec(so: StructuredOutput) -> GrammarSpec:
    """The canonical spec of an inline grammar (not for `grammar_id`, which names one)."""
    options = GrammarOptions(
        max_whitespace_cnt=so.max_whitespace_cnt, compact=so.compact, strict=so.strict
    )
    try:
        if so.json_schema is not None:
            return GrammarSpec(kind="json_schema", source=json_schema_of(so), options=options)
        if so.json_object:
            return GrammarSpec(kind="json_object", options=options)
        if so.regex is not None:
            return GrammarSpec(kind="regex", source=so.regex)
        if so.choice is not None:
            return GrammarSpec(kind="choice", source=list(so.choice))
        if so.grammar is not None:
            return GrammarSpec(kind=grammar_syntax(so), source=so.grammar)  # type: ignore[arg-type]
        if so.structural_tag is not None:
            return GrammarSpec(kind="structural_tag", source=so.structural_tag)
    except GrammarError:  # names its field already
        raise
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise GrammarError(f"structured.{so.kind}: {exc}") from exc
    raise GrammarError(f"structured.{so.kind}: names a registered grammar, not a spec")


def to_structured(spec: GrammarSpec) -> StructuredOutput:
    """A `StructuredOutput` that compiles to exactly `spec` (fidelity `warn`: the caller judges)."""
    opts = spec.options
    json_opts: dict[str, Any] = {
        "max_whitespace_cnt": opts.max_whitespace_cnt,
        "compact": opts.compact,
        "strict": opts.strict,
    }
    if spec.kind == "json_schema":
        return StructuredOutput(json_schema=spec.source, **json_opts)
    if spec.kind == "json_object":
        return StructuredOutput(json_object=True, **json_opts)
    if spec.kind == "regex":
        return StructuredOutput(regex=spec.source)
    if spec.kind == "choice":
        return StructuredOutput(choice=list(spec.source))
    if spec.kind in ("ebnf", "lark"):
        return StructuredOutput(grammar=spec.source, grammar_syntax=spec.kind)
    return StructuredOutput(structural_tag=spec.source)


def schema_of(spec: GrammarSpec) -> dict[str, Any] | None:
    """The schema a JSON output is validated against (None for other kinds)."""
    if spec.kind == "json_schema":
        return dict(spec.source)
    if spec.kind == "json_object":
        return {"type": "object"}
    return None
