"""llguidance as a grammar backend: the same interface as `xgrammar_backend.py`.

llguidance computes masks lazily from a lexer and an Earley parser (no compile step to speak of)
and refuses, by name, the JSON Schema keywords it cannot enforce instead of loosening them. Its
bitmask is xgrammar's layout (int32 words, token `t` at bit `t % 32` of word `t // 32`), so rows
of either backend share one bitmask and one apply.

Differences the state hides: llguidance does not record an end-of-sequence token it accepts once
the grammar is complete (xgrammar does, and then reports terminated), so this state notes it and
a rollback over it undoes one token fewer in the matcher; jump-forward text is the forced bytes,
cut to whole UTF-8 characters. A matcher never raises on a bad grammar: it enters an error state,
checked once when the grammar is built.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from grammar_registry.limits import GrammarLimits
from services.grammar.backend import (
    CompiledGrammar,
    GrammarError,
    allocate_bitmask,
    apply_bitmask,
)
from services.grammar.fidelity import loosened_keywords
from services.grammar.fold import Folded, folded
from services.grammar.structured import StructuredOutput
from services.grammar.xgrammar_backend import fidelity_error, grammar_syntax, json_schema_of

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions


def parser_limits(limits: GrammarLimits) -> llguidance.LLParserLimits:
    """llguidance's parser budgets from the deployment's `GrammarLimits` (their meaning is there).
    Terse errors: the parser state it would print holds the output so far."""
    return llguidance.LLParserLimits(
        max_items_in_row=limits.max_items_in_row,
        initial_lexer_fuel=limits.build_lexer_fuel,
        step_lexer_fuel=limits.mask_lexer_fuel,
        step_max_items=limits.mask_parser_items,
        max_lexer_states=limits.max_lexer_states,
        max_grammar_size=limits.max_grammar_symbols,
        verbose_errors=False,
    )


def _json_options(spec: StructuredOutput) -> JsonCompileOptions:
    """The whitespace rules of `xgrammar_backend._json_layout`, in llguidance's terms; lenient:
    a keyword it cannot enforce is a warning (reported, refused under strict fidelity), so the
    report lists every one, not the first."""
    if spec.compact:
        return {
            "item_separator": ",",
            "key_separator": ":",
            "whitespace_flexible": False,
            "lenient": True,
        }
    run = "*" if spec.max_whitespace_cnt is None else f"{{0,{spec.max_whitespace_cnt}}}"
    return {
        "whitespace_flexible": False,
        "whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{run}",
        "lenient": True,
    }


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else")


def closed(schema: Any) -> Any:
    """`StructuredOutput.strict` (xgrammar's strict mode) for llguidance: an object schema that
    lists properties and says nothing of others allows no others (a copy)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(v) for v in out[key]]
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_UNIMPLEMENTED = re.compile(r"^Unimplemented keys: (\[.*?\])")


def unenforced(warnings: list[str], schema: dict[str, Any] | None) -> list[str]:
    """llguidance's `Unimplemented keys: ["not"]` warnings in the fidelity report's wording,
    with the JSON paths of the keyword where the report's walk finds them."""
    keys: list[str] = []
    other = []
    for w in warnings:
        listed = _UNIMPLEMENTED.match(w)  # `... ["a", "b"]`, maybe followed by ` (2 times)`
        try:
            keys += [str(k) for k in json.loads(listed.group(1))] if listed else []
        except ValueError:
            listed = None
        if not listed:
            other.append(w)
    paths = [f for f in loosened_keywords(schema or {}) if _keyword(f) in keys]
    found = {_keyword(f) for f in paths}
    return paths + [f"{k}: not enforced" for k in dict.fromkeys(keys) if k not in found] + other


def _keyword(finding: str) -> str:
    """`#/a/uniqueItems: not enforced` -> `uniqueItems`."""
    return finding.split(": ", 1)[0].rsplit("/", 1)[-1]


