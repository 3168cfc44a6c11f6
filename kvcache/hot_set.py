"""The hot set of an offloaded Quest request: per layer and KV head, the parked pages it selected
most recently, kept on the device (an LRU per layer and head).

Why per layer and head. Quest picks pages per layer and per KV head. Over 30 layers x 3 heads
nearly every page of a context is somebody's pick each step, so a hot set of whole pages (every
layer of a page) mostly holds layers that do not read them: only a small share of the pages read
would be on the device. So the hot set is made of cells: the request owns `H` pool pages, and
cell `(layer, head, way j)` is that layer and head of pool page `pages[j]`. Each layer and KV head
keeps in its `H` ways the parked pages it selected most recently. Device memory is `H` pages, as a
hot set of `H` whole pages would take, and every layer and head has `H` ways of its own.

Bookkeeping lives on the host: a layer's selection comes to the host anyway (the host issues the
read of the misses). `route_into` turns one layer's selection into where each chosen page is read
from (a pool cell for resident pages, hits and the misses it keeps; the host tier for misses) and
which ways the misses fill, as index rows of a `LayerRoute`; the attention function does the
copies (`kvcache.tier_read.read_tiered`). Two implementations of one LRU: `NativeHotSet`
(arrays, routed by `hot_set.c`) and its plain twin `DictHotSet` (dicts, in Python: far slower
per layer at long contexts), which also serves where no C compiler is found.

A parked page never changes (it is full), so a cell stays valid until its way is reused; nothing
is written back on eviction. Not thread-safe: only the engine thread touches it.
"""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from collections import OrderedDict
from pathlib import Path

import torch

from kvcache import native

SOURCE = Path(__file__).with_name("hot_set.c")
# The rows of a LayerRoute (the C file's enum, same order)
CELLS, MISS_POS, HOST_CELLS, FILL_FROM, FILL_INTO, LATE = range(6)


class LayerRoute:
    """Every offloaded row's route for one layer, as index rows over the `n` choices
    (`[R, KVH, k]` flattened): `cells`, the pool cell each choice is read from (a kept miss: the
    cell it fills); then by miss: its position and host cell (head * capacity + slot); the
    fills (the miss a way keeps, the pool cell); the late misses (read, not kept: their
    numbers, read into place after the gather). `counts`: misses, fills, late."""

    def __init__(self, n: int) -> None:
        self.rows = torch.empty((6, n), dtype=torch.long)
        self.counts = torch.zeros(3, dtype=torch.long)


class HotSet(ABC):
    def __init__(self, num_layers: int, num_kv_heads: int) -> None:
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.pages: list[int] = []  # way j lives in pool page pages[j]
        self.router: Router | None = None  # routes (and on CPU copies) in C; None: in Python

    @property
    def ways(self) -> int:
        return len(self.pages)

    @abstractmethod
    def cached(self, layer: int, head: int) -> list[int]:
        """Host slots the layer and head keep on the device, least recently used first."""

    @abstractmethod
    def grow(self, pages: list[int]) -> None:
        """More pool pages for the hot set: empty ways in every layer and head."""

    @abstractmethod
    def shrink(self, n: int) -> list[int]:
        """Gives back the last `n` ways' pool pages (what their cells held is forgotten)."""

    @abstractmethod
    def take_counts(self) -> tuple[int, int, int]:
        """Selections (one chosen page of one layer and KV head) resident, hit and missed since
        the last call."""

    @abstractmethod
    def route_into(
        self, layer: int, ids: torch.Tensor, num_pages: int, capacity: int, out: LayerRoute, at: int
    ) -> None:
        """Routes one layer's chosen pages `ids` `[KVH, k]` (CPU int64) into `out`, its cells
        from position `at`; updates the layer's LRU. Ids below `num_pages` are resident pages;
        the others name host slot `id - num_pages`. Hits are refreshed; misses take empty ways
        (highest first), then the least recently used ones, never a way used this step; misses
        beyond that are read but not kept."""


def route_rows(
    hot: list[HotSet], layer: int, ids: torch.Tensor, num_pages: int, capacity: int
) -> LayerRoute:
    """Each row's route of one layer: `ids` `[R, KVH, k]` on the host, `hot[r]` row r's set."""
    out = LayerRoute(ids.numel())
    per_row = ids[0].numel() if len(hot) else 0
    for r, hot_set in enumerate(hot):
        hot_set.route_into(layer, ids[r], num_pages, capacity, out, r * per_row)
    return out


