"""Continuous batching: which tokens of which requests the next forward pass computes.

Each step first serves running requests (a decode token each, or the next chunk of a prompt), then
admits waiting ones while the token budget, the batch size and free pages allow. When a running
request needs a page and none is free, the most recently admitted request is preempted: its pages
are freed and it goes back to the head of the queue, to be recomputed later (vLLM's recompute mode).

With `fair_scheduling=True` (the default) tenants share the engine by weight: who is admitted,
who is preempted, the prompt tokens each computes a step, newcomer steps and the batch class's
rows (`services/engine/fair_policy.py`, on `services/engine/fairness.py`'s virtual times).
`fair_scheduling=False` is the plain twin: arrival order, newest preempted.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvcache.pages import PageAllocator, pages_needed
from services.engine.config import EngineConfig, SchedulingConfig
from services.engine.fair_policy import BATCH_HOLD_S, FairPolicy
from services.engine.fairness import FairShares
from services.engine.prefix_cache import PrefixCache
from services.engine.request import Request, RequestStatus
from services.lora.manager import AdapterManager


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens `[start, start + num_tokens)` of `request`, computed this step, then the `draft`
    tokens after them (speculative decoding: verified once their logits are in)."""

    request: Request
    start: int
    num_tokens: int
    draft: tuple[int, ...] = ()

    @property
    def num_positions(self) -> int:
        return self.num_tokens + len(self.draft)

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the end of the request's tokens: a new token is sampled."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class Scheduler(FairPolicy):
    def __init__(
        self,
        config: SchedulingConfig,
        page_size: int,
        allocator: PageAllocator,
        shares: FairShares | None = None,
        newcomer_steps: bool = False,
        batch_rows: int | None = None,
        batch_prefill: int | None = None,
    ) -> None:
        """`newcomer_steps`, `batch_rows`, `batch_prefill`: the config's as decided for the
        device (fair only; None: no cap)."""
        self.config = config
        self.page_size = page_size
        self.newcomer_steps = config.fair_scheduling and newcomer_steps
        self.allocator = allocator
        self.shares = shares if shares is not None else FairShares()
        self._caps: dict[str, int] | None = None  # this step's prompt tokens per tenant
        self.batch_rows = batch_rows if config.fair_scheduling else None
        self._batch_room: int | None = None  # batch-class rows this step may still take
        self.batch_prefill = batch_prefill if config.fair_scheduling else None
        self._batch_tokens: int | None = None  # batch-class prompt tokens this step has left
        self._interactive_at = -BATCH_HOLD_S  # when interactive work was last seen
        self.clock: Callable[[], float] = time.monotonic
        # called when a request's pages go back (finish, preemption): the host tier frees its own
        self.on_release: Callable[[Request], None] | None = None
        # asked for pages before anyone is preempted (the host tier's hot sets are a cache)
        self.reclaim: Callable[[int], int] | None = None
        # automatic prefix caching (None: off): a request starts from its cached prefix
        self.prefix: PrefixCache | None = None
        # LoRA adapters' slots (None: off): a request holds its adapter's slot while running
        self.adapters: AdapterManager | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._steps = 0
        self._newcomer_last = False  # the last step was a newcomer step
        self._newcomer_at: dict[str, int] = {}  # tenant -> its last newcomer step (recent ones)

    @classmethod
    def for_engine(
        cls, config: EngineConfig, allocator: PageAllocator, device: torch.device
    ) -> Scheduler:
        shares = FairShares(dict(config.tenant_weights or {}))
        sched = config.scheduling
        newcomer, rows = sched.newcomer_steps_on(device), sched.batch_rows_on(device)
        prefill = sched.batch_prefill_on()
        return cls(sched, config.cache.page_size, allocator, shares, newcomer, rows, prefill)

    def add(self, request: Request) -> None:
        busy = {r.tenant for r in self.running} | {r.tenant for r in self.waiting}
        if request.tenant not in busy:
            self.shares.wake(request.tenant, busy)
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.prefix is not None:  # pages the last step filled, for requests admitted now
            self.prefix.step(self.running)
        fair = self.config.fair_scheduling
        if fair:
            self._rebalance_slots(out)
            self._caps = self._prefill_caps()
        self._batch_room = self._batch_rows_now()
        self._batch_tokens = self.batch_prefill
        if not self._newcomer_step(out):
            short = self._schedule_running(out, self.config.max_num_batched_tokens)
            if short is not None:  # no pages were short: there may be room for more
                self._admit_waiting(out, short)
                self._add_drafts(out)
        for c in out.chunks:
            self.shares.charge(c.request.tenant, c.num_positions)
        self.shares.stepped(sum(c.num_positions for c in out.chunks))
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int | None:
        """The budget left, or None when pages ran short (requests were preempted for them)."""
        scheduled: set[int] = set()
        short = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if not self._batch_row(req):  # a batch line paused beside interactive work
                i += 1
                continue
            n = self._capped(req, min(req.num_uncomputed_tokens, budget, self._chunk_limit(req)))
            if n == 0:  # its tenant's prompt tokens for this step are spent
                i += 1
                continue
            while not self._reserve_pages(req, req.num_cached_tokens + n):
                short = True
                victim = self._pick_victim(scheduled)
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
                scheduled.add(id(req))
                budget -= n
                i += 1
                continue
            # `req` itself was preempted: the list shifted, index i is the next request
        return None if short else budget

    def _admit_waiting(
        self, out: SchedulerOutput, budget: int, only: set[str] | None = None
    ) -> None:
        """Requests whose grammar is still compiling keep their place in the queue."""
        cfg = self.config
        capped: set[int] = set()  # their tenant's prompt tokens are spent for this step
        while budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self._next_waiting(capped, only)
            if req is None:
                break
            cached = self.prefix.map(req) if self.prefix is not None else 0
            if cached is None:  # its next page is being computed: it waits for it
                capped.add(id(req))
                continue
            n = min(req.num_uncomputed_tokens, self._chunk_limit(req))
            if n > budget and cfg.enable_chunked_prefill:
                n = budget
            n = self._capped(req, n)
            fits = n <= budget or not out.chunks  # unchunked: a long prompt runs alone, not never
            if n and fits and not self._take_slot(req):  # its adapter waits for a free slot
                if self.prefix is not None:
                    self.prefix.unmap(req)
                capped.add(id(req))
                continue
            if n == 0 or not fits or not self._reserve_pages(req, req.num_cached_tokens + n):
                self._drop_slot(req)
                if self.prefix is not None:
                    self.prefix.unmap(req)
                if n == 0:
                    capped |= {id(r) for r in self.waiting if r.tenant == req.tenant}
                    continue
                break
            if self.prefix is not None:
                self.prefix.admitted(req, cached)
            self._batch_row(req)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n

    def _take_slot(self, req: Request) -> bool:
        if req.lora_name is None or self.adapters is None:
            return True
        loads = self.adapters.loads
        slot = self.adapters.acquire(req.lora_name)
        if self.adapters.loads > loads:  # the step waits for the copy: its tenant's work
            self.shares.charge_time(req.tenant, self.adapters.last_load_s)
        req.lora_slot = -1 if slot is None else slot
        return slot is not None

    def _drop_slot(self, req: Request) -> None:
        if req.lora_slot >= 0 and self.adapters is not None and req.lora_name is not None:
            self.adapters.release(req.lora_name)
        req.lora_slot = -1

    def _add_drafts(self, out: SchedulerOutput) -> None:
        """Decode chunks take their request's draft (speculative decoding) in what is left of
        the step's token budget and of the free pages once everyone else is scheduled: nobody
        waits, is preempted, or loses a cached page for a guess."""
        budget = self.config.max_num_batched_tokens - sum(c.num_tokens for c in out.chunks)
        for i, c in enumerate(out.chunks):
            req = c.request
            room = min(len(req.draft), budget)
            if room < 1 or c.num_tokens != 1 or not c.samples or req.kv_state is not None:
                continue
            end = req.num_cached_tokens + 1 + room
            missing = pages_needed(end, self.page_size) - len(req.pages)
            if missing > 0:
                if not self.allocator.can_allocate(missing):
                    continue
                req.pages.extend(self.allocator.allocate(missing))
            out.chunks[i] = ScheduledChunk(req, c.start, 1, tuple(req.draft[:room]))
            budget -= room

    def _chunk_limit(self, req: Request) -> int:
        """A bounded KV policy takes its prompt in chunks its budget can hold."""
        state = req.kv_state
        if state is None:
            return req.num_uncomputed_tokens
        limit = state.chunk_limit(req.num_computed_tokens, req.num_prompt_tokens, self.page_size)
        return req.num_uncomputed_tokens if limit is None else limit

    def _reserve_pages(self, req: Request, num_tokens: int) -> bool:
        missing = pages_needed(num_tokens, self.page_size) - len(req.pages)
        if missing <= 0:
            return True
        short = missing - self.allocator.num_free
        if short > 0 and self.reclaim is not None:
            self.reclaim(short)
        if not self.allocator.can_allocate(missing):
            return False
        req.pages.extend(self.allocator.allocate(missing))
        return True

    def _pick_victim(self, scheduled: set[int]) -> Request:
        """The newest unscheduled request; fair: of the tenant furthest over its share of the
        running requests."""
        free = [r for r in self.running if id(r) not in scheduled]
        if not free:
            raise AssertionError("a scheduled request cannot be preempted")  # pragma: no cover
        if self.config.fair_scheduling:
            held = Counter(r.tenant for r in self.running)
            share = self.shares.split(len(self.running), dict.fromkeys(held))
            over = self.shares.most_over({r.tenant: held[r.tenant] for r in free}, share)
            if over is not None:
                return next(r for r in reversed(free) if r.tenant == over)
        return free[-1]

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self._free_all(req)
        req.num_computed_tokens = 0
        req.draft = []  # guessed for the step it no longer runs in
        req.prompt_logprobs = None  # recomputed with the prompt
        if req.kv_state is not None:  # recomputed from the first token: nothing evicted yet
            req.kv_state.evicted = req.kv_state.compactions = 0
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def release_pages(self, req: Request, pages: list[int]) -> None:
        """Frees pages a KV policy no longer needs (it compacted the request's cache)."""
        if pages:
            del req.pages[-len(pages) :]
            self.allocator.free(pages)

    def finish(self, req: Request) -> None:
        """Frees the request's pages and forgets it, wherever it is."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._free_all(req)
        req.status = RequestStatus.FINISHED

    def _free_all(self, req: Request) -> None:
        if self.prefix is not None:  # its full pages stay cached once free (unless it failed)
            self.prefix.offer(req)
            self.prefix.released(req)
        # ids past the pool name parked pages (host tier): `on_release` frees those
        self.allocator.free([p for p in req.pages if p < self.allocator.num_pages])
        req.pages = []
        self._drop_slot(req)
        if self.on_release is not None:
            self.on_release(req)