def _utf8_prefix(data: bytes) -> str:
    """The longest prefix of `data` that is whole UTF-8 characters."""
    for cut in range(len(data), max(-1, len(data) - 4), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""


def _first_line(error: str) -> str:
    """llguidance's error without the lines after the first (they echo the grammar)."""
    return (error.strip().splitlines() or ["unknown error"])[0][:300]


def _over_limits(matcher: llguidance.LLMatcher) -> GrammarError:
    """A matcher that ran past its parser limits (it then allows only end-of-sequence: left
    alone, the output would end early and look finished)."""
    first = _first_line(matcher.get_error())
    return GrammarError(
        f"structured: the grammar ran past the parser's limits ({first})",
        reason="limit",
        status=422,
    )


class LLGuidanceState:
    def __init__(
        self, matcher: llguidance.LLMatcher, eos: frozenset[int], tokenizer: llguidance.LLTokenizer
    ) -> None:
        self._m = matcher
        self._eos = eos
        self._tokenizer = tokenizer
        self._terminated = False

    def accept_token(self, token_id: int) -> bool:
        """False for a token the grammar refuses (the matcher is left as it was: `consume_token`
        would put it in an error state for good); raises `GrammarError` when the parser runs
        past its limits on it."""
        if self._terminated:
            return False
        if token_id in self._eos and (self._m.is_stopped() or self._m.is_accepting()):
            self._terminated = True  # llguidance does not record it: see the module's doc
            return True
        if self._m.try_consume_tokens([token_id]) == 1:
            return True
        if self._m.is_error():
            raise _over_limits(self._m)
        return False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)
        if self._m.is_error():
            raise _over_limits(self._m)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens:
            self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._terminated

    def jump_forward(self) -> str:
        if self._terminated or self._m.is_stopped():
            return ""
        return _utf8_prefix(self._m.compute_ff_bytes())

    def accept_string(self, text: str) -> bool:
        """Accepts text the grammar forces, in any tokenization (the admission probe)."""
        tokens = self._tokenizer.tokenize_str(text)
        consumed = self._m.try_consume_tokens(tokens)
        if self._m.is_error():
            raise _over_limits(self._m)
        return consumed == len(tokens)


class LLGuidanceBackend:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        limits: GrammarLimits | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids) or None
        )
        self._eos = frozenset(stop_token_ids)
        self.use_limits(limits or GrammarLimits())

    def use_limits(self, limits: GrammarLimits) -> None:
        """The parser limits of grammars built from now on (the compile service's)."""
        self.limits = parser_limits(limits)

    def grammar_text(self, spec: StructuredOutput) -> tuple[str, dict[str, Any] | None, Folded]:
        """llguidance's grammar for a spec, the schema outputs are validated against, and what
        the grammar was built from (a JSON schema's folds: grammar/fold.py)."""
        if spec.json_schema is not None:
            # Not `bound_numbers`: llguidance 1.9.1 fails to build an integer lexeme with the
            # 64-bit lower bound, so integers stay unbounded here (a digit loop is still cut
            # by `max_repeat_run`)
            schema = json_schema_of(replace(spec, bound_numbers=False))
            folding = folded(schema, spec.strict)
            grammar = folding.schema
            text = llguidance.LLMatcher.grammar_from_json_schema(
                closed(grammar) if spec.strict else grammar, defaults=_json_options(spec)
            )
            return text, schema, folding
        if spec.json_object:
            schema = {"type": "object"}
            text = llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults=_json_options(spec)
            )
            return text, schema, Folded(schema)
        if spec.regex is not None:
            return llguidance.grammar_from("regex", spec.regex), None, Folded(None)
        if spec.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(spec.choice)), None, Folded(None)
        if spec.grammar is not None:
            if grammar_syntax(spec) == "ebnf":  # through llguidance's GBNF-to-Lark converter
                return llguidance.grammar_from("ebnf", spec.grammar), None, Folded(None)
            return llguidance.grammar_from("lark", spec.grammar), None, Folded(None)
        if spec.structural_tag is not None:
            raise GrammarError(
                "structured.structural_tag: not supported by the llguidance backend "
                "(use grammar_backend xgrammar)"
            )
        raise GrammarError(f"structured.{spec.kind}: needs the grammar registry to resolve")

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        try:
            text, schema, folding = self.grammar_text(spec)
        except GrammarError:
            raise
        except (ValueError, TypeError) as exc:  # a GBNF llguidance's converter cannot read
            raise GrammarError(f"structured.{spec.kind}: {str(exc)[:300]}") from exc
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise GrammarError(f"structured.{spec.kind}: {_first_line(matcher.get_error())}")
        warnings = unenforced(matcher.get_grammar_warnings(), folding.schema) + folding.left
        if warnings and spec.fidelity == "strict":
            raise fidelity_error(warnings)
        return CompiledGrammar(matcher, warnings, schema, backend="llguidance")

    def new_state(self, compiled: CompiledGrammar) -> LLGuidanceState:
        return LLGuidanceState(compiled.handle.deep_copy(), self._eos, self.tokenizer)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return allocate_bitmask(rows, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        apply_bitmask(logits, bitmask, rows, self.vocab_size)
