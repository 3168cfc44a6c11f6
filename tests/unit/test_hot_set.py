"""The hot set's LRU per layer and KV head, on hand-made selections."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from kvcache import hot_set
from kvcache.hot_set import (
    CELLS,
    FILL_FROM,
    FILL_INTO,
    HOST_CELLS,
    MISS_POS,
    DictHotSet,
    HotSet,
    LayerRoute,
    NativeHotSet,
)
from services import settings

NUM_PAGES = 100  # ids from 100 name host slots
CAPACITY = 50  # host slots per KV head


def parked(*slots: int) -> list[int]:
    return [NUM_PAGES + s for s in slots]


@dataclass
class Route:
    """One layer's route of one request as lists, flattened over `[KVH, k]`."""

    cells: list[int]  # pool cell each choice is read from: head * num_pages + page
    misses: list[int] = field(default_factory=list)  # positions read from the host tier
    host_cells: list[int] = field(default_factory=list)  # their host cells: head * cap + slot
    fills: list[tuple[int, int]] = field(default_factory=list)  # (index into misses, pool cell)


def route(hot: HotSet, layer: int, ids: list[list[int]]) -> Route:
    """`route_into` for one row, read back as lists."""
    out = LayerRoute(sum(len(chosen) for chosen in ids))
    hot.route_into(layer, torch.tensor(ids, dtype=torch.long), NUM_PAGES, CAPACITY, out, 0)
    rows, (misses, fills, _) = out.rows.tolist(), out.counts.tolist()
    found = Route(rows[CELLS], rows[MISS_POS][:misses], rows[HOST_CELLS][:misses])
    found.fills = list(zip(rows[FILL_FROM][:fills], rows[FILL_INTO][:fills], strict=True))
    return found


@pytest.fixture(scope="module")
def router() -> hot_set.Router:
    built = hot_set.router(settings.cache_dir() / "kernels")
    assert built is not None, "no C compiler: the native hot set cannot be tested"
    return built


@pytest.fixture(params=["dict", "native"])
def new(request, router):
    """Makes a hot set of either implementation (the same LRU)."""

    def make(num_layers: int, num_kv_heads: int) -> HotSet:
        if request.param == "dict":
            return DictHotSet(num_layers, num_kv_heads)
        return NativeHotSet(num_layers, num_kv_heads, router)

    return make


def test_without_ways_every_parked_choice_is_a_miss_and_resident_pages_read_in_place(new):
    hot = new(num_layers=2, num_kv_heads=2)
    got = route(hot, 0, [[7, *parked(3, 4)], [8, *parked(5, 6)]])
    assert got.cells[0] == 7 and got.cells[3] == NUM_PAGES + 8  # head 1's rows of the pool
    assert got.misses == [1, 2, 4, 5]
    assert got.host_cells == [3, 4, CAPACITY + 5, CAPACITY + 6]
    assert got.fills == []
    assert hot.take_counts() == (2, 0, 4)


def test_misses_fill_ways_and_the_next_step_reads_them_from_the_pool(new):
    hot = new(num_layers=1, num_kv_heads=2)
    hot.grow([50, 51])
    first = route(hot, 0, [parked(3, 4), parked(5, 6)])
    assert first.misses == [0, 1, 2, 3]
    # every miss is kept, each head in its own cells of pool pages 50 and 51
    cells = dict(first.fills)
    assert sorted(cells[i] for i in (0, 1)) == [50, 51]
    assert sorted(cells[i] for i in (2, 3)) == [NUM_PAGES + 50, NUM_PAGES + 51]
    second = route(hot, 0, [parked(4, 9), parked(5, 6)])
    assert second.misses == [1]  # slot 9 only
    assert second.cells[0] == cells[1]  # slot 4 read from the cell it filled
    assert second.cells[2:] == [cells[2], cells[3]]
    assert dict(second.fills) == {0: cells[0]}  # slot 9 evicts slot 3, not slot 4 (hit now)
    assert hot.cached(0, 0) == [4, 9] and hot.take_counts()[1:] == (3, 5)


def test_the_least_recently_used_way_goes_first(new):
    hot = new(num_layers=1, num_kv_heads=1)
    hot.grow([60, 61, 62])
    for slot in (1, 2, 3, 1):  # slot 1 used again: slot 2 is now the oldest
        route(hot, 0, [parked(slot)])
    assert hot.cached(0, 0) == [2, 3, 1]
    route(hot, 0, [parked(8)])
    assert hot.cached(0, 0) == [3, 1, 8]


def test_more_misses_than_free_ways_keep_the_ways_hit_this_step(new):
    hot = new(num_layers=1, num_kv_heads=1)
    hot.grow([70, 71])
    route(hot, 0, [parked(1)])
    got = route(hot, 0, [parked(1, 2, 3)])
    assert got.misses == [1, 2]
    assert [i for i, _ in got.fills] == [0]  # one empty way for two misses; slot 1 stays
    assert hot.cached(0, 0) == [1, 2]


def test_layers_are_independent_and_shrink_forgets_ways(new):
    hot = new(num_layers=2, num_kv_heads=1)
    hot.grow([80, 81])
    route(hot, 0, [parked(5)])
    assert route(hot, 1, [parked(5)]).misses == [0]  # layer 1 never saw it
    assert route(hot, 0, [parked(5)]).misses == []
    assert hot.shrink(1) == [81] and hot.ways == 1
    assert hot.shrink(5) == [80] and hot.ways == 0
    assert route(hot, 0, [parked(5)]).misses == [0]
    assert hot.cached(0, 0) == [] and hot.cached(1, 0) == []


def test_the_native_lru_routes_exactly_as_its_plain_twin(router):
    """Random selections with resident pages, hits, misses, more misses than ways, growing and
    shrinking: every route, every cache content and every count equal."""
    rng = random.Random(7)
    plain, fast = DictHotSet(3, 2), NativeHotSet(3, 2, router)
    for step in range(300):
        if step % 40 == 10:
            pages = [200 + 2 * step, 201 + 2 * step]
            plain.grow(pages)
            fast.grow(pages)
        if step % 70 == 69:
            assert plain.shrink(3) == fast.shrink(3)
        layer = rng.randrange(3)
        ids = [sorted(rng.sample(range(NUM_PAGES - 5, NUM_PAGES + 14), 6)) for _ in range(2)]
        assert route(plain, layer, ids) == route(fast, layer, ids)
        for head in range(2):
            assert plain.cached(layer, head) == fast.cached(layer, head)
    assert plain.take_counts() == fast.take_counts()
    assert plain.ways == fast.ways
