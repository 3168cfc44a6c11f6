"""The fair-share half of the scheduler (services/engine/scheduler.py), on the virtual times of
services/engine/fairness.py: the next request admitted is the backlogged tenant's with the least
virtual time, a tenant below its share of batch slots takes one from the tenant furthest over its
own, and prompt tokens per step are split between the tenants with prompts to compute.

With `newcomer_steps=True` a tenant with nothing running has its first chunk computed in a step
of its own, the running requests waiting that one step: its first token costs a small forward
instead of the whole batch's (on a CPU a batch of 16 decodes takes about twice as long as one).
Never two such steps in a row, so the others' decodes advance at least every other step, and a
tenant has at most one in `NEWCOMER_GAP` steps, so one sending request after request (an abort
storm) cannot take them all.

While any interactive request runs or waits, and `BATCH_HOLD_S` after, the batch class (Batch API
lines) computes at most `batch_rows` of its running rows a step, the oldest, and admits no more
beyond them; the others keep their pages and slots. Its weight decides who is admitted, not how
long the steps an interactive request shares with a full batch of lines take (on a CPU, about the
rows they hold). With `batch_prefill` set, the batch class computes at most that many prompt
tokens a step, alone or not, so the step an interactive request arriving at a busy engine waits
out is short too (at some cost to the batch's throughput).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.engine.config import SchedulingConfig
from services.engine.fairness import FairShares, is_batch
from services.engine.request import Request

if TYPE_CHECKING:
    from services.engine.scheduler import SchedulerOutput

NEWCOMER_GAP = 8  # steps between two newcomer steps of one tenant
# the batch class stays narrow this long after the last interactive work: interactive requests
# come in bursts, and the first of the next would wait for a step of every batch row
BATCH_HOLD_S = 2.0


class FairPolicy:
    """Mixed into `Scheduler`, whose state it reads and whose admission it calls."""

    config: SchedulingConfig
    shares: FairShares
    waiting: deque[Request]
    running: list[Request]
    newcomer_steps: bool
    batch_rows: int | None
    clock: Callable[[], float]
    _caps: dict[str, int] | None
    _batch_room: int | None
    _batch_tokens: int | None
    _interactive_at: float
    _steps: int
    _newcomer_last: bool
    _newcomer_at: dict[str, int]

    def _admit_waiting(
        self, out: SchedulerOutput, budget: int, only: set[str] | None = None
    ) -> None:
        raise NotImplementedError

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        raise NotImplementedError

    def _newcomer_step(self, out: SchedulerOutput) -> bool:
        """Admits only tenants with nothing running, when others are running (True: done)."""
        last, self._newcomer_last = self._newcomer_last, False
        self._steps += 1
        if not self.newcomer_steps or last or not self.running:
            return False
        now, recent = self._steps, self._newcomer_at
        busy = {r.tenant for r in self.running} | {
            t for t, at in recent.items() if now - at < NEWCOMER_GAP
        }
        fresh = {r.tenant for r in self.waiting if r.ready and r.tenant not in busy}
        if not fresh:
            return False
        self._caps = self._prefill_caps(fresh)
        admitted = len(out.chunks)
        self._admit_waiting(out, self.config.max_num_batched_tokens, only=fresh)
        self._newcomer_last = len(out.chunks) > admitted
        if not self._newcomer_last:  # no room for them (pages): an ordinary step
            self._caps = self._prefill_caps()
            return False
        self._newcomer_at = {t: at for t, at in recent.items() if now - at < NEWCOMER_GAP}
        self._newcomer_at.update({c.request.tenant: now for c in out.chunks[admitted:]})
        return True

    def _batch_rows_now(self) -> int | None:
        """Batch-class rows this step may compute (None: any): `batch_rows` while interactive
        work runs or waits, and `BATCH_HOLD_S` after."""
        if self.batch_rows is None or self.batch_rows >= self.config.max_num_seqs:
            return None
        now = self.clock()
        work = (r.tenant for q in (self.running, self.waiting) for r in q)
        if any(not is_batch(t) for t in work):
            self._interactive_at = now
        return self.batch_rows if now - self._interactive_at < BATCH_HOLD_S else None

    def _batch_row(self, req: Request) -> bool:
        """Whether `req` may be computed this step (takes one of the batch class's rows)."""
        if self._batch_room is None or not is_batch(req.tenant):
            return True
        if self._batch_room <= 0:
            return False
        self._batch_room -= 1
        return True

    def _ready_waiting(self) -> Counter[str]:
        return Counter(r.tenant for r in self.waiting if r.ready)

    def _slot_shares(self) -> dict[str, int]:
        held, waiting = Counter(r.tenant for r in self.running), self._ready_waiting()
        demand = {t: held[t] + waiting[t] for t in held | waiting}
        return self.shares.split(self.config.max_num_seqs, demand)

    def _rebalance_slots(self, out: SchedulerOutput) -> None:
        """A full batch gives the slots of tenants over their share to those waiting under it."""
        if len(self.running) < self.config.max_num_seqs or not self.waiting:
            return
        shares, waiting = self._slot_shares(), self._ready_waiting()
        held = Counter(r.tenant for r in self.running)
        for tenant in sorted(waiting, key=self.shares.vtime):
            for _ in range(min(waiting[tenant], shares[tenant] - held[tenant])):
                over = self.shares.most_over(held, shares)
                if over is None:
                    return
                victim = next(r for r in reversed(self.running) if r.tenant == over)
                self._preempt(victim, out)
                held[over] -= 1
                held[tenant] += 1  # the slot is the waiting tenant's now (admitted below)

    def _prefill_caps(self, only: set[str] | None = None) -> dict[str, int] | None:
        """Prompt tokens each tenant (of `only`: a newcomer step, no decodes) may compute this
        step (None: nobody else wants any)."""
        if not self.config.enable_chunked_prefill:
            return None
        demand: Counter[str] = Counter()
        decodes = 0
        for r in self.running if only is None else ():
            if r.num_uncomputed_tokens > 1:
                demand[r.tenant] += r.num_uncomputed_tokens
            else:
                decodes += 1
        for r in self.waiting:
            if r.ready and (only is None or r.tenant in only):
                demand[r.tenant] += r.num_uncomputed_tokens
        if len(demand) < 2:
            return None
        budget = max(0, self.config.max_num_batched_tokens - decodes)
        return self.shares.split(budget, dict(demand))

    def _capped(self, req: Request, n: int) -> int:
        """`n` within the tenant's prompt tokens left this step, and the batch class's (decode
        tokens: never capped)."""
        if req.num_uncomputed_tokens <= 1:
            return n
        if self._caps is not None:
            n = min(n, self._caps.get(req.tenant, 0))
            self._caps[req.tenant] = self._caps.get(req.tenant, 0) - n
        if self._batch_tokens is not None and is_batch(req.tenant):
            n = min(n, self._batch_tokens)
            self._batch_tokens -= n
        return n

    def _next_waiting(self, skip: set[int], only: set[str] | None = None) -> Request | None:
        """Fair: the first ready request of the tenant with the least virtual time (of `only`),
        among those under their slot share if any is; else the first ready one."""
        if not self.config.fair_scheduling:
            return next((r for r in self.waiting if r.ready and id(r) not in skip), None)
        full = self._batch_room is not None and self._batch_room <= 0
        ready = [
            r
            for r in self.waiting
            if r.ready
            and id(r) not in skip
            and (only is None or r.tenant in only)
            and not (full and is_batch(r.tenant))
        ]
        if not ready:
            return None
        tenants = list(dict.fromkeys(r.tenant for r in ready))
        shares = self._slot_shares()
        held = Counter(r.tenant for r in self.running)
        under = [t for t in tenants if held[t] < shares.get(t, 0)] or tenants
        tenant = self.shares.next_tenant(under)
        return next(r for r in ready if r.tenant == tenant)
