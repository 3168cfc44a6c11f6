"""Fills the next-token bitmasks of constrained rows, overlapped with the forward pass, each row
waited for no longer than the step's mask deadline.

`start()` queues one fill per row on the grammar workers (services/grammar/workers.py) and
returns at once, so the grammars compute while the model does; `apply()` waits for them and
masks the logits. A row whose fill is not in by the deadline (`deadline_ms` after the fills
started, and never before the forward has ended: a fill the forward hides is never late) is
reported in `Masks.late` and leaves the step: the rest of the batch samples as if it were not
there, and the late row samples in a later step once its fill is in (structured/late.py keeps
its logits meanwhile). Its fill goes on writing into the bitmask it started with, so the filler
takes a fresh one for later steps.

Plain twins: `deadline_ms=None` waits for every fill (as the engine always did), and with
`overlap=False` as well the fills run inline after the forward, on the engine thread.

Each row is filled and timed on its own: a row whose grammar raises is reported in
`Masks.failed` (its request fails alone), and each row's time goes to the mask budget. That time
is the fill thread's CPU time, not the wall clock: both backends fill on the calling thread, so
that CPU time is the grammar's own cost, while the wall clock also counts waiting for a core or
the GIL and would fail a cheap grammar for the load around it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.engine.request import Request
from services.grammar.backend import GrammarBackend
from services.grammar.workers import GrammarWorkers, Job

# A tenant with this many fills straggling (on idle cores, their requests failed or parked) has
# its next fills held, late, until one of them returns: one tenant's slow grammars cannot
# multiply the threads a replica runs without bound.
STRAGGLERS_PER_TENANT = 8


@dataclass(eq=False)
class LateFill:
    """A row's fill that missed its step: where it writes, and its job (None while held behind
    its tenant's stragglers)."""

    request: Request
    bitmask: torch.Tensor  # [rows, words]: the fill writes row `row`
    row: int
    job: Job | None = None

    @property
    def done(self) -> bool:
        return self.job is not None and self.job.done


@dataclass
class Masks:
    need: list[int]  # rows whose mask restricts something (rows allowing every token skip it)
    seconds: dict[int, float]  # row -> its fill's CPU time
    failed: dict[int, BaseException]  # row -> what its grammar raised
    late: dict[int, LateFill] = field(default_factory=dict)  # not in by the deadline


@dataclass
class PendingMasks:
    rows: list[tuple[int, Request]]
    bitmask: torch.Tensor | None = None  # the tensor this step's fills write into
    jobs: dict[int, Job] = field(default_factory=dict)
    started: float = 0.0  # time.perf_counter() when the fills were queued


