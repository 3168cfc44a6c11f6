"""xgrammar as the grammar backend."""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

from services.grammar.backend import (
    CompiledGrammar,
    GrammarError,
    allocate_bitmask,
    apply_bitmask,
    load_json_text,
)
from services.grammar.fidelity import loosened_in_tag, loosened_keywords, remote_refs
from services.grammar.finish import bounded
from services.grammar.fold import folded
from services.grammar.structured import StructuredOutput

# The compiler's own cache is unbounded by default (a memory DoS); ours sits in front of it.
COMPILER_CACHE_BYTES = 256 << 20


def json_schema_of(spec: StructuredOutput) -> dict[str, Any]:
    """The schema the grammar is compiled from (unbounded numbers bounded unless asked not to)."""
    assert spec.json_schema is not None
    schema = schema_dict(spec.json_schema)
    remote = remote_refs(schema)
    if remote:
        raise GrammarError(
            f"structured.json_schema: a remote $ref is not fetched ({remote[0]}); put the schema "
            "it names under $defs and refer to it as #/$defs/NAME"
        )
    return bounded(schema) if spec.bound_numbers else schema


def schema_dict(schema: dict[str, Any] | str | type) -> dict[str, Any]:
    """A JSON Schema as a dict, from a dict, a JSON string or a pydantic model class."""
    if isinstance(schema, dict):
        return schema
    if isinstance(schema, str):
        loaded = load_json_text(schema, "structured.json_schema")
        if not isinstance(loaded, dict):
            raise GrammarError("structured.json_schema: must be a JSON object")
        return loaded
    if hasattr(schema, "model_json_schema"):
        return schema.model_json_schema()
    raise GrammarError(f"structured.json_schema: unsupported type {type(schema).__name__}")


def grammar_syntax(spec: StructuredOutput) -> str:
    """'ebnf' (GBNF-style `::=` rules) or 'lark' (`rule: ...`), detected unless named."""
    if spec.grammar_syntax != "auto":
        return spec.grammar_syntax
    return "ebnf" if "::=" in (spec.grammar or "") else "lark"


def _json_layout(spec: StructuredOutput) -> dict[str, Any]:
    """Whitespace options: compact JSON has none; otherwise runs of it are capped."""
    if spec.compact:
        return {"any_whitespace": False, "separators": (",", ":")}
    return {"any_whitespace": True, "max_whitespace_cnt": spec.max_whitespace_cnt}


def _clean_message(exc: Exception) -> str:
    """xgrammar's first error line without its `[time] source.cc:line:` prefix."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", first)[:300]


def fidelity_error(warnings: list[str]) -> GrammarError:
    return GrammarError(
        "structured.json_schema: keywords the grammar cannot enforce: " + "; ".join(warnings),
        reason="fidelity",
    )


class XGrammarState:
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._m = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        return bool(self._m.fill_next_token_bitmask(bitmask, row))

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def jump_forward(self) -> str:
        return str(self._m.find_jump_forward_string())

    def accept_string(self, text: str) -> bool:
        """Accepts text the grammar forces without tokenizing it (the compile probe)."""
        return bool(self._m.accept_string(text))


class XGrammarBackend:
    def __init__(
        self,
        tokenizer: Any = None,
        vocab_size: int = 0,
        stop_token_ids: list[int] | None = None,
        *,
        tokenizer_info: xgr.TokenizerInfo | None = None,
        cache: bool = True,
    ):
        """From a Hugging Face tokenizer, or from an xgrammar `tokenizer_info` (compile workers)."""
        if tokenizer_info is None:
            tokenizer_info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
            )
        self.tokenizer_info = tokenizer_info
        self.vocab_size = vocab_size or tokenizer_info.vocab_size
        self._compiler = xgr.GrammarCompiler(
            tokenizer_info,
            max_threads=1,
            cache_enabled=cache,
            cache_limit_bytes=COMPILER_CACHE_BYTES,
        )

    def load(self, blob_json: str) -> Any:
        """A compiled handle from `serialize_json()` text; raises if made for another tokenizer
        or serialization version."""
        return xgr.CompiledGrammar.deserialize_json(blob_json, self.tokenizer_info)

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        try:
            return self._compile(spec)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError on invalid input
            raise GrammarError(f"structured.{spec.kind}: {_clean_message(exc)}") from exc

    def _compile(self, spec: StructuredOutput) -> CompiledGrammar:
        c = self._compiler
        if spec.json_schema is not None:
            schema = json_schema_of(spec)
            folding = folded(schema, spec.strict)  # outputs are validated against `schema`
            warnings = loosened_keywords(folding.schema) + folding.left
            if warnings and spec.fidelity == "strict":
                raise fidelity_error(warnings)
            handle = c.compile_json_schema(
                json.dumps(folding.schema), strict_mode=spec.strict, **_json_layout(spec)
            )
            return CompiledGrammar(handle, warnings, schema)
        if spec.json_object:  # any JSON object (the OpenAI meaning), not any JSON value
            handle = c.compile_json_schema(
                '{"type": "object"}', strict_mode=False, **_json_layout(spec)
            )
            return CompiledGrammar(handle, [], {"type": "object"})
        if spec.regex is not None:
            return CompiledGrammar(c.compile_regex(spec.regex))
        if spec.choice is not None:
            return CompiledGrammar(c.compile_regex("|".join(re.escape(x) for x in spec.choice)))
        if spec.grammar is not None:
            if grammar_syntax(spec) == "ebnf":
                return CompiledGrammar(c.compile_grammar(spec.grammar))
            return CompiledGrammar(c.compile_lark(spec.grammar))
        if spec.structural_tag is not None:
            warnings = loosened_in_tag(spec.structural_tag)
            if warnings and spec.fidelity == "strict":
                raise fidelity_error(warnings)
            handle = c.compile_structural_tag(json.dumps(spec.structural_tag))
            return CompiledGrammar(handle, warnings)
        raise GrammarError(f"structured.{spec.kind}: needs the grammar registry to resolve")

    def new_state(self, compiled: CompiledGrammar) -> XGrammarState:
        return XGrammarState(xgr.GrammarMatcher(compiled.handle))

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return allocate_bitmask(rows, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        apply_bitmask(logits, bitmask, rows, self.vocab_size)
