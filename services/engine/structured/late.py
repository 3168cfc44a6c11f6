"""Constrained requests waiting for grammar work that missed its deadline.

A request leaves the step when its grammar is not ready in time (masks.py); it is parked here
with what the step had already computed for it, and takes no part in later steps until the work
is in, so every other request goes on as if it were not in the batch:

- **A late mask**: the row's logits, after penalties and bias, are kept (one row of the
  vocabulary per parked request). Once the fill is in, the engine masks them, samples and
  takes the token exactly as the step would have: nothing is computed twice, so the tokens are
  those of a step that had waited, and every KV policy sees each position once. A request
  preempted while parked loses its logits (its pages are gone) and is recomputed once the fill
  returns (its matcher is never used by two threads at once).
- **Late forced text** (jump-forward): the sampled token is accepted, and the rest of its path
  (appending the forced span, stops) runs once the text is in.

The grammar's CPU time decides, not the wall clock: a parked fill whose CPU time passes the
mask budget is demoted to idle cores, and a request whose slow masks add up to `mask_strikes`
budgets fails with a 422 naming its grammar and refuses the grammar (`GrammarManager._refuse`),
even while the fill is still running.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.engine.request import Request, StructuredRequest
from services.engine.structured.masks import LateFill, MaskFiller
from services.grammar.workers import Job

# What a late jump-forward does once its text is in: (forced text, stage namer) -> None.
Resume = Callable[[str, Callable[[str], None]], None]


@dataclass(eq=False)
class Parked:
    fill: LateFill | None = None  # a late mask
    logits: torch.Tensor | None = None  # [1, V] its row, kept for sampling later
    preemptions: int = 0  # the request's count when parked: its logits hold while unchanged
    forced: Job | None = None  # late forced text
    resume: Resume | None = None  # its token path's rest

    @property
    def job(self) -> Job | None:
        return self.fill.job if self.fill is not None else self.forced

    @property
    def done(self) -> bool:
        job = self.job
        return job is not None and job.done

    def logits_hold(self, req: Request) -> bool:
        return self.logits is not None and req.metrics.num_preemptions == self.preemptions


class LateRows:
    def __init__(
        self,
        masks: Callable[[], MaskFiller],
        budget_s: float,
        strikes: float,
        over_budget: Callable[[Request, StructuredRequest], Any],
        raised: Callable[[Request, StructuredRequest, BaseException], Any],
    ) -> None:
        self._masks = masks  # the manager's filler, made on first use
        self._budget_s = budget_s
        self._strikes = strikes
        # the manager's `Failure`s: out of mask budget (refused), and a grammar that raised
        self._over_budget = over_budget
        self._raised = raised
        self.requests: list[Request] = []
        self.parked = 0  # requests that left a step for late grammar work (telemetry, tests)

    def park_mask(self, req: Request, fill: LateFill, logits: torch.Tensor) -> None:
        s = req.structured
        assert s is not None
        kept = logits.clone()
        s.parked = Parked(fill=fill, logits=kept, preemptions=req.metrics.num_preemptions)
        self.requests.append(req)
        self.parked += 1

    def park_forced(self, req: Request, job: Job, resume: Resume) -> None:
        s = req.structured
        assert s is not None
        s.parked = Parked(forced=job, resume=resume)
        self.requests.append(req)
        self.parked += 1

    def poll(self) -> tuple[list[tuple[Request, Parked]], list[Any]]:
        """The parked requests whose work is in (unparked), and the failures: a grammar that
        raised, or one whose slow work passed the strikes (a `Failure` each)."""
        ready, failed, still = [], [], []
        for req in self.requests:
            s = req.structured
            parked = s.parked if s is not None else None
            if s is None or parked is None or req.finished:
                if s is not None:
                    s.parked = None
                continue
            if parked.fill is not None and parked.fill.job is None:
                self._masks().resume(parked.fill)  # held behind its tenant's stragglers
            job = parked.job
            if job is None:
                still.append(req)
                continue
            cpu = job.cpu_seconds()
            if not job.done and cpu > self._budget_s:
                self._masks().workers.demote(job)  # type: ignore[union-attr]
            over = s.mask_over_budget_s + (cpu if cpu > self._budget_s else 0.0)
            if over >= self._strikes * self._budget_s:
                s.mask_over_budget_s, s.parked = over, None
                failed.append(self._over_budget(req, s))
            elif not job.done:
                still.append(req)
            else:
                s.mask_over_budget_s, s.parked = over, None
                if job.error is not None:
                    failed.append(self._raised(req, s, job.error))
                else:
                    ready.append((req, parked))
        self.requests = still
        return ready, failed

    def jobs(self) -> list[Job]:
        """The work parked requests wait for (an idle engine waits on it, not in a busy loop)."""
        out = []
        for req in self.requests:
            parked = req.structured.parked if req.structured is not None else None
            job = parked.job if parked is not None else None
            if job is not None:
                out.append(job)
        return out
