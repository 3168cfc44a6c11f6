"""Quest with the host tier: which of a request's pages live on the device, which are parked.

A `quest` request with `offload=True` keeps in its page table, on the device, its first page (the
attention sinks) and its last `RECENT_PAGES` pages (being written). Every other full page is parked
in the host store (`kvcache.host_tier`) and its page-table entry becomes `num_pages + host slot`;
the page's Quest bounds are copied to that id, so selection still runs on the device over every
page.

Parked pages a step selects are read per layer: from the request's hot set when that layer and KV
head selected them recently (`kvcache.hot_set`: `hot_pages` pool pages whose cells hold, per layer
and head, an LRU of parked pages), else from the host tier in one copy per layer, which also fills
the hot set. A full page never changes, so its host copy stays valid and nothing is written back.

The hot set is a cache: it grows into free pool pages after a step (up to `hot_pages`, leaving a
page per running offloaded request), and when the scheduler needs pages it takes them back from
the largest hot sets before it preempts anyone.

Admission reserves the request's host pages up front (a tenant over its cap is refused there, not
mid-decode); finishing, cancelling or preempting a request returns every page on both tiers (a
preempted request keeps its reservation: it is recomputed later).
"""

from __future__ import annotations

import torch

from kvcache.host_slots import HostTierFull, Owner
from kvcache.host_tier import HostPageStore
from kvcache.hot_set import DictHotSet, HotSet, NativeHotSet, Router
from kvcache.pages import PagedKVCache, pages_needed
from services.engine.request import Request
from services.engine.scheduler import Scheduler

RECENT_PAGES = 2  # the page being written and the one before stay resident


def owner(req: Request) -> Owner:
    return (req.tenant, req.request_id)


class OffloadManager:
    def __init__(
        self,
        kv: PagedKVCache,
        store: HostPageStore,
        scheduler: Scheduler,
        router: Router | None = None,
    ) -> None:
        """`router`: hot sets routed in C (`kvcache/hot_set.c`); None: the plain twin."""
        self.kv, self.store, self.scheduler, self.router = kv, store, scheduler, router
        self.active: dict[str, Request] = {}  # admitted offloaded requests, by request id
        kv.attach_host(store)

    def admit(self, req: Request) -> str | None:
        """Reserves the host pages the request may park; the refusal message when it cannot."""
        assert req.kv_state is not None
        try:
            self.store.reserve(owner(req), self._pages(req))
        except HostTierFull as exc:
            return f"kv.offload: {exc}"
        req.kv_state.tier = self._empty_hot_set()
        self.active[req.request_id] = req
        return None

    def release(self, req: Request) -> None:
        """Every host page and hot-set page of the request goes back (its page table's device
        pages are the scheduler's)."""
        state = req.kv_state
        if state is None or state.tier is None:
            return
        # No fence: host reads land in fresh tensors and the hot set is filled from them on the
        # compute stream, so no side-stream copy can still be writing into the pages freed here.
        self.store.release(owner(req))
        self.scheduler.allocator.free(state.tier.shrink(state.tier.ways))
        state.tier = self._empty_hot_set()
        if req.finish_reason is None:  # preempted: it runs again, with the same reservation
            self.store.reserve(owner(req), self._pages(req))
        else:
            self.active.pop(req.request_id, None)

    def _empty_hot_set(self) -> HotSet:
        layers, heads = self.kv.layout.num_layers, self.kv.layout.num_kv_heads
        if self.router is None:
            return DictHotSet(layers, heads)
        return NativeHotSet(layers, heads, self.router)

    def _pages(self, req: Request) -> int:
        return pages_needed(req.num_prompt_tokens + req.params.max_tokens, self.kv.page_size)

    @torch.inference_mode()  # the pool and the bounds are inference tensors
    def after_step(self, req: Request) -> None:
        """Selections counted, the hot set grown into free pages, cold full pages parked."""
        state = req.kv_state
        assert state is not None and state.tier is not None
        hot: HotSet = state.tier
        resident, hits, misses = hot.take_counts()
        self.store.record_hits(resident + hits, misses)
        alloc = self.scheduler.allocator
        room = alloc.num_free - len(self.active)  # a page for each offloaded request's next token
        grow = min(state.policy.hot_budget_pages - hot.ways, room)
        if grow > 0:
            hot.grow(alloc.allocate(grow))
        self._park_cold(req)

    def reclaim(self, n: int) -> int:
        """Frees up to `n` hot-set pages, from the largest hot sets first; returns how many."""
        freed: list[int] = []
        by_size = sorted(self.active.values(), key=lambda r: -self._hot(r).ways)
        for req in by_size:
            freed += self._hot(req).shrink(n - len(freed))
            if len(freed) >= n:
                break
        self.scheduler.allocator.free(freed)
        return len(freed)

    def _park_cold(self, req: Request) -> None:
        table, num_pages = req.pages, self.kv.num_pages
        full = req.num_computed_tokens // self.kv.page_size
        last = min(full, len(table) - RECENT_PAGES)
        cold = [i for i in range(1, last) if table[i] < num_pages]
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
        s = self.kv.bound_cells(torch.tensor(src, device=self.kv.device)).flatten()
        d = self.kv.bound_cells(torch.tensor(dst, device=self.kv.device)).flatten()
        for bounds in (self.kv.bounds_min, self.kv.bounds_max):
            bounds.index_copy_(2, d, bounds.index_select(2, s))

    def device_pages(self, req: Request) -> int:
        """Pool pages the request holds: its resident table pages and its hot set."""
        hot = 0 if req.kv_state is None or req.kv_state.tier is None else req.kv_state.tier.ways
        return sum(1 for p in req.pages if p < self.kv.num_pages) + hot

    @staticmethod
    def _hot(req: Request) -> HotSet:
        assert req.kv_state is not None and req.kv_state.tier is not None
        return req.kv_state.tier
