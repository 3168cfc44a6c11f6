"""The hot set of an offloaded Quest request: per layer and KV head, the parked pages it selected
most recently, kept on the device (an LRU per layer and head).

Why per layer and head. Quest picks pages per layer and per KV head. Over 30 layers x 3 heads
nearly every page of a context is somebody's pick each step, so a hot set of whole pages (every
layer of a page) mostly holds layers that do not read them: measured, only 17-34 % of the pages
read were on the device. So the hot set is made of cells: the request owns `H` pool pages, and
cell `(layer, head, way j)` is that layer and head of pool page `pages[j]`. Each layer and KV head
keeps in its `H` ways the parked pages it selected most recently. Device memory is `H` pages, as a
hot set of `H` whole pages would take, and every layer and head has `H` ways of its own.

Bookkeeping lives on the host, in plain dicts: a layer's selection comes to the host anyway (the
host issues the read of the misses), and a few hundred dict operations per layer cost less than
the dozen small tensor ops they replace. `route` turns one layer's selection into where each
chosen page is read from (a pool cell for resident pages and hits, the host tier for misses) and
which ways the misses fill; the attention function does the copies
(`kvcache.attention._quest_read_tiered`).

A parked page never changes (it is full), so a cell stays valid until its way is reused; nothing
is written back on eviction. Not thread-safe: only the engine thread touches it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Route:
    """One layer's selection of one request, flattened over `[KVH, k]`."""

    cells: list[int]  # pool cell each choice is read from: head * num_pages + page (misses: 0)
    misses: list[int] = field(default_factory=list)  # positions read from the host tier
    host_cells: list[int] = field(default_factory=list)  # their host cells: head * cap + slot
    fills: list[tuple[int, int]] = field(default_factory=list)  # (index into misses, pool cell)


class HotSet:
    def __init__(self, num_layers: int, num_kv_heads: int) -> None:
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.pages: list[int] = []  # way j lives in pool page pages[j]
        # per layer and head: host slot -> way, least recently used first; and the empty ways
        heads = range(num_kv_heads)
        self._lru = [[OrderedDict[int, int]() for _ in heads] for _ in range(num_layers)]
        self._empty: list[list[list[int]]] = [[[] for _ in heads] for _ in range(num_layers)]
        # Selections (one chosen page of one layer and KV head) since the counts were last taken
        self.resident = self.hits = self.misses = 0

    @property
    def ways(self) -> int:
        return len(self.pages)

    def cached(self, layer: int, head: int) -> list[int]:
        """Host slots the layer and head keep on the device, least recently used first."""
        return list(self._lru[layer][head])

    def grow(self, pages: list[int]) -> None:
        """More pool pages for the hot set: empty ways in every layer and head."""
        new = range(self.ways, self.ways + len(pages))
        for per_layer in self._empty:
            for empty in per_layer:
                empty.extend(new)
        self.pages.extend(pages)

    def shrink(self, n: int) -> list[int]:
        """Gives back the last `n` ways' pool pages (what their cells held is forgotten)."""
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

    def route(self, layer: int, ids: list[list[int]], num_pages: int, host_capacity: int) -> Route:
        """Where one layer's chosen pages `ids` `[KVH][k]` are read from; updates the layer's LRU.

        Ids below `num_pages` are resident pages; the others name host slot `id - num_pages`.
        Hits are refreshed; misses take empty ways, then the least recently used ones, never a
        way hit this step; misses beyond that are read but not kept."""
        route = Route([])
        cells = route.cells
        for head, chosen in enumerate(ids):
            lru, empty = self._lru[layer][head], self._empty[layer][head]
            get, refresh = lru.get, lru.move_to_end  # the hot loop: ~100 choices per layer
            base = head * num_pages
            missed: list[tuple[int, int]] = []  # (position, host slot)
            hits = 0
            for page in chosen:
                if page < num_pages:
                    cells.append(base + page)
                    continue
                slot = page - num_pages
                way = get(slot)
                if way is None:
                    missed.append((len(cells), slot))
                    cells.append(base)  # overwritten by the host read
                else:
                    refresh(slot)
                    cells.append(base + self.pages[way])
                    hits += 1
            self.resident += len(chosen) - hits - len(missed)
            self.hits += hits
            self.misses += len(missed)
            evictable = len(lru) - hits  # the ways at the front, not hit this step
            for pos, slot in missed:
                route.misses.append(pos)
                route.host_cells.append(head * host_capacity + slot)
                if empty:
                    way = empty.pop()
                elif evictable > 0:
                    way = lru.popitem(last=False)[1]
                    evictable -= 1
                else:
                    continue
                lru[slot] = way
                route.fills.append((len(route.misses) - 1, base + self.pages[way]))
        return route
