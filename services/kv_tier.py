"""The KV host tier: a host-memory page store that parks device KV pages and recalls them.

For a Quest request with offload on, the device keeps the sink, recent and hot pages; the rest is
parked here and recalled when a step selects it (issue 7). This module is the store only: the
engine decides what to park, when to recall, and owns the device pages.

Arena. One allocation made at start-up, never grown: `[2, num_layers, kv_heads, capacity *
page_size, head_dim]` (keys then values), head-major per layer exactly like `PagedKVCache`, so host
slot `s` of layer `l` is `keys[l, :, s*ps:(s+1)*ps]` and a page moves as one slice per head. On CUDA
it is pinned (page-locked) so copies are DMA and can be asynchronous; pinning once avoids the
per-object pin/unpin leaks and allocation failures seen in LMCache. On CUDA the same allocation
carries a staging area (`staging_pages` full pages) that batched copies pass through.

Ownership. Slots belong to an owner `(tenant, request_id)`. `free` by a non-owner, a double free
or a recall naming a slot the owner does not hold raises `HostSlotError`, whose message never names
the real holder, so nothing an owner of tenant A holds can be read or learnt through tenant B.
`release(owner)` frees everything (request finished or cancelled): counts return to zero. Caps:
total capacity and per-tenant caps; `reserve` at admission sets pages aside so a later `park`
cannot fail mid-decode; exceeding a cap raises `HostTierFull` with the numbers, never a drop.

Copies. `park` gathers the pages of every layer on the device in one `index_select` per K/V and
scatters them into the arena with one `index_copy_`; it returns when the host copy is complete, so
the caller may free or reuse the device pages at once. `recall` gathers arena slots into staging
(CPU memcpy), then on a side stream copies host to device with `non_blocking=True` and scatters into
the device pages, recording an event; the returned handle's `wait()` makes the compute stream wait
on that event before attention reads the pages (the missing cross-stream sync behind vLLM #45704).
The side stream first waits for work already queued on the compute stream, because the pages being
written may have just been freed by a request whose attention is still queued. The arena itself is
never read asynchronously, so its slots may be freed as soon as `recall` returns. On CPU every copy
is synchronous and the handle is a no-op. A copy larger than staging is split into chunks.

Reads. `read_cells` is what attention uses: the cells one layer needs (a cell is one KV head of
one layer of a parked page), gathered into one batch and copied in one piece (on CUDA through
staging, on the side stream, the compute stream waiting on its event). `recall` brings whole pages
back into device pages, all layers or `layers=range(l, l+1)`.

What the engine must know. The host copy stays in place: a full page is immutable, so dropping a
device copy of a parked page needs no write-back. Before returning device pages that a recall may
still be writing (cancel mid-recall), call `handle.wait()` or `fence()`. Counters are cumulative
(take differences per step); `pages_recalled` counts full-page equivalents (`cells_recalled`: one
KV head of one layer of a page). Not thread-safe: the engine thread calls it, telemetry only reads
counters.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvcache.pages import KVLayout, PagedKVCache

Owner = tuple[str, str]  # (tenant, request_id)


class HostTierFull(RuntimeError):
    """A reservation or allocation would exceed a tenant's host cap or the store's capacity."""

    def __init__(self, tenant: str, asked: int, held: int, cap: int, scope: str) -> None:
        self.tenant, self.asked, self.held, self.cap, self.scope = tenant, asked, held, cap, scope
        if scope == "capacity":  # the numbers are everyone's: the message keeps them
            message = f"KV host tier at capacity: no room for {asked} pages now; try again later"
        else:
            message = f"KV host tier full ({scope}): tenant {tenant!r} asked for {asked} pages, "
            message += f"{held} held of {cap}"
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:  # survives pickling (errors crossing processes)
        return type(self), (self.tenant, self.asked, self.held, self.cap, self.scope)


class HostSlotError(RuntimeError):
    """A slot freed twice, freed or read by an owner that does not hold it, or out of range."""


class RecallHandle:
    """The completion of one recall. `wait()` orders the caller's current stream after the copy."""

    def __init__(self, event: Any | None = None, device: torch.device | None = None) -> None:
        self._event, self._device = event, device

    def wait(self) -> None:
        if self._event is not None:  # GPU-side wait: the host does not block
            torch.cuda.current_stream(self._device).wait_event(self._event)


