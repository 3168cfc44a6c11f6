"""The attention function transformers calls in every layer, reading and writing the paged pool.

Registered with `AttentionInterface` under `ATTN_IMPLEMENTATION`, so any model transformers defines
runs unmodified: the model computes q, k, v and rotary embeddings from our explicit `position_ids`,
then hands them here with the step's `PagedBatch` in `kwargs`.

The batch is packed: every scheduled token of every request in one row, `[1, T, ...]`.
- Short queries (decode tokens, jump-forward spans) go through padded, batched attention calls, one
  per group of requests with similar context lengths (so padding stays small).
- Long queries (prompt chunks) run one call each; a chunk with no cached prefix attends to its own
  keys only, with a causal kernel and no gather.
Pages are gathered into a workspace the pool keeps, so no layer allocates a fresh buffer.
Per-layer variants (sliding windows, soft-capped logits) come from `kvcache/variants.py`.
The step's batch arrives as the `paged_batch` keyword or, for a model whose layers do not pass
keywords through (StableLM), from `stepping()` around the forward.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvcache import quest_read, variants
from kvcache.collect import CollectRead, _collecting_attention, _observe
from kvcache.pages import PagedKVCache
from kvcache.quest_read import QuestRead

ATTN_IMPLEMENTATION = "structserve_paged"


@dataclass
class HostRead:
    """Parked pages in a group's page index: read from the host tier, per layer, in one copy."""

    positions: torch.Tensor  # [M] entries of the flattened page index that are parked
    slots: torch.Tensor  # [M] their host slots (kept on the host: the copy is issued from there)
    resident: torch.Tensor  # [N] the other entries, read from the pool (only those)
    pages: torch.Tensor  # [N] their pool pages
    ids: torch.Tensor  # [M + N] the page index as it was: parked entries name `num_pages + slot`

    def to(self, device: torch.device) -> HostRead:
        positions, resident, pages, ids = (
            t.to(device, non_blocking=True)
            for t in (self.positions, self.resident, self.pages, self.ids)
        )
        return HostRead(positions, self.slots, resident, pages, ids)


@dataclass
class BoundsUpdate:
    """New keys that move Quest's per-page min/max."""

    tokens: torch.Tensor  # [N] packed index of each key
    cells: torch.Tensor  # [N] its bound cell (`PagedKVCache.bound_cells`: its page's part)
    fresh: torch.Tensor  # [F] cells of pages whose first key arrives now: old bounds go


@dataclass
class ShortQueries:
    """One group of requests whose few new tokens attend together."""

    token_index: torch.Tensor  # [R, Qmax] packed index of each query (padding repeats a real one)
    src_index: torch.Tensor  # [N] rows of the flattened [R * Qmax] output that are real queries
    dst_index: torch.Tensor  # [N] their packed index (index tensors, not masks: no device sync)
    page_index: torch.Tensor  # [R * Pmax] pages to read, row-major, padded with page 0
    mask: torch.Tensor  # [R, 1, Qmax, Pmax * page_size] bool, True = attend
    quest: QuestRead | None = None
    collect: CollectRead | None = None
    host: HostRead | None = None
    # [R] each row's first query: its cache index and packed index; [R] its query count (what
    # the in-place kernel reads instead of `mask`)
    starts: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    num_queries: torch.Tensor | None = None

    def in_place(self, kv: PagedKVCache) -> bool:
        """Whether the kernel reads this group's pages where they lie (rows reading every page:
        pool pages, and parked pages where the kernel reads the host tier's arena in place)."""
        return (
            kv.kernel is not None
            and self.collect is None
            and self.starts is not None
            and kv.kernel.reads(kv.keys.dtype, self.host is not None)
        )

    def quest_in_place(self, kv: PagedKVCache) -> bool:
        """Whether the kernel reads this group's Quest choice where it lies (pool pages only)."""
        return (
            kv.kernel is not None
            and kv.kernel.quest
            and self.quest is not None
            and self.quest.hot is None
            and self.starts is not None
            and kv.kernel.reads(kv.keys.dtype, False)
        )


@dataclass
class LongQuery:
    start: int  # packed index of the first query token
    end: int
    page_index: torch.Tensor | None  # [P] pages to read; None: no cached prefix, attend to itself
    mask: torch.Tensor | None  # [1, 1, n, P * page_size] bool
    collect: CollectRead | None = None
    host: HostRead | None = None
    rows: torch.Tensor | None = None  # [3, 1] (cache position of the first query, queries,
    # packed index of the first query): the kernel's row, for a chunk over a cached prefix

    def in_place(self, kv: PagedKVCache) -> bool:
        return (
            kv.kernel is not None
            and kv.kernel.prompt_chunks
            and self.page_index is not None
            and self.rows is not None
            and self.collect is None
            and self.host is None
            and kv.kernel.reads(kv.keys.dtype, False)
        )


