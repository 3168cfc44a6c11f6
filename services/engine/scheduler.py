"""Continuous batching: which tokens of which requests the next forward pass computes.

Each step first serves running requests (a decode token each, or the next chunk of a prompt), then
admits waiting ones while the token budget, the batch size and free pages allow. When a running
request needs a page and none is free, the most recently admitted request is preempted: its pages
are freed and it goes back to the head of the queue, to be recomputed later (vLLM's recompute mode).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvcache.pages import PageAllocator, pages_needed
from services.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    page_size: int = 16

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.page_size < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and page_size must be >= 1")


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens `[start, start + num_tokens)` of `request`, computed this step."""

    request: Request
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the end of the request's tokens: a new token is sampled."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator) -> None:
        self.config = config
        self.allocator = allocator
        # called when a request's pages go back (finish, preemption): the host tier frees its own
        self.on_release: Callable[[Request], None] | None = None
        # asked for pages before anyone is preempted (the host tier's hot sets are a cache)
        self.reclaim: Callable[[int], int] | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_uncomputed_tokens, budget, self._chunk_limit(req))
            while not self._reserve_pages(req, req.num_cached_tokens + n):
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
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        cfg = self.config
        not_ready: list[Request] = []  # grammar still compiling: keep their place in the queue
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting.popleft()
            if not req.ready:
                not_ready.append(req)
                continue
            n = min(req.num_uncomputed_tokens, self._chunk_limit(req))
            if n > budget and cfg.enable_chunked_prefill:
                n = budget
            fits = n <= budget or not out.chunks  # unchunked: a long prompt runs alone, not never
            if not fits or not self._reserve_pages(req, req.num_cached_tokens + n):
                self.waiting.appendleft(req)
                break
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
        self.waiting.extendleft(reversed(not_ready))

    def _chunk_limit(self, req: Request) -> int:
        """A bounded KV policy takes its prompt in chunks its budget can hold."""
        state = req.kv_state
        if state is None:
            return req.num_uncomputed_tokens
        limit = state.chunk_limit(
            req.num_computed_tokens, req.num_prompt_tokens, self.config.page_size
        )
        return req.num_uncomputed_tokens if limit is None else limit

    def _reserve_pages(self, req: Request, num_tokens: int) -> bool:
        missing = pages_needed(num_tokens, self.config.page_size) - len(req.pages)
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
        for req in reversed(self.running):
            if id(req) not in scheduled:
                return req
        raise AssertionError("a scheduled request cannot be preempted")  # pragma: no cover

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self._free_all(req)
        req.num_computed_tokens = 0
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
        # ids past the pool name parked pages (host tier): `on_release` frees those
        self.allocator.free([p for p in req.pages if p < self.allocator.num_pages])
        req.pages = []
        if self.on_release is not None:
            self.on_release(req)
