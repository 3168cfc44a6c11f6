"""The KV host tier's copy arena: device KV pages parked in host memory, read back per layer.

For a Quest request with offload on, the device keeps the sink, recent and hot pages; the rest is
parked here and the cells a step selects are read back. This module holds the bytes and
the copies; who holds which slot is `kvcache.host_slots` (this store is one), and the engine
decides what to park and owns the device pages (`services/engine/kv_offload.py`).

Arena. One allocation made at start-up, never grown: `[2, num_layers, kv_heads, capacity *
page_size, head_dim]` (keys then values), head-major per layer exactly like `PagedKVCache`, so host
slot `s` of layer `l` is `keys[l, :, s*ps:(s+1)*ps]` and a page moves as one slice per head. On CUDA
it is pinned (page-locked) so copies are DMA and can be asynchronous; pinning once avoids the
per-object pin/unpin leaks and allocation failures seen in LMCache (where pinning is refused, it
is pageable memory, logged, and `pinned` says so). On CUDA the same allocation carries a staging
area (`staging_pages` full pages) that batched copies pass through. The staging logic is the
same on every device: only the side stream and its events are CUDA's (`_Streams`), so a CPU
store given `staging_pages` runs it, synchronously, for the tests.

Park. `park` gathers the pages of every layer on the device in one `index_select` per K/V and
scatters them into the arena with one `index_copy_`; it returns when the host copy is complete, so
the caller may free or reuse the device pages at once. A copy larger than staging is split.

Read. `read_cells` is what attention uses (`kvcache.pages.HostPages`): the cells one layer needs (a
cell is one KV head of one layer of a parked page), gathered into one batch and copied in one piece
(on CUDA through staging, on a side stream, the compute stream waiting on its event). The copies
land in fresh tensors, never in pool pages, and the compute stream waits for them before anything
reads them: nothing is left in flight that freeing pages would have to wait for.

What the engine must know. The host copy stays in place: a full page is immutable, so dropping a
device copy of a parked page needs no write-back. Counters are cumulative (take differences per
step); `pages_recalled` counts full-page equivalents (`cells_recalled`: one KV head of one layer of
a page). Not thread-safe: the engine thread calls it, telemetry only reads counters.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kvcache.host_slots import HostSlots, Owner
from kvcache.pages import KVLayout, PagedKVCache

log = logging.getLogger(__name__)


class _Streams:
    """What copies through staging need from the device: on CUDA a side stream that the copies
    to the device run on and an event the compute stream waits for; on a CPU copies are
    synchronous, and each of these is nothing."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side: Any | None = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def on_side(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()

    def landed(self) -> Any | None:
        """The compute stream waits for the side stream's copies; returns their event."""
        if self.side is None:
            return None
        event = torch.cuda.Event()
        event.record(self.side)
        torch.cuda.current_stream(self.device).wait_event(event)
        return event

    def read_on_compute(self, tensors: Sequence[torch.Tensor]) -> None:
        """Tensors allocated on the side stream, freed later on the compute stream that reads
        them: not reused before it is done."""
        if self.side is not None:
            for t in tensors:
                t.record_stream(torch.cuda.current_stream(self.device))


def _host_buffer(numel: int, dtype: torch.dtype, pin: bool) -> tuple[torch.Tensor, bool]:
    """One host allocation, pinned when asked and the system allows it; (buffer, pinned)."""
    if pin:
        try:
            return torch.empty(numel, dtype=dtype, pin_memory=True), True
        except RuntimeError as exc:  # no accelerator, or the lock limit: pageable memory
            log.warning("KV host tier: pinned memory refused (%s); using pageable memory", exc)
    return torch.empty(numel, dtype=dtype), False


