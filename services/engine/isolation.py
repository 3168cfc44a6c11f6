"""The batched stages of a step, retried one request at a time when they raise.

The forward pass and the sampler work on the whole batch, but what makes them raise usually
belongs to one request (its KV read plan, its batch metadata, its host-tier reads, numerics its
parameters produce). When the batched call raises, each request runs alone inside the failure
boundary: the one that raises again fails by itself, the others get what they would have got
(a forward alone is the "alone" every victim is compared with). Faults of the engine itself
(`is_engine_fault`) are not retried.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from services.engine.boundary import Boundary, is_engine_fault
from services.engine.model_runner import ModelRunner
from services.engine.request import Request
from services.engine.sampler import Sampled, Sampler
from services.engine.scheduler import ScheduledChunk
from services.engine.speculative import SampleRows

log = logging.getLogger(__name__)


def forward(
    runner: ModelRunner,
    boundary: Boundary,
    chunks: list[ScheduledChunk],
    rows: SampleRows,
    check: Callable[[str, Request], None],
) -> torch.Tensor:
    """Logits of the sampling rows; the rows of a request that failed alone are NaN (it is
    finished: nothing reads them)."""
    try:
        for c in chunks:
            check("forward", c.request)
        return runner.forward(chunks)
    except Exception as exc:
        if is_engine_fault(exc):
            raise
        log.warning("batched forward failed (%r); its %d requests run alone", exc, len(chunks))
    alone: dict[int, torch.Tensor] = {}
    for c in chunks:
        with boundary.request(c.request) as stage:
            stage("forward")
            out = runner.forward([c])
            if c.samples:
                alone[id(c.request)] = out
    nan = torch.full((1, runner.vocab_size), float("nan"), device=runner.device)
    parts = [alone.get(id(r), nan.expand(rows.counts[id(r)], -1)) for r in rows.order]
    return torch.cat(parts) if parts else nan[:, :0]


def sample(sampler: Sampler, logits: torch.Tensor, sampling: list[Request]) -> Sampled:
    try:
        return sampler(logits, sampling)
    except Exception as exc:
        if is_engine_fault(exc):
            raise
        log.warning("batched sampling failed (%r); its %d rows sample alone", exc, len(sampling))
    out = Sampled([])
    for i, req in enumerate(sampling):
        try:
            one = sampler(logits[i : i + 1], [req])
            out.tokens.append(one.tokens[0])
            if one.failed:
                out.failed[i] = one.failed[0]
        except Exception as exc:
            if is_engine_fault(exc):
                raise
            out.tokens.append(0)
            out.failed[i] = f"sampling: internal error ({type(exc).__name__}: {exc})"[:300]
    return out