class MaskFiller:
    def __init__(
        self,
        backend: GrammarBackend,
        max_rows: int,
        overlap: bool = True,
        on_fill: Callable[[float], None] | None = None,
        check: Callable[[Request], None] | None = None,
        deadline_ms: float | None = None,
        workers: int = 2,
    ) -> None:
        self.backend = backend
        self.on_fill = on_fill  # called with each step's fill time (telemetry)
        self.check = check  # called before each row's fill (the fault injector's hook)
        self.max_rows = max_rows
        self.bitmask = backend.allocate_bitmask(max_rows)
        self.overlap = overlap
        self.deadline_s = deadline_ms / 1000 if deadline_ms is not None else None
        inline = not overlap and deadline_ms is None
        self.workers = None if inline else GrammarWorkers(workers)
        # recent fill times (steps with constrained rows), bounded: the service runs for days
        self.fill_seconds: deque[float] = deque(maxlen=4096)

    def start(self, requests: list[Request]) -> PendingMasks | None:
        rows = [(i, r) for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return None
        pending = PendingMasks(rows, self.bitmask)
        if self.overlap and self.workers is not None:
            self._queue(pending)
        return pending

    def _fill(self, req: Request, bitmask: torch.Tensor, row: int) -> Callable[[], bool]:
        state, check = req.grammar, self.check

        def fill() -> bool:
            if check is not None:
                check(req)
            assert state is not None  # `start` picked rows with a grammar
            return state.fill_bitmask(bitmask, row)

        return fill

    def _queue(self, pending: PendingMasks) -> None:
        assert self.workers is not None and pending.bitmask is not None
        pending.started = time.perf_counter()
        held = self._held_tenants(pending.rows)
        fills = [(i, r) for i, r in pending.rows if r.tenant not in held]
        bitmask = pending.bitmask
        jobs = self.workers.submit([(self._fill(r, bitmask, i), r.tenant) for i, r in fills])
        pending.jobs = {i: job for (i, _), job in zip(fills, jobs, strict=True)}

    def _held_tenants(self, rows: list[tuple[int, Request]]) -> set[str]:
        assert self.workers is not None
        if self.deadline_s is None:
            return set()
        tenants = {r.tenant for _, r in rows}
        return {t for t in tenants if self.workers.stragglers(t) >= STRAGGLERS_PER_TENANT}

    def apply(self, pending: PendingMasks | None, logits: torch.Tensor) -> Masks | None:
        if pending is None:
            return None
        if self.workers is None:
            masks = self._fill_inline(pending)
        else:
            if not pending.started:  # overlap off: the fills start after the forward
                self._queue(pending)
            masks = self._collect(pending)
        if masks.need:
            assert pending.bitmask is not None
            self.backend.apply_bitmask(logits, pending.bitmask, masks.need)
        return masks

    def _fill_inline(self, pending: PendingMasks) -> Masks:
        out = Masks([], {}, {})
        assert pending.bitmask is not None
        start = time.perf_counter()
        for i, req in pending.rows:
            row_start = time.thread_time()
            try:
                if self._fill(req, pending.bitmask, i)():
                    out.need.append(i)
            except Exception as exc:  # this row's grammar: its request fails, not the batch
                out.failed[i] = exc
            out.seconds[i] = time.thread_time() - row_start
        self._record(time.perf_counter() - start)
        return out

    def _collect(self, pending: PendingMasks) -> Masks:
        assert self.workers is not None and pending.bitmask is not None
        jobs = list(pending.jobs.values())
        timeout = None
        if self.deadline_s is not None:
            timeout = max(0.0, pending.started + self.deadline_s - time.perf_counter())
        self.workers.wait(jobs, timeout)
        out, last = Masks([], {}, {}), pending.started
        for i, req in pending.rows:
            job = pending.jobs.get(i)
            if job is None or not job.done:
                out.late[i] = LateFill(req, pending.bitmask, i, job)
                if job is not None:
                    self.workers.straggle(job)
                continue
            out.seconds[i], last = job.seconds, max(last, job.ended)
            if job.error is not None:
                out.failed[i] = job.error
            elif job.result:
                out.need.append(i)
        if out.late:  # their fills still write into this step's tensor: later steps get another
            self.bitmask = self.backend.allocate_bitmask(self.max_rows)
        self._record(last - pending.started)
        return out

    def resume(self, late: LateFill) -> None:
        """Queues a held fill once its tenant's stragglers allow (no-op otherwise)."""
        assert self.workers is not None
        if late.job is not None or self.workers.stragglers(late.request.tenant) >= (
            STRAGGLERS_PER_TENANT
        ):
            return
        fill = self._fill(late.request, late.bitmask, late.row)
        late.job = self.workers.submit([(fill, late.request.tenant)])[0]

    def apply_late(self, late: LateFill, logits: torch.Tensor) -> None:
        """Masks the one row `logits` [1, V] with a late fill that is in."""
        assert late.job is not None and late.job.done
        if late.job.result:
            self.backend.apply_bitmask(logits, late.bitmask[late.row : late.row + 1], [0])

    def _record(self, seconds: float) -> None:
        self.fill_seconds.append(seconds)
        if self.on_fill is not None:
            self.on_fill(seconds)

    def shutdown(self) -> None:
        if self.workers is not None:
            self.workers.shutdown()
