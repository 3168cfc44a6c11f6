"""Between a request's `StructuredOutput` and the registry's `GrammarSpec`, and the one key.

`GrammarSpec.canonical()` is the canonical form of a grammar: the compile cache keys by its digest
(`grammar_registry.specs.grammar_key`), and `structured_key` builds on it.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from grammar_registry.specs import GrammarOptions, GrammarSpec
from services.grammar.backend import GrammarError
from services.grammar.structured import StructuredOutput
from services.grammar.xgrammar_backend import grammar_syntax, json_schema_of


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


_GRAMMAR_FIELDS = frozenset({"json_schema", "json_object", "regex", "choice", "grammar"})
_GRAMMAR_FIELDS |= {"structural_tag", "grammar_id"}


def structured_key(so: StructuredOutput) -> str:
    """A request's grammar by one key: the spec's canonical form (`GrammarSpec.canonical`), or
    its `grammar_id`, then every option of `so` as given (how the grammar is judged and used as
    well as built). `GrammarError` for a spec that has no canonical form (a schema that is not
    JSON, say)."""
    grammar = (
        json.dumps({"grammar_id": so.grammar_id}) if so.grammar_id else to_spec(so).canonical()
    )
    options = {f.name: getattr(so, f.name) for f in fields(so) if f.name not in _GRAMMAR_FIELDS}
    return grammar + json.dumps(options, sort_keys=True, separators=(",", ":"))
