"""One request's state as the engine sees it.

`token_ids` holds prompt and output together; `num_computed_tokens` counts those whose keys and
values are in the cache. Every step computes the tokens in between (a whole prompt, a chunk of one,
one decode token, or a recomputation after preemption) and samples once the last one is computed.
"""

from __future__ import annotations

import enum
import functools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.params import (
    FinishReason,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from services.engine.thinking import ThinkingState
from services.grammar.canonical import structured_key

if TYPE_CHECKING:
    from kvcache.policies import KVState
    from services.engine.structured.late import Parked
    from services.engine.structured.validation import PendingValidation
    from services.grammar.backend import CompiledGrammar, GrammarState
    from services.grammar.structured import StructuredOutput


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class StructuredRequest:
    """A constrained request's grammar side (services/engine/structured/manager.py): its spec and
    the spec's one canonical key, the compile in flight, then the compiled grammar and this
    request's state, and what the decode-time guards count."""

    spec: StructuredOutput
    future: Future[CompiledGrammar] | None = None
    compiled: CompiledGrammar | None = None
    state: GrammarState | None = None
    whitespace_run: int = 0  # whitespace-only tokens at the end of the output
    mask_over_budget_s: float = 0.0  # spent in masks slower than the budget
    parked: Parked | None = None  # grammar work that missed its deadline (structured/late.py)
    # checked decoding (structured/checked.py): whether a failed check sends it back (its
    # output held until it passed), the returns so far, the tokens excluded per output position
    checked: bool = False
    retries: int = 0
    excluded: dict[int, set[int]] = field(default_factory=dict)
    last_check: str = ""  # why its last output failed the check

    @functools.cached_property
    def key(self) -> str:
        """`structured_key(spec)`, made when first asked for (a log line names the grammar by
        it)."""
        return structured_key(self.spec)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    eos_token_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    tenant: str = "default"  # scopes registered grammars and compile quotas
    # its LoRA adapter (services/lora), which weights (prefix-cache scope), and the slot it
    # holds while running (-1: none)
    lora_name: str | None = None
    lora_scope: str | None = None
    lora_slot: int = -1
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    pages: list[int] = field(default_factory=list)
    kv_state: KVState | None = None  # a KV policy other than `full`: what it evicted so far
    context_limit: int | None = None  # the policy's own limit on tokens (None: the engine's)
    # prefix caching (services/engine/prefix_cache.py): the key chain's root (None: the request
    # neither reads nor feeds the cache), the keys of its full pages so far, and how many of its
    # pages have been offered to the cache
    cache_root: bytes | None = None
    page_keys: list[bytes] = field(default_factory=list)
    keyed_pages: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    warnings: list[str] = field(default_factory=list)
    structured: StructuredRequest | None = None  # set once its grammar is asked for
    validated: bool | None = None  # JSON outputs: did the text validate against the schema
    validation: PendingValidation | None = None  # finished, its output still being validated
    error_status: int | None = None  # finish_reason "error": the HTTP status it maps to
    # speculative decoding (services/engine/speculative.py): this step's proposed tokens
    draft: list[int] = field(default_factory=list)
    draft_room: int | None = None  # `draft_length="adaptive"`: the next draft's length cap
    prompt_logprobs: list[float] | None = None
    logprobs: list[TokenLogprob] | None = None  # SamplingParams.logprobs: one per output token
    thinking: ThinkingState | None = None  # SamplingParams.thinking_token_budget's (thinking.py)
    _emitted_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.metrics.num_prompt_tokens = len(self.prompt_token_ids)
        if not self.metrics.arrival_time:
            self.metrics.arrival_time = time.perf_counter()
        spec, budget = self.params.thinking, self.params.thinking_token_budget
        if spec is not None and budget is not None and self.thinking is None:
            self.thinking = ThinkingState.of(spec, budget)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose keys and values sit in the request's pages (fewer once a policy evicts)."""
        if self.kv_state is None:
            return self.num_computed_tokens
        return self.kv_state.cached(self.num_computed_tokens)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def grammar(self) -> GrammarState | None:
        """The request's grammar state once its grammar compiled (None: unconstrained)."""
        return self.structured.state if self.structured is not None else None

    @property
    def ready(self) -> bool:
        """False while the request's grammar compiles, or while it is parked waiting for grammar
        work that missed its deadline: it waits without blocking others."""
        s = self.structured
        return s is None or (s.state is not None and s.parked is None)

    @property
    def finished(self) -> bool:
        """Nothing more is computed for it (its pages are free)."""
        return self.status is RequestStatus.FINISHED

    @property
    def done(self) -> bool:
        """Finished, and its output's validation (if any) is in: its last output can go out."""
        return self.finished and self.validation is None

    def record_logprobs(self, sampled: TokenLogprob, appended: list[int]) -> None:
        """The sampled token's entry; tokens jump-forward forced get probability 1 (0.0)."""
        if self.logprobs is None:
            self.logprobs = []
        for i, token in enumerate(appended):
            if i == 0 and token == sampled.token_id:
                self.logprobs.append(sampled)
            else:
                self.logprobs.append(TokenLogprob(token, 0.0, ((token, 0.0),)))

    def take_new_token_ids(self) -> list[int]:
        new = self.token_ids[self.num_prompt_tokens + self._emitted_tokens :]
        self._emitted_tokens += len(new)
        return new

    @property
    def held(self) -> bool:
        """Its output may still go back (checked decoding): none of it is out until done."""
        return self.structured is not None and self.structured.checked and not self.done

    def output(self) -> RequestOutput:
        """A delta since the last call, with the text and tokens so far (none while held)."""
        held = self.held
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            text="" if held else self.detokenizer.text,
            token_ids=[] if held else self.output_token_ids,
            finished=self.done,
            finish_reason=self.finish_reason if self.done else None,
            delta_text="" if held else self.detokenizer.take_delta(final=self.done),
            delta_token_ids=[] if held else self.take_new_token_ids(),
            metrics=self.metrics,
            warnings=list(self.warnings),
            validated=self.validated,
            error_status=self.error_status,
            prompt_logprobs=self.prompt_logprobs if self.finished else None,
            logprobs=list(self.logprobs) if self.logprobs is not None and not held else None,
        )

    def error_output(self) -> RequestOutput:
        """A last output made of plain data only (for a request whose own output failed)."""
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            text="",
            token_ids=self.output_token_ids,
            finished=True,
            finish_reason="error",
            metrics=self.metrics,
            warnings=list(self.warnings),
            error_status=self.error_status or 500,
        )