class DictHotSet(HotSet):
    """The plain twin: per layer and head an OrderedDict host slot -> way, in Python."""

    def __init__(self, num_layers: int, num_kv_heads: int) -> None:
        super().__init__(num_layers, num_kv_heads)
        heads = range(num_kv_heads)
        self._lru = [[OrderedDict[int, int]() for _ in heads] for _ in range(num_layers)]
        self._empty: list[list[list[int]]] = [[[] for _ in heads] for _ in range(num_layers)]
        self._counts = [0, 0, 0]

    def cached(self, layer: int, head: int) -> list[int]:
        return list(self._lru[layer][head])

    def grow(self, pages: list[int]) -> None:
        new = range(self.ways, self.ways + len(pages))
        for per_layer in self._empty:
            for empty in per_layer:
                empty.extend(new)  # ascending: pop() takes the highest empty way
        self.pages.extend(pages)

    def shrink(self, n: int) -> list[int]:
        keep = self.ways - min(n, self.ways)
        gone = self.pages[keep:]
        if gone:
            del self.pages[keep:]
            for lru_layer, empty_layer in zip(self._lru, self._empty, strict=True):
                for lru, empty in zip(lru_layer, empty_layer, strict=True):
                    for slot in [s for s, way in lru.items() if way >= keep]:
                        del lru[slot]
                    empty[:] = [way for way in empty if way < keep]
        return gone

    def take_counts(self) -> tuple[int, int, int]:
        counts, self._counts = self._counts, [0, 0, 0]
        return counts[0], counts[1], counts[2]

    def route_into(
        self, layer: int, ids: torch.Tensor, num_pages: int, capacity: int, out: LayerRoute, at: int
    ) -> None:
        cells: list[int] = []
        misses: list[tuple[int, int]] = []  # (position, host cell) in order
        fills: list[tuple[int, int]] = []  # (miss, pool cell)
        late: list[int] = []
        for head, chosen in enumerate(ids.tolist()):
            lru, empty = self._lru[layer][head], self._empty[layer][head]
            base = head * num_pages
            missed: list[tuple[int, int]] = []  # (position, host slot)
            hits = 0
            for page in chosen:
                if page < num_pages:
                    cells.append(base + page)
                    continue
                slot = page - num_pages
                way = lru.get(slot)
                if way is None:
                    missed.append((len(cells), slot))
                    cells.append(base)  # overwritten: a filled way's cell, or the late copy
                else:
                    lru.move_to_end(slot)
                    cells.append(base + self.pages[way])
                    hits += 1
            self._counts[0] += len(chosen) - hits - len(missed)
            self._counts[1] += hits
            self._counts[2] += len(missed)
            evictable = len(lru) - hits  # the ways at the front, not used this step
            for pos, slot in missed:
                misses.append((at + pos, head * capacity + slot))
                if empty:
                    way = empty.pop()
                elif evictable > 0:
                    way = lru.popitem(last=False)[1]
                    evictable -= 1
                else:
                    late.append(len(misses) - 1)
                    continue
                lru[slot] = way
                cells[pos] = base + self.pages[way]
                fills.append((len(misses) - 1, cells[pos]))
        m0, f0, l0 = out.counts.tolist()
        _put(out, CELLS, at, cells)
        _put(out, MISS_POS, m0, [pos for pos, _ in misses])
        _put(out, HOST_CELLS, m0, [cell for _, cell in misses])
        _put(out, FILL_FROM, f0, [m0 + m for m, _ in fills])
        _put(out, FILL_INTO, f0, [cell for _, cell in fills])
        _put(out, LATE, l0, [m0 + m for m in late])
        out.counts += torch.tensor([len(misses), len(fills), len(late)])


def _put(out: LayerRoute, row: int, at: int, values: list[int]) -> None:
    out.rows[row, at : at + len(values)] = torch.tensor(values, dtype=torch.long)