@dataclass
class PagedBatch:
    kv: PagedKVCache
    slot_mapping: torch.Tensor  # [T] slot each new token's keys and values are written to
    short: list[ShortQueries]
    long: list[LongQuery]
    bounds: BoundsUpdate | None = None
    zero_slots: torch.Tensor | None = None  # [Z] new slots whose score starts at zero
    # (group, window) -> the group's mask windowed: built by the first layer with that window
    windowed: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def to(self, device: torch.device) -> PagedBatch:
        return _move(self, device)

    def mask_for(self, group: int, mask: torch.Tensor, window: int | None) -> torch.Tensor:
        if window is None or window >= mask.shape[-1]:
            return mask
        key = (group, window)
        if key not in self.windowed:
            self.windowed[key] = variants.windowed(mask, window)
        return self.windowed[key]


_CURRENT: contextvars.ContextVar[PagedBatch | None] = contextvars.ContextVar(
    "structserve_paged_batch", default=None
)


@contextmanager
def stepping(batch: PagedBatch) -> Iterator[None]:
    """`batch` is the step's for every layer called inside."""
    token = _CURRENT.set(batch)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _move(obj: Any, device: torch.device) -> Any:
    """A copy of a metadata dataclass with every tensor moved (non-blocking) to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, HostRead):
        return obj.to(device)
    if isinstance(obj, list):
        return [_move(o, device) for o in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, PagedKVCache):
        fields = [f for f in dataclasses.fields(obj) if f.name != "windowed"]
        changes = {f.name: _move(getattr(obj, f.name), device) for f in fields}
        return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
    return obj


def _gather(
    kv: PagedKVCache, layer: int, page_index: torch.Tensor, rows: int, host: HostRead | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of `page_index` ([rows * P] pages) as `[rows, KVH, P * ps, D]` views."""
    k_buf, v_buf = kv.workspace(page_index.numel())
    out = []
    for cache, buf in ((kv.keys[layer], k_buf), (kv.values[layer], v_buf)):
        paged = cache.view(cache.shape[0], -1, kv.page_size, cache.shape[-1])  # [KVH, NP, ps, D]
        if host is None:
            torch.index_select(paged, 1, page_index, out=buf)
        else:  # offloaded rows are mostly parked: read only the resident entries from the pool
            buf.index_copy_(1, host.resident, paged.index_select(1, host.pages))
    if host is not None:  # parked pages: one batched copy from the host tier for this layer
        assert kv.host is not None
        kvh, cap = kv.layout.num_kv_heads, kv.host.capacity_pages
        cells = (torch.arange(kvh)[:, None] * cap + host.slots[None, :]).flatten()
        for buf, block in zip((k_buf, v_buf), kv.host.read_cells(layer, cells), strict=True):
            buf.index_copy_(1, host.positions, block.view(kvh, -1, *block.shape[1:]))
    for buf in (k_buf, v_buf):
        # [KVH, rows * P, ps, D] -> [rows, KVH, P * ps, D]: a view, tokens stay contiguous
        out.append(buf.view(buf.shape[0], rows, -1, buf.shape[-1]).transpose(0, 1))
    return out[0], out[1]


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D] post-RoPE
    key: torch.Tensor,  # [1, KVH, T, D] post-RoPE
    value: torch.Tensor,  # [1, KVH, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_batch: PagedBatch | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    batch = paged_batch if paged_batch is not None else _CURRENT.get()
    if batch is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs the step's PagedBatch")
    kv = batch.kv
    layer: int = module.layer_idx  # type: ignore[assignment]
    variant = variants.layer_variant(layer, kwargs)
    kv.keys[layer].index_copy_(1, batch.slot_mapping, key[0])
    kv.values[layer].index_copy_(1, batch.slot_mapping, value[0])
    if batch.bounds is not None:
        _update_bounds(kv, layer, key[0], batch.bounds)
    if batch.zero_slots is not None:
        kv.scores[layer].index_fill_(1, batch.zero_slots, 0.0)

    q = query[0].transpose(0, 1)  # [T, H, D]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous: o_proj's input
    gqa = query.shape[1] != key.shape[1]
    q_packed: torch.Tensor | None = None  # q contiguous, for the kernel

    def attend(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor, mask: Any) -> torch.Tensor:
        if variant.softcap is not None:
            return variants.softcapped_attention(q_, k_, v_, mask, scaling, variant.softcap)
        return F.scaled_dot_product_attention(
            q_, k_, v_, attn_mask=mask, scale=scaling, enable_gqa=gqa
        )

    for g, s in enumerate(batch.short):
        quest = s.quest
        by_quest = (
            quest is not None
            and layer >= quest.dense_layers
            and quest.k < quest.page_table.shape[1]
        )
        if (not by_quest and s.in_place(kv)) or (by_quest and s.quest_in_place(kv)):
            q_packed = q.contiguous() if q_packed is None else q_packed
            _kernel_attention(kv, layer, q, q_packed, out, s, scaling, variant, by_quest)
            continue
        rows = s.token_index.shape[0]
        qs = q[s.token_index].transpose(1, 2)  # [R, H, Qmax, D]
        if by_quest:
            assert quest is not None
            o = quest_read.attention(kv, layer, qs, quest, scaling)
        else:  # every page (Quest too when its budget covers every page: the exact twin)
            ks, vs = _gather(kv, layer, s.page_index, rows, s.host)
            if s.collect is not None:
                o = _collecting_attention(kv, layer, qs, ks, vs, s.mask, s.collect, scaling)
            else:
                o = attend(qs, ks, vs, batch.mask_for(g, s.mask, variant.window))
        o = o.transpose(1, 2)  # [R, Qmax, H, D]
        out.index_copy_(0, s.dst_index, o.flatten(0, 1).index_select(0, s.src_index))
    for lq in batch.long:
        if lq.in_place(kv):
            q_packed = q.contiguous() if q_packed is None else q_packed
            _kernel_long(kv, layer, q_packed, out, lq, scaling, variant)
            continue
        ql = query[:, :, lq.start : lq.end]  # [1, H, n, D]
        if lq.page_index is None:
            kl, vl = key[:, :, lq.start : lq.end], value[:, :, lq.start : lq.end]
        else:
            kl, vl = _gather(kv, layer, lq.page_index, 1, lq.host)
        if lq.collect is not None and lq.collect.mode == "accumulate":
            c = lq.collect
            one = CollectRead(c.mode, c.key_slots[None], c.q_weight[None], c.kernel_size)
            o = _collecting_attention(kv, layer, ql, kl, vl, lq.mask, one, scaling)
        elif lq.page_index is None and variant.window is None and variant.softcap is None:
            o = F.scaled_dot_product_attention(
                ql, kl, vl, is_causal=True, scale=scaling, enable_gqa=gqa
            )
        elif lq.page_index is None:
            o = attend(ql, kl, vl, variants.causal(ql.shape[2], variant.window, ql.device))
        else:
            assert lq.mask is not None
            o = attend(ql, kl, vl, batch.mask_for(-1 - lq.start, lq.mask, variant.window))
        out[lq.start : lq.end] = o[0].transpose(0, 1)
        if lq.collect is not None and lq.collect.mode == "observe":
            _observe(kv, layer, ql, kl, vl, lq.mask, lq.collect, scaling)
    return out[None], None


