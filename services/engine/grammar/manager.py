"""Structured output inside the engine: compiles in flight, masks, acceptance and validation.

The engine calls this at fixed points of its step and never looks at a grammar itself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any

import jsonschema
import torch

from services.engine.grammar.backend import GrammarBackend
from services.engine.grammar.masks import MaskFiller, PendingMasks
from services.engine.grammar.provider import GrammarProvider, LocalGrammarProvider
from services.engine.grammar.xgrammar_backend import XGrammarBackend
from services.engine.params import FinishReason
from services.engine.request import Request

log = logging.getLogger(__name__)


class GrammarManager:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        max_rows: int,
        overlap: bool = True,
        provider: GrammarProvider | None = None,
        backend: GrammarBackend | None = None,
        workers: int = 0,
        redis_url: str | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._max_rows = max_rows
        self._overlap = overlap
        self._backend = backend
        self._provider = provider
        self._workers = workers
        self._redis_url = redis_url
        self._masks: MaskFiller | None = None
        self._pending: list[Request] = []
        self._whitespace: dict[int, bool] = {}
        # read by telemetry (services/engine/stats.py); plain ints, written on the engine thread
        self.jump_forward_tokens = 0  # put in outputs by jump-forward, never sampled
        self.forward_passes_saved = 0  # decode steps not run: one per forced token after the first
        self.on_mask_fill: Callable[[float], None] | None = None

    @property
    def backend(self) -> GrammarBackend:
        # Built on first use: unconstrained traffic never pays for the tokenizer scan.
        if self._backend is None:
            self._backend = XGrammarBackend(self._tokenizer, self._vocab_size, self._stop_token_ids)
        return self._backend

    def use_provider(self, provider: GrammarProvider) -> None:
        """Replaces the provider before the first structured request (a serving replica's)."""
        self._provider = provider

    @property
    def provider(self) -> GrammarProvider:
        if self._provider is None:
            if self._workers > 0:
                from services.compiler import build_provider  # the service imports the engine

                backend = self.backend
                if not isinstance(backend, XGrammarBackend):
                    raise TypeError("grammar_workers > 0 needs the xgrammar backend")
                self._provider = build_provider(backend, self._workers, self._redis_url)
            else:
                self._provider = LocalGrammarProvider(self.backend)
        return self._provider

    @property
    def masks(self) -> MaskFiller:
        if self._masks is None:
            self._masks = MaskFiller(
                self.backend, self._max_rows, self._overlap, on_fill=self._mask_filled
            )
        return self._masks

    def _mask_filled(self, seconds: float) -> None:
        hook = self.on_mask_fill
        if hook is not None:
            try:
                hook(seconds)
            except Exception:  # telemetry never stops a step
                log.debug("mask fill hook failed", exc_info=True)

    def attach(self, req: Request) -> None:
        """Starts compiling the request's grammar; the request waits in the queue meanwhile."""
        assert req.params.structured is not None
        req.grammar_future = self.provider.submit(req.params.structured, req.tenant)
        self._pending.append(req)

    def resolve(self) -> list[Request]:
        """Gives finished compiles their grammar state; returns requests whose grammar failed."""
        failed, still = [], []
        for req in self._pending:
            fut = req.grammar_future
            if req.finished or fut is None:
                continue
            if not fut.done():
                still.append(req)
                continue
            exc = fut.exception()
            if exc is not None:
                req.warnings.append(str(exc))
                req.error_status = int(getattr(exc, "status", 400))
                failed.append(req)
                continue
            req.compiled = fut.result()
            req.grammar = self.backend.new_state(req.compiled)
            req.warnings.extend(req.compiled.warnings)
        self._pending = still
        return failed

    def wait_for_compiles(self, timeout: float) -> None:
        """Blocks briefly when the only work left is grammars being compiled (no busy loop)."""
        futures = [r.grammar_future for r in self._pending if r.grammar_future is not None]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def start_masks(self, sampling: list[Request]) -> PendingMasks | None:
        if not any(r.grammar is not None for r in sampling):
            return None
        return self.masks.start(sampling)

    def apply_masks(self, pending: PendingMasks | None, logits: torch.Tensor) -> None:
        if pending is not None:
            self.masks.apply(pending, logits)

    def accept(self, req: Request, token: int) -> FinishReason | None:
        """Advances the request's grammar; a reason to finish when it terminated or misbehaved."""
        state, spec = req.grammar, req.params.structured
        if state is None or spec is None:
            return None
        if not state.accept_token(token):
            req.warnings.append(f"grammar: rejected the sampled token {token}")
            return "error"
        if state.is_terminated():
            return "stop"
        req.whitespace_run = req.whitespace_run + 1 if self._is_whitespace(token) else 0
        if req.whitespace_run >= spec.max_whitespace_run:
            req.warnings.append(
                f"structured.max_whitespace_run: {req.whitespace_run} whitespace-only tokens"
            )
            return "error"
        return None

    def jump_forward(self, req: Request, token: int, room: int) -> list[int]:
        """The tokens to append for a just-accepted `token`: itself, or a canonical span over it.

        When the grammar forces text next, `token` + that text is re-tokenized the way the
        tokenizer would write it; the matcher is rolled back where that changes `token` and fed
        the new tokens. The last token of the span stays open (the model samples it next, masked)
        because it could merge with what follows into a longer vocabulary token. `room` caps the
        span (max_tokens). The sampled token is not in the KV cache yet, so no cache rolls back.
        """
        state = req.grammar
        if state is None or state.is_terminated():
            return [token]
        forced = state.jump_forward()
        if not forced:
            return [token]
        head = self._tokenizer.decode([token])
        if "\ufffd" in head:  # part of a multi-byte character: re-encoding would not round-trip
            return [token]
        ids = list(self._tokenizer.encode(head + forced, add_special_tokens=False))[:-1][:room]
        if len(ids) <= 1:
            return [token]
        keep = 1 if ids[0] == token else 0
        if not keep:
            state.rollback(1)
        accepted = 0
        for t in ids[keep:]:
            if not state.accept_token(t):
                break
            accepted += 1
        if accepted < len(ids) - keep:  # the grammar disagrees with the tokenizer: undo it all
            state.rollback(accepted)
            if not keep:
                state.accept_token(token)
            return [token]
        req.metrics.num_forced_tokens += len(ids) - 1
        self.jump_forward_tokens += len(ids) - keep
        self.forward_passes_saved += len(ids) - 1
        return ids

    def _is_whitespace(self, token: int) -> bool:
        known = self._whitespace.get(token)
        if known is None:
            text = self._tokenizer.decode([token])
            known = self._whitespace[token] = bool(text) and not text.strip()
        return known

    def validate(self, req: Request) -> None:
        """Parses and validates a finished JSON output; records the verdict and why it failed."""
        if (
            req.compiled is None
            or req.compiled.schema is None
            or req.finish_reason in ("error", "abort")
        ):
            return
        try:
            value = json.loads(req.detokenizer.text)
            jsonschema.validate(value, req.compiled.schema)
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            req.validated = False
            req.warnings.append(f"output failed validation: {str(exc).splitlines()[0][:300]}")
        except jsonschema.SchemaError as exc:
            req.warnings.append(f"schema could not be used to validate: {exc.message[:300]}")
        else:
            req.validated = True

    def shutdown(self) -> None:
        if self._masks is not None:
            self._masks.shutdown()
        if self._provider is not None:
            self._provider.shutdown()