class Router:
    """`hot_set_route` of the C file (argument order and meaning documented there)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn = lib.hot_set_route
        fn.restype = None
        fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, ptr, i64, i64]
        fn.argtypes += [ptr, ptr]
        self.route = fn
        copy = lib.hot_set_copy
        copy.restype = ctypes.c_int
        copy.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, ptr, ctypes.c_int]
        self._copy = copy

    def copy(
        self,
        route: LayerRoute,
        out: tuple[torch.Tensor, torch.Tensor],
        pool: tuple[torch.Tensor, torch.Tensor],
        host: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """CPU only: `route`'s copies in one pass. `out` `[n, ps, D]` receives every choice;
        `pool` and `host` are one layer's keys and values (`[KVH * pages, ps, D]` cells,
        contiguous, one dtype); the kept misses are written into their pool cells."""
        tensors = (*out, *pool, *host)
        assert all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
        assert len({t.dtype for t in tensors}) == 1
        cell_bytes = out[0][0].numel() * out[0].element_size() if len(out[0]) else 0
        status = self._copy(
            *(t.data_ptr() for t in tensors),
            cell_bytes,
            route.rows.data_ptr(),
            route.rows.shape[1],
            len(out[0]),
            route.counts.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("hot set copy: no memory for the miss mask")


def router(build_dir: Path) -> Router | None:
    """The C routing, built into `build_dir` on first use; None without a C compiler (the
    plain twin then routes)."""
    lib = native.library(SOURCE, build_dir)
    return Router(lib) if lib is not None else None


class NativeHotSet(HotSet):
    """The LRU as arrays routed in C: per layer and head, each way's host slot (-1: empty) and
    the step counter's value when it was last used; `cached` sorts the ways by it."""

    def __init__(self, num_layers: int, num_kv_heads: int, router: Router) -> None:
        super().__init__(num_layers, num_kv_heads)
        self.router: Router = router
        self._clock = torch.zeros(1, dtype=torch.long)
        self._tally = torch.zeros(3, dtype=torch.long)  # resident, hits, misses
        self._scratch = torch.empty(0, dtype=torch.long)
        self._slots = torch.empty((num_layers, num_kv_heads, 0), dtype=torch.long)
        self._stamps = torch.empty_like(self._slots)
        self._pool_pages = torch.empty(0, dtype=torch.long)

    def _resize(self, ways: int) -> None:
        """Keeps the first `ways` ways of every layer and head (new ones empty)."""
        shape = (self.num_layers, self.num_kv_heads, ways)
        keep = min(ways, self._slots.shape[2])
        slots = torch.full(shape, -1, dtype=torch.long)
        stamps = torch.zeros(shape, dtype=torch.long)
        if keep:
            slots[..., :keep] = self._slots[..., :keep]
            stamps[..., :keep] = self._stamps[..., :keep]
        self._slots, self._stamps = slots, stamps
        self._pool_pages = torch.tensor(self.pages[:ways], dtype=torch.long)

    def cached(self, layer: int, head: int) -> list[int]:
        slots, stamps = self._slots[layer, head], self._stamps[layer, head]
        held = (slots >= 0).nonzero().flatten()
        order = stamps[held].argsort()
        return slots[held[order]].tolist()

    def grow(self, pages: list[int]) -> None:
        ways = self.ways + len(pages)
        self.pages.extend(pages)
        self._resize(ways)

    def shrink(self, n: int) -> list[int]:
        keep = self.ways - min(n, self.ways)
        gone = self.pages[keep:]
        if gone:
            self._resize(keep)
            del self.pages[keep:]
        return gone

    def take_counts(self) -> tuple[int, int, int]:
        resident, hits, misses = self._tally.tolist()
        self._tally.zero_()
        return resident, hits, misses

    def route_into(
        self, layer: int, ids: torch.Tensor, num_pages: int, capacity: int, out: LayerRoute, at: int
    ) -> None:
        kv_heads, k = ids.shape
        assert ids.dtype == torch.long and ids.is_contiguous() and ids.device.type == "cpu"
        if self._scratch.numel() < k:
            self._scratch = torch.empty(k, dtype=torch.long)
        layer_bytes = kv_heads * self.ways * 8  # int64 [KVH, ways] per layer
        self.router.route(
            ids.data_ptr(),
            kv_heads,
            k,
            self._slots.data_ptr() + layer * layer_bytes,
            self._stamps.data_ptr() + layer * layer_bytes,
            self.ways,
            self._pool_pages.data_ptr(),
            self._clock.data_ptr(),
            self._tally.data_ptr(),
            num_pages,
            capacity,
            out.rows.data_ptr(),
            out.rows.shape[1],
            at,
            out.counts.data_ptr(),
            self._scratch.data_ptr(),
        )
