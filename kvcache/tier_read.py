"""Quest's read of an offloaded request's chosen pages (the host tier).

Quest picks, per layer and KV head, the pages a decode step reads (`kvcache.attention`). For an
offloaded request some of them are parked in the host tier: this module reads them through the
request's hot set (`kvcache.hot_set`), which says per choice whether it is read from the pool
(resident pages, hits) or from the host tier (misses, copied into the hot set's cells it keeps).
"""

from __future__ import annotations

import time

import torch

from kvcache.hot_set import (
    CELLS,
    FILL_FROM,
    FILL_INTO,
    HOST_CELLS,
    LATE,
    MISS_POS,
    HotSet,
    LayerRoute,
    route_rows,
)
from kvcache.pages import PagedKVCache


def read_tiered(
    kv: PagedKVCache, layer: int, physical: torch.Tensor, hot: list[HotSet]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages Quest chose `[R, KVH, k]`, some of them parked: resident pages and hot-set hits
    are read from the pool, misses from the host tier (and written into the hot-set cells that
    keep them). The ids go to the host (on CUDA the layer's one sync): the host routes them
    (`kvcache.hot_set`) and issues the copies. On CPU with the native hot set the copies are one
    C pass (`Router.copy`); otherwise (its plain twin, and CUDA) tensor ops."""
    rows, kvh, k = physical.shape
    ps, dim, num_pages = kv.page_size, kv.layout.head_dim, kv.num_pages
    capacity = kv.host.capacity_pages if kv.host is not None else 0
    route = route_rows(hot, layer, physical.cpu(), num_pages, capacity)
    pools = [c.view(kvh * num_pages, ps, dim) for c in (kv.keys[layer], kv.values[layer])]
    router = hot[0].router
    if router is not None and kv.device.type == "cpu" and kv.host is not None:
        out = [torch.empty((rows * kvh * k, ps, dim), dtype=kv.layout.dtype) for _ in pools]
        host = [c.view(-1, ps, dim) for c in kv.host.layer(layer)]
        start = time.perf_counter()
        router.copy(route, (out[0], out[1]), (pools[0], pools[1]), (host[0], host[1]))
        if misses := int(route.counts[0]):
            kv.host.record_read(misses, time.perf_counter() - start)
    else:
        out = _copy_route(kv, layer, route, pools)
    shape = (rows, kvh, k * ps, dim)
    return out[0].view(shape), out[1].view(shape)


def _copy_route(
    kv: PagedKVCache, layer: int, route: LayerRoute, pools: list[torch.Tensor]
) -> list[torch.Tensor]:
    """`route`'s copies as tensor ops (any device): misses from the host tier into the cells
    that keep them, one gather from the pool, the misses not kept copied in after it."""
    misses, fills, late = route.counts.tolist()
    index = route.rows.to(kv.device, non_blocking=True)  # one copy to the device for all rows
    blocks: tuple[torch.Tensor, ...] = ()
    if misses:
        assert kv.host is not None
        blocks = kv.host.read_cells(layer, route.rows[HOST_CELLS, :misses])
        into = index[FILL_INTO, :fills]
        for pool, block in zip(pools, blocks, strict=True):  # into the hot set's cells
            pool.index_copy_(0, into, block if fills == misses else block[index[FILL_FROM, :fills]])
    out = [pool.index_select(0, index[CELLS]) for pool in pools]  # [R * KVH * k, ps, D]
    if late:
        which = index[LATE, :late]
        where = index[MISS_POS].index_select(0, which)
        for buf, block in zip(out, blocks, strict=True):
            buf.index_copy_(0, where, block.index_select(0, which))
    return out
