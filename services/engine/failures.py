"""What belongs to one request fails that request alone.

Each part of a step that works on one request runs inside `Boundary.request(req)`, naming its
stage as it goes. An exception there finishes that request with `finish_reason="error"`, the stage
and the cause in `warnings`, and its pages freed; the step goes on with the others. Only a fault
of the engine as a whole (out of memory, a device error) passes through: the engine then fails
every request (`LLMEngine.fail_all`), so no client is left waiting.

`FaultInjector` raises inside a chosen stage for a chosen request; the hostile-input tests use it
to show that every stage is contained.

The batched stages (`forward`, `sample`) work on the whole batch, but what makes them raise
usually belongs to one request (its KV read plan, its batch metadata, its host-tier reads,
numerics its parameters produce). When the batched call raises, each request runs alone inside
the boundary: the one that raises again fails by itself, the others get what they would have got
(a forward alone is the "alone" every victim is compared with). Faults of the engine itself
(`is_engine_fault`) are not retried.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from services.engine.request import Request
from services.engine.sampler import Sampled, Sampler

if TYPE_CHECKING:
    from services.engine.model_runner import ModelRunner
    from services.engine.scheduler import ScheduledChunk
    from services.engine.speculative import SampleRows

log = logging.getLogger(__name__)

# Where one request's work happens, in step order. "forward" is the batched model pass, retried
# one request at a time when it fails, so the request whose KV read plan, batch metadata or host
# tier reads raised is found and failed alone.
STAGES = (
    "admit",
    "grammar",
    "forward",
    "mask",
    "sample",
    "accept",
    "jump_forward",
    "detokenize",
    "stop",
    "kv_compact",
    "kv_offload",
    "validate",
    "output",
)

# RuntimeErrors that mean the device itself is in trouble (a CUDA context does not recover).
_DEVICE_MARKERS = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "device-side assert", "NCCL")


class RequestError(Exception):
    """A request cannot go on for a reason of its own; `status` is what an HTTP client gets."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


class InjectedFault(RuntimeError):
    """Raised by `FaultInjector` (tests only)."""


def is_engine_fault(exc: BaseException) -> bool:
    """True for faults no single request owns: memory exhausted, the device failing."""
    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return True
    accelerator = getattr(torch, "AcceleratorError", None)
    if accelerator is not None and isinstance(exc, accelerator):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _DEVICE_MARKERS)


class FaultInjector:
    """Makes `stage` raise for the request `request_id` (every time it is reached), or sleep
    there (`delay`: the first `times` times)."""

    def __init__(self) -> None:
        self._armed: dict[str, set[str]] = {}
        self._delays: dict[tuple[str, str], list[float]] = {}

    def arm(self, request_id: str, stage: str) -> None:
        self._known(stage)
        self._armed.setdefault(request_id, set()).add(stage)

    def delay(self, request_id: str, stage: str, seconds: float, times: int = 1) -> None:
        self._known(stage)
        self._delays[(request_id, stage)] = [seconds] * times

    @staticmethod
    def _known(stage: str) -> None:
        if stage not in STAGES:
            raise ValueError(f"stage: {stage!r} is not one of {', '.join(STAGES)}")

    def check(self, stage: str, req: Request) -> None:
        delays = self._delays.get((req.request_id, stage))
        if delays:
            time.sleep(delays.pop())
        if stage in self._armed.get(req.request_id, ()):
            raise InjectedFault(f"injected fault in {stage}")


class _Stage:
    """Callable that names the stage a request is in (and fires an armed fault there)."""

    def __init__(self, req: Request, faults: FaultInjector | None, name: str) -> None:
        self.req, self.faults, self.name = req, faults, name

    def __call__(self, name: str) -> None:
        self.name = name
        if self.faults is not None:
            self.faults.check(name, self.req)


class Boundary:
    def __init__(self, fail: Callable[[Request, str, int], None]) -> None:
        self._fail = fail  # finishes one request with an error: (request, reason, HTTP status)
        self.faults: FaultInjector | None = None
        self.contained = 0  # requests failed alone by an unexpected exception

    @contextmanager
    def request(self, req: Request) -> Iterator[_Stage]:
        """Runs a block of one request's work, which calls `stage(name)` as it enters each
        stage (the first line of the block names the first)."""
        current = _Stage(req, self.faults, "request")
        try:
            yield current
        except Exception as exc:
            if is_engine_fault(exc):
                raise
            self.contain(req, current.name, exc)

    def contain(self, req: Request, stage: str, exc: Exception) -> None:
        if isinstance(exc, RequestError):
            reason, status = str(exc), exc.status
        elif isinstance(getattr(exc, "status", None), int):  # a GrammarError: its own status
            reason, status = str(exc), int(exc.status)  # type: ignore[attr-defined]
        else:
            self.contained += 1
            log.warning(
                "request %s failed in %s (contained): %r", req.request_id, stage, exc, exc_info=exc
            )
            reason, status = f"{stage}: internal error ({type(exc).__name__}: {exc})", 500
        if not req.finished:
            self._fail(req, reason[:300], status)


# -- the batched stages, retried one request at a time -------------------------------------


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
