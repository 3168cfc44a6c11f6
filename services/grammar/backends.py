"""The grammar backends by name, behind one `GrammarBackend`: each grammar compiles with the
backend its request pins (`StructuredOutput.backend`), else the engine's (`grammar_backend`).

`auto` picks per grammar:
- JSON (`json_schema`, `json_object`): llguidance when it enforces every keyword of the schema
  (no compile step: its first mask takes milliseconds where xgrammar compiles for up to seconds),
  else xgrammar when it does, else the one that loosens fewer keywords, llguidance on a tie or
  when xgrammar refuses the schema (the loosened ones are in `warnings`; `fidelity="strict"`
  refuses the schema only when both would loosen it).
- regex, choice, EBNF/Lark grammars and structural tags: xgrammar, whose dialects our docs and
  callers use (llguidance reads `\\d` as any Unicode digit, and has no structural tags of that
  format).
Both backends fill the same 32-bit bitmask layout, so rows of either share one bitmask and one
apply, and a batch may mix them.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

import torch

from grammar_registry.limits import GrammarLimits
from services.grammar.backend import (
    CompiledGrammar,
    GrammarError,
    GrammarState,
    allocate_bitmask,
    apply_bitmask,
)
from services.grammar.structured import check_name
from services.grammar.xgrammar_backend import XGrammarBackend
from services.models import eos_token_ids


class Backends:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        default: str = "xgrammar",
        xgrammar: XGrammarBackend | None = None,
        limits: GrammarLimits | None = None,
    ) -> None:
        check_name("grammar_backend", default)
        self.tokenizer = tokenizer
        self.default = default
        self.vocab_size = vocab_size
        self._args = (tokenizer, vocab_size, stop_token_ids)
        self._xgrammar = xgrammar
        self._llguidance: Any = None
        self.limits = limits or GrammarLimits()
        self._building = threading.Lock()  # build threads and the engine thread may all ask

    def use_limits(self, limits: GrammarLimits) -> None:
        """llguidance's parser limits from now on (the compile service's `GrammarLimits`)."""
        self.limits = limits
        if self._llguidance is not None:
            self._llguidance.use_limits(limits)

    # Each built on first use: unconstrained traffic never pays for a tokenizer scan.
    @property
    def xgrammar(self) -> XGrammarBackend:
        with self._building:
            if self._xgrammar is None:
                self._xgrammar = XGrammarBackend(*self._args)
            return self._xgrammar

    @property
    def llguidance(self) -> Any:
        with self._building:
            if self._llguidance is None:
                from services.grammar.llguidance_backend import LLGuidanceBackend

                self._llguidance = LLGuidanceBackend(*self._args, limits=self.limits)
            return self._llguidance

    def get(self, name: str) -> Any:
        return self.llguidance if name == "llguidance" else self.xgrammar

    def compile(self, spec: Any) -> CompiledGrammar:
        name = getattr(spec, "backend", None) or self.default
        if name == "auto":
            return self._auto(spec)
        return self.get(name).compile(spec)

    def _auto(self, spec: Any) -> CompiledGrammar:
        if spec.json_schema is None and not spec.json_object:
            return self.xgrammar.compile(spec)
        try:
            guided = self.llguidance.compile(replace(spec, fidelity="warn"))
        except GrammarError:  # llguidance cannot build it: xgrammar decides alone
            return self.xgrammar.compile(spec)
        if not guided.warnings:
            return guided
        try:
            compiled = self.xgrammar.compile(spec)  # raises under strict when it loosens too
        except GrammarError:
            if spec.fidelity == "strict":
                raise
            return guided
        return prefer(guided, compiled)

    def new_state(self, compiled: CompiledGrammar) -> GrammarState:
        state: GrammarState = self.get(compiled.backend).new_state(compiled)
        return state

    # The shared layout needs no backend: an llguidance-only engine never scans the tokenizer
    # for xgrammar.
    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return allocate_bitmask(rows, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        apply_bitmask(logits, bitmask, rows, self.vocab_size)


def prefer(guided: CompiledGrammar, compiled: CompiledGrammar) -> CompiledGrammar:
    """`auto` between llguidance's grammar, which loosens some keyword, and xgrammar's: the
    one that loosens fewer (llguidance on a tie: its first mask comes sooner)."""
    if compiled.warnings and len(guided.warnings) <= len(compiled.warnings):
        return guided
    return compiled


def for_model(
    tokenizer: Any, config: Any, generation_config: Any, default: str = "xgrammar"
) -> Backends:
    """A model's backends from its tokenizer and configs (no weights): the one way they are
    built, in the engine and in the compile service alike, so both see one vocabulary and one
    set of stop tokens (the compile cache's keys and verdicts depend on it)."""
    stop = sorted(eos_token_ids(generation_config, config, tokenizer))
    return Backends(tokenizer, int(config.vocab_size), stop, default)


def from_folder(folder: str, default: str = "xgrammar") -> Backends:
    """`for_model` for a model folder, reading its tokenizer and configs only."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(folder)
    except OSError:
        generation = None
    config = AutoConfig.from_pretrained(folder)
    return for_model(AutoTokenizer.from_pretrained(folder), config, generation, default)
