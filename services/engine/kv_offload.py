"""Quest with the host tier: which of a request's pages live on the device, which are parked.

A `quest` request with `offload=True` keeps on the device its first page (the attention sinks),
its last `RECENT_PAGES` pages (being written), and a hot set of up to `hot_pages` pages it selected
recently (least recently selected goes first). Every other full page is parked in the host store
(`services.kv_tier`) and its page-table entry becomes `num_pages + host slot`; the page's Quest
bounds are copied to that id, so selection still runs on the device over every page. When a step
selects parked pages, attention reads them from the host tier in one copy per layer; after the step
the ones selected are promoted into the hot set (one batched recall of every layer), evicting the
least recently selected. A full page never changes, so its host copy stays valid: eviction from
the hot set only frees the device page.

Admission reserves the request's host pages up front (a tenant over its cap is refused there, not
mid-decode); finishing, cancelling or preempting a request returns every page on both tiers (a
preempted request keeps its reservation: it is recomputed later).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from kvcache.pages import PagedKVCache, pages_needed
from services.engine.request import Request
from services.engine.scheduler import Scheduler
from services.kv_tier import HostPageStore, HostTierFull, Owner

RECENT_PAGES = 2  # the page being written and the one before stay resident


@dataclass
class TierState:
    """One request's pages on the host: device page -> host slot for hot pages, in LRU order."""

    hot: OrderedDict[int, int] = field(default_factory=OrderedDict)


def owner(req: Request) -> Owner:
    return (req.tenant, req.request_id)


class OffloadManager:
    def __init__(self, kv: PagedKVCache, store: HostPageStore, scheduler: Scheduler) -> None:
        self.kv, self.store, self.scheduler = kv, store, scheduler
        kv.attach_host(store)

    def admit(self, req: Request) -> str | None:
        """Reserves the host pages the request may park; the refusal message when it cannot."""
        assert req.kv_state is not None
        try:
            self.store.reserve(owner(req), self._pages(req))
        except HostTierFull as exc:
            return f"kv.offload: {exc}"
        req.kv_state.tier = TierState()
        return None

    def release(self, req: Request) -> None:
        """Every host page of the request goes back (device pages are the scheduler's)."""
        state = req.kv_state
        if state is None or state.tier is None:
            return
        self.store.fence()  # a recall still writing into pages about to be reused
        self.store.release(owner(req))
        state.tier = TierState()
        if req.finish_reason is None:  # preempted: it runs again, with the same reservation
            self.store.reserve(owner(req), self._pages(req))

    def _pages(self, req: Request) -> int:
        return pages_needed(req.num_prompt_tokens + req.params.max_tokens, self.kv.page_size)

    @torch.inference_mode()  # the pool and the bounds are inference tensors
    def after_step(self, req: Request) -> None:
        """Hot set from this step's reads, then every cold full page parked."""
        state = req.kv_state
        assert state is not None and state.tier is not None
        hot = state.tier.hot
        table, num_pages = req.pages, self.kv.num_pages
        reads = self.kv.tier_reads
        resident_reads = [p for p in table if p < num_pages and p in reads]
        parked_reads = [i for i, p in enumerate(table) if p >= num_pages and p in reads]
        self.store.record_hits(len(resident_reads), len(parked_reads))
        for p in resident_reads:
            if p in hot:
                hot.move_to_end(p)
        budget = state.policy.hot_budget_pages
        self._promote(req, parked_reads[-budget:] if budget else [])
        while len(hot) > budget:
            page, slot = hot.popitem(last=False)
            table[table.index(page)] = num_pages + slot
            self.scheduler.allocator.free([page])
        self._park_cold(req)

    def _promote(self, req: Request, indices: list[int]) -> None:
        alloc = self.scheduler.allocator
        indices = indices[: alloc.num_free]
        if not indices:
            return
        table, num_pages = req.pages, self.kv.num_pages
        slots = [table[i] - num_pages for i in indices]
        pages = alloc.allocate(len(indices))
        self.store.recall(self.kv, slots, pages, owner(req)).wait()
        self._copy_bounds([num_pages + s for s in slots], pages)
        hot = req.kv_state.tier.hot  # type: ignore[union-attr]
        for i, page, slot in zip(indices, pages, slots, strict=True):
            table[i] = page
            hot[page] = slot

    def _park_cold(self, req: Request) -> None:
        table, num_pages = req.pages, self.kv.num_pages
        hot = req.kv_state.tier.hot  # type: ignore[union-attr]
        full = req.num_computed_tokens // self.kv.page_size
        last = min(full, len(table) - RECENT_PAGES)
        cold = [i for i in range(1, last) if table[i] < num_pages and table[i] not in hot]
        if not cold:
            return
        pages = [table[i] for i in cold]
        slots = self.store.park(self.kv, pages, owner(req))
        self._copy_bounds(pages, [num_pages + s for s in slots])
        for i, slot in zip(cold, slots, strict=True):
            table[i] = num_pages + slot
        self.scheduler.allocator.free(pages)

    def _copy_bounds(self, src: list[int], dst: list[int]) -> None:
        if not self.kv.bounds_min.numel():
            return
        s = torch.tensor(src, device=self.kv.device)
        d = torch.tensor(dst, device=self.kv.device)
        for bounds in (self.kv.bounds_min, self.kv.bounds_max):
            bounds.index_copy_(2, d, bounds.index_select(2, s))

    def device_pages(self, req: Request) -> int:
        return sum(1 for p in req.pages if p < self.kv.num_pages)
