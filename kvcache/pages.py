"""The paged KV pool: fixed-size pages in one preallocated tensor per layer, handed out on demand.

A request owns a page table (a list of page ids); token `t` of the request lives in slot
`table[t // page_size] * page_size + t % page_size`. Pages are taken as tokens arrive and returned
when the request ends or is preempted, so KV memory in use grows with tokens held, not with
`max_tokens`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvcache.native import AttentionKernel


class OutOfPages(RuntimeError):
    """Raised when an allocation asks for more pages than are free (the scheduler checks first)."""


class PageAllocator:
    """A free list of page ids with a reference count each; O(1) allocate and free.

    A page is handed out with one reference; `free` drops one and the page is free again at zero.
    Only the prefix cache (`kvcache.prefix`) takes a second reference, to share a page.
    `on_first_use` is called with pages handed out for the first time (the pool zeroes them).

    The free list is a stack: the page freed last is handed out first. Its memory is still in
    the caches and mapped, where a page never used costs a first write (and, on CPU, the
    operating system's page faults) before any token lands in it.
    """

    def __init__(
        self, num_pages: int, on_first_use: Callable[[list[int]], None] | None = None
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages: must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages - 1, -1, -1))  # page 0 on top
        self._refs = [0] * num_pages
        self._touched = [False] * num_pages
        self._on_first_use = on_first_use

    @property
    def num_free(self) -> int:
        """Pages an `allocate` can hand out now."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfPages(f"asked for {n} pages, {self.num_free} free")
        pages = self._take(n)
        fresh = [p for p in pages if not self._touched[p]]
        for p in pages:
            self._refs[p] = 1
            self._touched[p] = True
        if fresh and self._on_first_use is not None:
            self._on_first_use(fresh)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drops one reference to each page."""
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"page {p} freed twice")
            self._refs[p] -= 1
            if not self._refs[p]:
                self._released(p)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def _take(self, n: int) -> list[int]:
        return [self._free.pop() for _ in range(n)]

    def _released(self, page: int) -> None:
        self._free.append(page)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one token across every layer."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    def pages_for_budget(self, budget_bytes: int) -> int:
        return max(1, budget_bytes // self.bytes_per_page)


class HostPages(Protocol):
    """A host tier the attention function reads parked pages from (`kvcache.host_tier`)."""

    capacity_pages: int

    def read_cells(self, layer: int, cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[n, ps, D]` keys and values of one layer's host cells on the pool's device.

        `cells` (a CPU index): `head * capacity_pages + slot`, one KV head of one parked page."""
        ...

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values `[KVH, capacity_pages * ps, D]`, where they lie."""
        ...

    def count_read(self, cells: int) -> None:
        """Counts `cells` read in place (as `read_cells` counts what it copies)."""
        ...

    def record_read(self, cells: int, seconds: float) -> None:
        """Counts `cells` copied out of `layer()` by another copy, and its time (a read)."""
        ...


class PagedKVCache:
    """Keys and values of every layer, `[num_layers, kv_heads, num_slots, head_dim]` each.

    Head-major within a layer: gathering a request's pages yields each head's tokens contiguous,
    the layout attention kernels read without another copy.

    Allocated with `torch.empty`: on CPU the operating system commits memory only for the pages
    that are written, on CUDA the budget is reserved up front as vLLM does. A page is zeroed when
    first handed out: attention reads padding slots under a mask, and 0 * NaN from uninitialised
    memory would still poison the output.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        device: torch.device,
        allocator: type[PageAllocator] = PageAllocator,
        bound_splits: int = 1,
    ) -> None:
        if bound_splits < 1 or layout.page_size % bound_splits:
            raise ValueError(f"bound_splits: a divisor of the page size, got {bound_splits}")
        self.layout = layout
        self.bound_splits = bound_splits
        self.num_pages = num_pages
        self.device = device
        shape = (
            layout.num_layers,
            layout.num_kv_heads,
            num_pages * layout.page_size,
            layout.head_dim,
        )
        # Post-RoPE keys: every policy that scores keys (Quest bounds, SnapKV) wants them rotated.
        self.keys = torch.empty(shape, dtype=layout.dtype, device=device)
        self.values = torch.empty(shape, dtype=layout.dtype, device=device)
        self.allocator = allocator(num_pages, on_first_use=self._zero_pages)
        self._zero_pages([0])  # page 0 pads every gather
        self._workspace = torch.empty(0, dtype=layout.dtype, device=device)
        # Allocated on first use by a policy that needs them (see `kvcache.policies`):
        # [layers, KVH, slots + 1] float32 per-token scores (H2O, SnapKV); the last slot is a
        # sink for padded key positions, so a batched scatter never touches a real token's score.
        self.scores = torch.empty(0, device=device)
        # [layers, KVH, (num_pages + host pages) * bound_splits, D] channel-wise min and max of
        # the keys of each equal part of each page (Quest; `bound_cells`; one part: the page).
        # Page ids from `num_pages` on name host slots (`host`): their bounds stay here, on the
        # device, so selection never waits for the host.
        self.bounds_min = torch.empty(0, dtype=layout.dtype, device=device)
        self.bounds_max = torch.empty(0, dtype=layout.dtype, device=device)
        self.host: HostPages | None = None
        # Queries read pages in place through this kernel (kvcache/native.py's C kernel on CPU,
        # kvcache/triton_attention.py's on CUDA) when set; None: they gather pages into the
        # workspace and run SDPA (the plain twin).
        self.kernel: AttentionKernel | None = None

    def attach_host(self, host: HostPages) -> None:
        """Page id `num_pages + s` now names host slot `s` (a parked page)."""
        if self.bounds_min.numel():
            raise RuntimeError("attach the host tier before the first Quest request")
        self.host = host

    @property
    def num_ids(self) -> int:
        """Device pages plus host slots: the ids a page table may hold."""
        return self.num_pages + (self.host.capacity_pages if self.host is not None else 0)

    @property
    def trash_slot(self) -> int:
        return self.num_pages * self.layout.page_size

    def ensure_scores(self) -> None:
        if not self.scores.numel():
            lay = self.layout
            shape = (lay.num_layers, lay.num_kv_heads, self.trash_slot + 1)
            self.scores = torch.zeros(shape, dtype=torch.float32, device=self.device)

    def ensure_bounds(self) -> None:
        if not self.bounds_min.numel():
            lay = self.layout
            shape = (
                lay.num_layers,
                lay.num_kv_heads,
                self.num_ids * self.bound_splits,
                lay.head_dim,
            )
            self.bounds_min = torch.zeros(shape, dtype=lay.dtype, device=self.device)
            self.bounds_max = torch.zeros(shape, dtype=lay.dtype, device=self.device)

    def bound_cells(self, pages: torch.Tensor) -> torch.Tensor:
        """`[..., bound_splits]` the bound cells of each page id in `pages` (its parts in order)."""
        splits = self.bound_splits
        return pages[..., None] * splits + torch.arange(splits, device=pages.device)

    def workspace(self, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two reusable `[kv_heads, num_pages, page_size, head_dim]` buffers for gathered pages.

        Grows on demand and is reused by every layer and step: allocating tens of MB per layer
        costs page faults on CPU and allocator churn on CUDA.
        """
        lay = self.layout
        per = lay.num_kv_heads * num_pages * lay.page_size * lay.head_dim
        if self._workspace.numel() < 2 * per:
            self._workspace = torch.empty(2 * per, dtype=lay.dtype, device=self.device)
        shape = (lay.num_kv_heads, num_pages, lay.page_size, lay.head_dim)
        return self._workspace[:per].view(shape), self._workspace[per : 2 * per].view(shape)

    def _zero_pages(self, pages: list[int]) -> None:
        if not pages:
            return
        index = torch.tensor(pages, device=self.device)
        for pool in (self.keys, self.values):  # one fill per pool, not one per page and layer
            layers, heads = pool.shape[:2]
            pool.view(layers, heads, self.num_pages, -1).index_fill_(2, index, 0.0)

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def bytes_in_use(self) -> int:
        return self.allocator.num_used * self.layout.bytes_per_page

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.layout.bytes_per_page