class HostPageStore(HostSlots):
    """Host slots for KV pages of one `KVLayout`: `capacity_pages` full pages (all layers).

    `staging_pages` (default 64 on CUDA, none on a CPU; at most the capacity) sizes the pinned
    staging area in full pages, for keys and for values; a park or read that does not fit goes in
    pieces, the host waiting for each piece's copy before it refills staging.
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
        super().__init__(
            capacity_pages, tenant_caps=tenant_caps, default_tenant_cap=default_tenant_cap
        )
        if device.type == "cuda" and device.index is None:  # compare like the pool's tensors
            device = torch.device("cuda", torch.cuda.current_device())
        self.layout, self.device = layout, device
        cuda = device.type == "cuda"
        lay = layout
        self._slot_numel = lay.num_kv_heads * lay.page_size * lay.head_dim  # one page, one layer
        # Copies to a GPU always pass through staging; on a CPU they go straight between arena
        # and pool unless `staging_pages` asks for it (the tests of the staged path)
        self.staging_pages = min(capacity_pages, staging_pages or (64 if cuda else 0))
        arena = 2 * lay.num_layers * capacity_pages * self._slot_numel
        staging = 2 * lay.num_layers * self.staging_pages * self._slot_numel
        # One allocation for arena and staging: pinned once here, never per page.
        pin = cuda if pin_memory is None else pin_memory
        self._buffer, self.pinned = _host_buffer(arena + staging, lay.dtype, pin)
        shape = (lay.num_layers, lay.num_kv_heads, capacity_pages * lay.page_size, lay.head_dim)
        self.keys, self.values = self._buffer[:arena].view(2, *shape).unbind(0)
        self._staging = self._buffer[arena:]
        self._staged: Any | None = None  # event of the last copy reading staging (CUDA)
        self._streams = _Streams(device)
        # Cumulative counters (telemetry reads these names)
        self.pages_parked = 0
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self.cells_recalled = 0  # one KV head of one layer of one page
        self.hits = 0
        self.misses = 0
        self._read_ms: deque[float] = deque(maxlen=latency_samples)
        # Called with each read's seconds as it happens (telemetry's histogram; None: nobody)
        self.on_read: Callable[[float], None] | None = None

    @property
    def host_bytes_in_use(self) -> int:
        return self.pages_in_use * self.layout.bytes_per_page

    @property
    def pages_recalled(self) -> int:
        """Full-page equivalents read back (a cell, one layer and KV head of a page, is a part)."""
        return self.cells_recalled // (self.layout.num_layers * self.layout.num_kv_heads)

    # -- park -------------------------------------------------------------------------------

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
            if self.staging_pages:  # through pinned staging: a DMA copy, blocking (ordered
                block = self._stage(i, lay.num_layers, n).copy_(block)  # after compute)
            dst.unflatten(2, (self.capacity_pages, lay.page_size)).index_copy_(2, dst_idx, block)

    def _check_pool(self, kv: PagedKVCache, device_pages: Sequence[int]) -> None:
        if kv.layout != self.layout or kv.keys.device != self.device:
            raise ValueError(f"pool {kv.layout} on {kv.keys.device} does not match the host store")
        bad = [p for p in device_pages if not 0 <= p < kv.num_pages]
        if bad:  # checked here: an out-of-range index is a device-side assert on CUDA
            raise ValueError(f"device pages out of range [0, {kv.num_pages}): {bad}")

    # -- read -------------------------------------------------------------------------------

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
        if self.staging_pages:
            out = self._read_cells_staged(flats, cells)
        else:
            out = [flat.index_select(0, cells) for flat in flats]
        self.record_read(n, time.perf_counter() - start)
        return out[0], out[1]

    def record_read(self, cells: int, seconds: float) -> None:
        """A read of `cells` that took `seconds` (here, or a CPU copy reading the arena)."""
        self._read_ms.append(seconds * 1e3)
        if self.on_read is not None:
            self.on_read(seconds)
        self.count_read(cells)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer of the arena, `[KVH, capacity * ps, D]`: what a CPU
        kernel reads parked pages from in place (`kvcache.native`)."""
        return self.keys[layer], self.values[layer]

    def count_read(self, cells: int) -> None:
        """`cells` read from the tier (copied, or read in place by a kernel)."""
        lay = self.layout
        self.cells_recalled += cells
        self.bytes_to_device += cells * lay.bytes_per_page // (lay.num_layers * lay.num_kv_heads)

    def _read_cells_staged(
        self, flats: list[torch.Tensor], cells: torch.Tensor
    ) -> list[torch.Tensor]:
        """Host gather into pinned staging, then host-to-device on the side stream. The results
        are allocated on the side stream (so the copy need not wait for queued compute: it
        overlaps the resident-page gather) and recorded on the compute stream that reads them;
        staging is busy until the compute stream has the copy's event."""
        lay, streams = self.layout, self._streams
        cell_numel = lay.page_size * lay.head_dim
        per_chunk = self._staging.numel() // 2 // cell_numel  # cells that fit half the staging
        shape = (len(cells), lay.page_size, lay.head_dim)
        with streams.on_side():
            out = [torch.empty(shape, dtype=lay.dtype, device=self.device) for _ in flats]
        for lo in range(0, len(cells), per_chunk):
            part = cells[lo : lo + per_chunk]
            for i, (flat, dst) in enumerate(zip(flats, out, strict=True)):
                staged = self._stage_numel(i, len(part) * cell_numel).view(-1, *flat.shape[1:])
                torch.index_select(flat, 0, part, out=staged)  # CPU gather into pinned memory
                with streams.on_side():
                    dst[lo : lo + len(part)].copy_(staged, non_blocking=True)
            self._staged = streams.landed()
        streams.read_on_compute(out)
        return out

    # -- staging ----------------------------------------------------------------------------

    def _stage(self, which: int, m: int, n: int) -> torch.Tensor:
        """Staging for keys (0) or values (1) of `n` pages over `m` layers, `[m, KVH, n, ps, D]`."""
        lay = self.layout
        flat = self._stage_numel(which, m * n * self._slot_numel)
        return flat.view(m, lay.num_kv_heads, n, lay.page_size, lay.head_dim)

    def _stage_numel(self, which: int, numel: int) -> torch.Tensor:
        # Hazard: the last read's asynchronous copy may still read staging; wait for it first.
        if self._staged is not None:
            self._staged.synchronize()
            self._staged = None
        assert numel <= self._staging.numel() // 2, "chunking keeps a copy within staging"
        return self._staging[which * numel : (which + 1) * numel]

    # -- metrics ----------------------------------------------------------------------------

    def record_hits(self, hits: int, misses: int) -> None:
        """The engine's selection outcome: selected pages already on the device vs read here."""
        self.hits += hits
        self.misses += misses

    @property
    def hit_rate(self) -> float | None:
        total = self.hits + self.misses
        return self.hits / total if total else None

    def read_latency_ms(self, p: float) -> float | None:
        """Percentile `p` (0-100, nearest rank) of recent `read_cells` latencies; None before any.

        Host wall time of the call: the gather and, on CUDA, issuing the copy (and waiting for
        staging a previous copy still reads); the device copy itself overlaps compute."""
        samples = sorted(self._read_ms)
        if not samples:
            return None
        return samples[max(0, math.ceil(p / 100 * len(samples)) - 1)]