def _kernel_attention(
    kv: PagedKVCache,
    layer: int,
    q: torch.Tensor,
    q_packed: torch.Tensor,
    out: torch.Tensor,
    s: ShortQueries,
    scaling: float | None,
    variant: variants.LayerVariant,
    by_quest: bool,
) -> None:
    """The group's queries attend to their pages in place (with Quest: each KV head to the
    pages it chose); results land in `out` directly."""
    assert kv.kernel is not None and s.starts is not None
    assert s.offsets is not None and s.num_queries is not None
    rows, max_queries = s.token_index.shape
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    table, host, logical = s.page_index.view(rows, -1), None, None
    if by_quest:
        assert s.quest is not None
        qs = q[s.token_index].transpose(1, 2)  # [R, H, 1, D]
        logical, table = quest_read.choose(kv, layer, qs, s.quest)
    elif s.host is not None:  # parked pages: read from the host tier's arena where they lie
        assert kv.host is not None
        table, host = s.host.ids.view(rows, -1), kv.host.layer(layer)
        kv.host.count_read(s.host.positions.numel() * kv.layout.num_kv_heads)
    kv.kernel.short(
        q_packed,
        out,
        kv.keys[layer],
        kv.values[layer],
        table,
        s.starts,
        s.num_queries,
        s.offsets,
        kv.page_size,
        scale,
        variant.window,
        variant.softcap,
        host,
        max_queries,
        logical,
    )


def _kernel_long(
    kv: PagedKVCache,
    layer: int,
    q: torch.Tensor,
    out: torch.Tensor,
    lq: LongQuery,
    scaling: float | None,
    variant: variants.LayerVariant,
) -> None:
    """A prompt chunk attends to its cached prefix and itself in place (one kernel row; no
    kernel that serves chunks reads parked pages: `LongQuery.in_place`)."""
    assert kv.kernel is not None and lq.page_index is not None and lq.rows is not None
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    starts, num_queries, offsets = lq.rows
    kv.kernel.short(
        q,
        out,
        kv.keys[layer],
        kv.values[layer],
        lq.page_index.view(1, -1),
        starts,
        num_queries,
        offsets,
        kv.page_size,
        scale,
        variant.window,
        variant.softcap,
        None,
        lq.end - lq.start,
    )


def _update_bounds(kv: PagedKVCache, layer: int, keys: torch.Tensor, upd: BoundsUpdate) -> None:
    """keys `[KVH, T, D]`: fold the new keys into their cells' channel-wise min and max."""
    new = keys.index_select(1, upd.tokens)  # [KVH, N, D] post-RoPE, as Quest's bounds need
    lo, hi = kv.bounds_min[layer], kv.bounds_max[layer]
    if upd.fresh.numel():
        lo.index_fill_(1, upd.fresh, float("inf"))
        hi.index_fill_(1, upd.fresh, float("-inf"))
    index = upd.cells[None, :, None].expand_as(new)
    lo.scatter_reduce_(1, index, new, "amin")
    hi.scatter_reduce_(1, index, new, "amax")


def register() -> str:
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
