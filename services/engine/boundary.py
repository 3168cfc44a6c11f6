"""The per-request failure boundary: what belongs to one request fails that request alone.

Each part of a step that works on one request runs inside `Boundary.request(req)`, naming its
stage as it goes. An exception there finishes that request with `finish_reason="error"`, the stage
and the cause in `warnings`, and its pages freed; the step goes on with the others. Only a fault
of the engine as a whole (out of memory, a device error) passes through: the engine then fails
every request (`LLMEngine.fail_all`), so no client is left waiting.

`FaultInjector` raises inside a chosen stage for a chosen request; the hostile-input tests use it
to show that every stage is contained.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from services.engine.request import Request

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
    """Makes `stage` raise for the request `request_id` (every time it is reached)."""

    def __init__(self) -> None:
        self._armed: dict[str, set[str]] = {}

    def arm(self, request_id: str, stage: str) -> None:
        if stage not in STAGES:
            raise ValueError(f"stage: {stage!r} is not one of {', '.join(STAGES)}")
        self._armed.setdefault(request_id, set()).add(stage)

    def check(self, stage: str, req: Request) -> None:
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