class HostPageStore:
    """Host slots for KV pages of one `KVLayout`: `capacity_pages` full pages (all layers).

    `staging_pages` (CUDA only, default 64, at most the capacity) sizes the pinned staging area in
    full pages; a recall of `n` pages over `m` layers is asynchronous in one piece while
    `n * m <= staging_pages * num_layers`, else it is split and the host waits between pieces.
    """

    def __init__(
        self,
        layout: KVLayout,
        capacity_pages: int,
        device: torch.device,
        pin_memory: bool | None = None,
        *,
        tenant_caps: Mapping[str, int] | None = None,
        default_tenant_cap: int | None = None,
        staging_pages: int | None = None,
        latency_samples: int = 4096,
    ) -> None:
        if capacity_pages < 1:
            raise ValueError(f"capacity_pages: must be >= 1, got {capacity_pages}")
        caps = dict(tenant_caps or {})
        for name, cap in [*caps.items(), ("default_tenant_cap", default_tenant_cap)]:
            if cap is not None and cap < 0:
                raise ValueError(f"host page cap for {name!r}: must be >= 0, got {cap}")
        if device.type == "cuda" and device.index is None:  # compare like the pool's tensors
            device = torch.device("cuda", torch.cuda.current_device())
        self.layout, self.capacity_pages, self.device = layout, capacity_pages, device
        self.tenant_caps, self.default_tenant_cap = caps, default_tenant_cap
        self._cuda = device.type == "cuda"
        pin = self._cuda if pin_memory is None else pin_memory
        lay = layout
        self._slot_numel = lay.num_kv_heads * lay.page_size * lay.head_dim  # one page, one layer
        # Staging only on CUDA: on CPU copies go straight between arena and pool.
        self.staging_pages = min(capacity_pages, staging_pages or 64) if self._cuda else 0
        arena = 2 * lay.num_layers * capacity_pages * self._slot_numel
        staging = 2 * lay.num_layers * self.staging_pages * self._slot_numel
        # One allocation for arena and staging: pinned once here, never per page.
        self._buffer = torch.empty(arena + staging, dtype=lay.dtype, pin_memory=pin)
        shape = (lay.num_layers, lay.num_kv_heads, capacity_pages * lay.page_size, lay.head_dim)
        self.keys, self.values = self._buffer[:arena].view(2, *shape).unbind(0)
        self._staging = self._buffer[arena:]
        self._staged: Any | None = None  # event of the last copy reading staging (CUDA)
        self._stream: Any | None = torch.cuda.Stream(device=device) if self._cuda else None
        self._free: deque[int] = deque(range(capacity_pages))
        self._holder: list[Owner | None] = [None] * capacity_pages
        self._slots: dict[Owner, set[int]] = {}
        self._reserved: dict[Owner, int] = {}
        self._tenant_pages: Counter[str] = Counter()  # held + reserved, what caps apply to
        self._reserved_total = 0
        # Cumulative counters (telemetry reads these names)
        self.pages_parked = 0
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self.cells_recalled = 0  # one KV head of one layer of one page
        self.hits = 0
        self.misses = 0
        self._latency_ms: deque[float] = deque(maxlen=latency_samples)
        self._timing: deque[tuple[Any, Any]] = deque()  # CUDA (start, end) events not yet read

    # -- accounting -------------------------------------------------------------------------

    @property
    def pages_in_use(self) -> int:
        return self.capacity_pages - len(self._free)

    @property
    def host_bytes_in_use(self) -> int:
        return self.pages_in_use * self.layout.bytes_per_page

    @property
    def pages_recalled(self) -> int:
        """Full-page equivalents recalled (a cell, one layer and KV head of a page, is a part)."""
        return self.cells_recalled // (self.layout.num_layers * self.layout.num_kv_heads)

    def owner_pages(self, owner: Owner) -> int:
        return len(self._slots.get(owner, ()))

    def tenant_pages(self, tenant: str) -> int:
        """Pages a tenant holds plus pages reserved for it: the figure its cap applies to."""
        return self._tenant_pages[tenant]

    def tenant_cap(self, tenant: str) -> int | None:
        return self.tenant_caps.get(tenant, self.default_tenant_cap)

    def can_allocate(self, tenant: str, n: int) -> bool:
        return self._shortfall(tenant, n) is None

    def _shortfall(self, tenant: str, n: int) -> HostTierFull | None:
        held, cap = self._tenant_pages[tenant], self.tenant_cap(tenant)
        if cap is not None and held + n > cap:
            return HostTierFull(tenant, n, held, cap, "tenant cap")
        if n > len(self._free) - self._reserved_total:
            committed = self.pages_in_use + self._reserved_total
            return HostTierFull(tenant, n, committed, self.capacity_pages, "capacity")
        return None

    def reserve(self, owner: Owner, n: int) -> None:
        """Sets `n` pages aside for `owner` (admission), so its later allocations cannot fail."""
        if error := self._shortfall(owner[0], n):
            raise error
        self._reserved[owner] = self._reserved.get(owner, 0) + n
        self._reserved_total += n
        self._tenant_pages[owner[0]] += n

    def allocate(self, owner: Owner, n: int) -> list[int]:
        """`n` slots for `owner`, taken from its reservation first; raises `HostTierFull`."""
        if n < 0:
            raise ValueError(f"n: must be >= 0, got {n}")
        from_reserve = min(n, self._reserved.get(owner, 0))
        if error := self._shortfall(owner[0], n - from_reserve):
            raise error
        self._reserved[owner] = self._reserved.get(owner, 0) - from_reserve
        self._reserved_total -= from_reserve
        self._tenant_pages[owner[0]] += n - from_reserve
        slots = [self._free.popleft() for _ in range(n)]
        for s in slots:
            self._holder[s] = owner
        self._slots.setdefault(owner, set()).update(slots)
        return slots

    def free(self, owner: Owner, slots: Sequence[int]) -> None:
        """Returns slots to the store; all-or-nothing: a bad slot raises before any is freed."""
        self._check_owned(owner, slots)
        held = self._slots[owner] if slots else set()
        for s in slots:
            self._holder[s] = None
            held.discard(s)
        self._free.extend(slots)
        self._tenant_pages[owner[0]] -= len(slots)

    def release(self, owner: Owner) -> int:
        """Frees every slot and reservation of `owner` (finish, cancel); returns slots freed."""
        slots = sorted(self._slots.get(owner, ()))
        self.free(owner, slots)
        self._slots.pop(owner, None)
        reserved = self._reserved.pop(owner, 0)
        self._reserved_total -= reserved
        self._tenant_pages[owner[0]] -= reserved
        if not self._tenant_pages[owner[0]]:
            del self._tenant_pages[owner[0]]
        return len(slots)

    def _check_owned(self, owner: Owner, slots: Sequence[int]) -> None:
        if len(set(slots)) != len(slots):
            raise HostSlotError(f"host slots repeated in one call: {sorted(slots)}")
        for s in slots:
            if not 0 <= s < self.capacity_pages:
                raise HostSlotError(f"host slot {s} out of range [0, {self.capacity_pages})")
            if self._holder[s] != owner:
                # Never name the real holder: it may be another tenant's request.
                state = "free" if self._holder[s] is None else "held by another owner"
                raise HostSlotError(f"host slot {s} is not held by {owner!r} ({state})")

    # -- copies -----------------------------------------------------------------------------

    def park(self, kv: PagedKVCache, device_pages: Sequence[int], owner: Owner) -> list[int]:
        """Copies `device_pages` (every layer) into new host slots of `owner` and returns them.

        Synchronous: the host copy is complete on return, so the caller may free the pages."""
        self._check_pool(kv, device_pages)
        slots = self.allocate(owner, len(device_pages))
        try:
            chunk = self.staging_pages or len(slots)
            for i in range(0, len(slots), chunk):
                self._park_chunk(kv, device_pages[i : i + chunk], slots[i : i + chunk])
        except BaseException:
            self.free(owner, slots)
            raise
        self.pages_parked += len(slots)
        self.bytes_to_host += len(slots) * self.layout.bytes_per_page
        return slots

    def _park_chunk(self, kv: PagedKVCache, pages: Sequence[int], slots: list[int]) -> None:
        lay, n = self.layout, len(slots)
        src_idx = torch.tensor(pages, dtype=torch.long, device=kv.device)
        dst_idx = torch.tensor(slots, dtype=torch.long)
        for i, (src, dst) in enumerate(((kv.keys, self.keys), (kv.values, self.values))):
            # [L, KVH, n, ps, D] on the device; the pool is [L, KVH, NP * ps, D]
            block = src.unflatten(2, (kv.num_pages, lay.page_size)).index_select(2, src_idx)
            if self._cuda:  # through pinned staging: a DMA copy, blocking (ordered after compute)
                block = self._stage(i, lay.num_layers, n).copy_(block)
            dst.unflatten(2, (self.capacity_pages, lay.page_size)).index_copy_(2, dst_idx, block)

    def recall(
        self,
        kv: PagedKVCache,
        host_slots: Sequence[int],
        device_pages: Sequence[int],
        owner: Owner,
        layers: range | None = None,
    ) -> RecallHandle:
        """Copies `owner`'s `host_slots` into `device_pages` for `layers` (default all).

        On CUDA the copy is asynchronous: call `wait()` on the handle before reading the pages."""
        lay = self.layout
        layers = range(lay.num_layers) if layers is None else layers
        if len(host_slots) != len(device_pages):
            raise ValueError(f"{len(host_slots)} host slots for {len(device_pages)} device pages")
        if len(set(device_pages)) != len(device_pages):
            raise ValueError(f"device pages repeated in one recall: {list(device_pages)}")
        if not layers or layers.step < 1 or not 0 <= layers[0] <= layers[-1] < lay.num_layers:
            raise ValueError(f"layers: a non-empty increasing range of layers, got {layers}")
        self._check_pool(kv, device_pages)
        self._check_owned(owner, host_slots)
        sel, n, m = slice(layers.start, layers.stop, layers.step), len(host_slots), len(layers)
        handle = RecallHandle()
        if not n:
            return handle
        self._read_timing()
        # On CUDA a chunk fills staging (`staging_pages` full pages = that many times L layer-pages)
        chunk = self.staging_pages * lay.num_layers // m if self._cuda else n
        start = time.perf_counter()
        for i in range(0, n, chunk):
            handle = self._recall_chunk(
                kv, host_slots[i : i + chunk], device_pages[i : i + chunk], sel, m
            )
        if not self._cuda:
            self._latency_ms.append((time.perf_counter() - start) * 1e3)
        self.cells_recalled += n * m * lay.num_kv_heads
        self.bytes_to_device += n * m * lay.bytes_per_page // lay.num_layers
        return handle

    def _recall_chunk(
        self, kv: PagedKVCache, slots: Sequence[int], pages: Sequence[int], sel: slice, m: int
    ) -> RecallHandle:
        lay, n = self.layout, len(slots)
        src_idx = torch.tensor(slots, dtype=torch.long)
        blocks = []
        for i, src in enumerate((self.keys, self.values)):
            # [m, KVH, n, ps, D]: a CPU gather, into pinned staging on CUDA
            out = self._stage(i, m, n) if self._cuda else None
            paged = src[sel].unflatten(2, (self.capacity_pages, lay.page_size))
            blocks.append(torch.index_select(paged, 2, src_idx, out=out))
        if not self._cuda:
            dst_idx = torch.tensor(pages, dtype=torch.long, device=kv.device)
            self._scatter(kv, sel, dst_idx, blocks)
            return RecallHandle()
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # pages may be in use
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            start.record()
            dst_idx = torch.tensor(pages, dtype=torch.long, device=kv.device)
            on_device = [b.to(kv.device, non_blocking=True) for b in blocks]
            self._scatter(kv, sel, dst_idx, on_device)
            end.record()
        self._staged = end  # staging is read until `end`: the next fill waits for it
        self._timing.append((start, end))
        return RecallHandle(end, self.device)

    def read_cells(self, layer: int, cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of host `cells` of one layer, on the device, `[n, ps, D]` each.

        A cell is one KV head of one parked page, `head * capacity_pages + slot` (a CPU index):
        what attention reads for the pages a layer selected that are not on the device, in one
        batched copy per layer. On CUDA the cells are gathered into pinned staging, copied on the
        side stream while the compute stream gathers the resident pages, and the compute stream
        waits for the copy's event before anything reads the result. Ownership was checked when
        the engine put these slots in the request's page table; this is the hot path."""
        lay, n = self.layout, int(cells.numel())
        start = time.perf_counter()
        # [KVH * capacity, ps, D] per K/V: cell c of this layer is row c
        flats = [
            src[layer].view(-1, lay.page_size, lay.head_dim) for src in (self.keys, self.values)
        ]
        if self._cuda:
            out = self._read_cells_cuda(flats, cells)
        else:
            out = [flat.index_select(0, cells) for flat in flats]
        self._latency_ms.append((time.perf_counter() - start) * 1e3)
        self.cells_recalled += n
        self.bytes_to_device += n * lay.bytes_per_page // (lay.num_layers * lay.num_kv_heads)
        return out[0], out[1]

    def _read_cells_cuda(
        self, flats: list[torch.Tensor], cells: torch.Tensor
    ) -> list[torch.Tensor]:
        """Host gather into pinned staging, then host-to-device on the side stream. The results
        are allocated on the side stream (so the copy need not wait for queued compute: it
        overlaps the resident-page gather) and recorded on the compute stream that reads them."""
        lay, compute, side = self.layout, torch.cuda.current_stream(self.device), self._stream
        assert side is not None
        cell_numel = lay.page_size * lay.head_dim
        per_chunk = self._staging.numel() // 2 // cell_numel  # cells that fit half the staging
        shape = (len(cells), lay.page_size, lay.head_dim)
        with torch.cuda.stream(side):
            out = [torch.empty(shape, dtype=lay.dtype, device=self.device) for _ in flats]
        for lo in range(0, len(cells), per_chunk):
            part = cells[lo : lo + per_chunk]
            for i, (flat, dst) in enumerate(zip(flats, out, strict=True)):
                staged = self._stage_numel(i, len(part) * cell_numel).view(-1, *flat.shape[1:])
                torch.index_select(flat, 0, part, out=staged)  # CPU gather into pinned memory
                with torch.cuda.stream(side):
                    dst[lo : lo + len(part)].copy_(staged, non_blocking=True)
            self._landed()
        for t in out:  # freed later on the compute stream: not reused before it is done
            t.record_stream(compute)
        return out

    def _landed(self) -> None:
        """The compute stream waits for the side stream's copies; staging is busy until then."""
        assert self._stream is not None
        event = torch.cuda.Event()
        event.record(self._stream)
        torch.cuda.current_stream(self.device).wait_event(event)
        self._staged = event

    def _scatter(
        self, kv: PagedKVCache, sel: slice, idx: torch.Tensor, blocks: list[torch.Tensor]
    ) -> None:
        for dst, block in zip((kv.keys, kv.values), blocks, strict=True):
            dst[sel].unflatten(2, (kv.num_pages, self.layout.page_size)).index_copy_(2, idx, block)

    def _stage(self, which: int, m: int, n: int) -> torch.Tensor:
        """Staging for keys (0) or values (1) of `n` pages over `m` layers, `[m, KVH, n, ps, D]`.

        Hazard: the last recall's asynchronous copy may still read staging; wait for it first."""
        lay = self.layout
        flat = self._stage_numel(which, m * n * self._slot_numel)
        return flat.view(m, lay.num_kv_heads, n, lay.page_size, lay.head_dim)

    def _stage_numel(self, which: int, numel: int) -> torch.Tensor:
        if self._staged is not None:
            self._staged.synchronize()
            self._staged = None
        assert numel <= self._staging.numel() // 2, "chunking keeps a copy within staging"
        return self._staging[which * numel : (which + 1) * numel]

    def _check_pool(self, kv: PagedKVCache, device_pages: Sequence[int]) -> None:
        if kv.layout != self.layout or kv.keys.device != self.device:
            raise ValueError(f"pool {kv.layout} on {kv.keys.device} does not match the host store")
        bad = [p for p in device_pages if not 0 <= p < kv.num_pages]
        if bad:  # checked here: an out-of-range index is a device-side assert on CUDA
            raise ValueError(f"device pages out of range [0, {kv.num_pages}): {bad}")

    def fence(self) -> None:
        """Orders the current stream after every recall issued so far (before freeing pages)."""
        if self._cuda and self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    # -- metrics ----------------------------------------------------------------------------

    def record_hits(self, hits: int, misses: int) -> None:
        """The engine's selection outcome: selected pages already resident vs recalled."""
        self.hits += hits
        self.misses += misses

    @property
    def hit_rate(self) -> float | None:
        total = self.hits + self.misses
        return self.hits / total if total else None

    def recall_latency_ms(self, p: float) -> float | None:
        """Percentile `p` (0-100, nearest rank) of recent recall latencies; None before any.

        CPU: wall time of the whole (synchronous) recall. CUDA: side-stream time of the H2D copy
        and scatter, read from events once they have completed (lags a few recalls)."""
        self._read_timing()
        samples = sorted(self._latency_ms)
        if not samples:
            return None
        return samples[max(0, math.ceil(p / 100 * len(samples)) - 1)]

    def _read_timing(self) -> None:
        while self._timing and self._timing[0][1].query():
            start, end = self._timing.popleft()
            self._latency_ms.append(start.elapsed_time(end))
