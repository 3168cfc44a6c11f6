"""Fills the next-token bitmasks of constrained rows, overlapped with the forward pass.

`start()` hands the fill to a worker thread and returns at once, so the CPU work of the grammar runs
while the model computes (torch releases the GIL inside its kernels, on CUDA the forward is
asynchronous anyway); `apply()` waits for it and masks the logits. With `overlap=False` (the plain
twin) the fill runs inside `apply()`, after the forward. Both fill the same rows the same way, so
they give the same tokens.

Each row is filled and timed on its own: a row whose grammar raises is reported in
`Masks.failed` (its request fails alone, its row is not applied), and each row's time goes to
the mask budget (`GrammarManager`). That time is the fill thread's CPU time, not the wall clock:
both grammar backends fill a mask on the calling thread, so the CPU time is the grammar's own
cost, while the wall clock also counts waiting for a core or the GIL (the forward's threads, a
grammar being probed in this process, a busy host) and would fail a cheap grammar for the load
around it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from services.engine.request import Request
from services.grammar.backend import GrammarBackend


@dataclass
class Masks:
    need: list[int]  # rows whose mask restricts something (rows allowing every token skip it)
    seconds: dict[int, float]  # row -> its fill's CPU time
    failed: dict[int, Exception]  # row -> what its grammar raised


@dataclass
class PendingMasks:
    rows: list[tuple[int, Request]]
    future: Future[Masks] | None


class MaskFiller:
    def __init__(
        self,
        backend: GrammarBackend,
        max_rows: int,
        overlap: bool = True,
        on_fill: Callable[[float], None] | None = None,
        check: Callable[[Request], None] | None = None,
    ) -> None:
        self.backend = backend
        self.on_fill = on_fill  # called with each step's fill time (telemetry)
        self.check = check  # called before each row's fill (the fault injector's hook)
        self.bitmask = backend.allocate_bitmask(max_rows)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask") if overlap else None
        # recent fill times (steps with constrained rows), bounded: the service runs for days
        self.fill_seconds: deque[float] = deque(maxlen=4096)

    def start(self, requests: list[Request]) -> PendingMasks | None:
        rows = [(i, r) for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return None
        if self._pool is None:
            return PendingMasks(rows, None)
        return PendingMasks(rows, self._pool.submit(self._fill, rows))

    def _fill(self, rows: list[tuple[int, Request]]) -> Masks:
        out = Masks([], {}, {})
        start = time.perf_counter()
        for i, req in rows:
            state = req.grammar
            row_start = time.thread_time()
            try:
                if self.check is not None:
                    self.check(req)
                assert state is not None  # `start` picked rows with a grammar
                if state.fill_bitmask(self.bitmask, i):
                    out.need.append(i)
            except Exception as exc:  # this row's grammar: its request fails, not the batch
                out.failed[i] = exc
            out.seconds[i] = time.thread_time() - row_start
        seconds = time.perf_counter() - start
        self.fill_seconds.append(seconds)
        if self.on_fill is not None:
            self.on_fill(seconds)
        return out

    def apply(self, pending: PendingMasks | None, logits: torch.Tensor) -> Masks | None:
        if pending is None:
            return None
        masks = pending.future.result() if pending.future is not None else self._fill(pending.rows)
        if masks.need:
            self.backend.apply_bitmask(logits, self.bitmask, masks.need)
        return masks

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
