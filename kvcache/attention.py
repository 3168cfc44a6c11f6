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

from kvcache import variants
from kvcache.collect import CollectRead, _collecting_attention, _observe
from kvcache.hot_set import HotSet
from kvcache.pages import PagedKVCache
from kvcache.tier_read import read_tiered

ATTN_IMPLEMENTATION = "structserve_paged"


@dataclass
class QuestRead:
    """Quest rows of a group: each reads `k` pages per KV head, chosen by the page key bounds."""

    page_table: torch.Tensor  # [R, Pmax] the row's pages in order, padded with page 0
    num_pages: torch.Tensor  # [R]
    ends: torch.Tensor  # [R] cache entries the query sees (its own included)
    k: int
    dense_layers: int  # layers below this read every page
    hot: list[HotSet] | None = None  # offloaded rows: each row's hot set; parked ids are read
    # from its cells or from the host tier
    union: bool = False  # each query head ranks the pages (see `quest_page_scores`)


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
        pool pages, and parked pages in the host tier's arena, which on the kernel's CPU is
        memory it reads like the pool)."""
        return (
            kv.kernel is not None
            and self.collect is None
            and self.starts is not None
            and kv.keys.dtype == torch.float32
        )


@dataclass
class LongQuery:
    start: int  # packed index of the first query token
    end: int
    page_index: torch.Tensor | None  # [P] pages to read; None: no cached prefix, attend to itself
    mask: torch.Tensor | None  # [1, 1, n, P * page_size] bool
    collect: CollectRead | None = None
    host: HostRead | None = None


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
        if not by_quest and s.in_place(kv):
            q_packed = q.contiguous() if q_packed is None else q_packed
            _kernel_attention(kv, layer, q_packed, out, s, scaling, variant)
            continue
        rows = s.token_index.shape[0]
        qs = q[s.token_index].transpose(1, 2)  # [R, H, Qmax, D]
        if by_quest:
            assert quest is not None
            o = _quest_attention(kv, layer, qs, quest, scaling)
        else:  # every page (Quest too when its budget covers every page: the exact twin)
            ks, vs = _gather(kv, layer, s.page_index, rows, s.host)
            if s.collect is not None:
                o = _collecting_attention(kv, layer, qs, ks, vs, s.mask, s.collect, scaling)
            else:
                o = attend(qs, ks, vs, batch.mask_for(g, s.mask, variant.window))
        o = o.transpose(1, 2)  # [R, Qmax, H, D]
        out.index_copy_(0, s.dst_index, o.flatten(0, 1).index_select(0, s.src_index))
    for lq in batch.long:
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
    out: torch.Tensor,
    s: ShortQueries,
    scaling: float | None,
    variant: variants.LayerVariant,
) -> None:
    """The group's queries attend to their pages in place; results land in `out` directly."""
    assert kv.kernel is not None and s.starts is not None
    assert s.offsets is not None and s.num_queries is not None
    rows = s.starts.shape[0]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    table, host = s.page_index, None
    if s.host is not None:  # parked pages: read from the host tier's arena where they lie
        assert kv.host is not None
        table, host = s.host.ids, kv.host.layer(layer)
        kv.host.count_read(s.host.positions.numel() * kv.layout.num_kv_heads)
    kv.kernel.short(
        q,
        out,
        kv.keys[layer],
        kv.values[layer],
        table.view(rows, -1),
        s.starts,
        s.num_queries,
        s.offsets,
        kv.page_size,
        scale,
        variant.window,
        variant.softcap,
        host,
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


def quest_page_scores(
    q: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    valid: torch.Tensor | None = None,
    union: bool = False,
) -> torch.Tensor:
    """Page scores for the top-k choice: q `[R, KVH, G, D]`, bounds `[R, KVH, P, D]`, `valid`
    `[R, P]` (False: padding, scored -inf). Returns `[R, KVH, P]`.

    The bound of q·k over a page is sum_d max(q_d * hi_d, q_d * lo_d) = q⁺·hi + q⁻·lo. Without
    `union` a page scores the largest bound over the G query heads sharing a KV head. With it, a
    page scores minus its best rank among the heads (a head's first choice ranks 0), ties broken
    by that largest bound: the top k are every head's first choices, then every head's second...
    """
    bound = (q.clamp(min=0) @ hi.transpose(-1, -2) + q.clamp(max=0) @ lo.transpose(-1, -2)).float()
    if valid is not None:
        bound.masked_fill_(~valid[:, None, None, :], float("-inf"))
    top = bound.amax(dim=2)
    if not union:
        return top
    order = bound.argsort(dim=-1, descending=True)  # [R, KVH, G, P]
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(order.shape[-1], device=q.device).expand_as(order))
    best = ranks.amin(dim=2).float()  # [R, KVH, P]
    finite = torch.where(top.isfinite(), top, torch.zeros_like(top))
    span = (finite.amax(-1, keepdim=True) - finite.amin(-1, keepdim=True)).clamp(min=1e-6)
    tie = 0.5 * (finite - finite.amin(-1, keepdim=True)) / span  # in [0, 0.5]: below one rank
    score = tie - best
    return score.masked_fill(~top.isfinite(), float("-inf"))


def _quest_attention(
    kv: PagedKVCache, layer: int, qs: torch.Tensor, quest: QuestRead, scaling: float | None
) -> torch.Tensor:
    """qs `[R, H, 1, D]` attends to the `quest.k` best pages of each KV head (the last always)."""
    rows, heads, _, dim = qs.shape
    kvh, ps, num_pages = kv.layout.num_kv_heads, kv.page_size, kv.num_pages
    table = quest.page_table  # [R, P]
    cells = kv.bound_cells(table).flatten(1)  # [R, P * splits]: each page's parts in order
    lo = kv.bounds_min[layer][:, cells].transpose(0, 1)  # [R, KVH, P * splits, D]
    hi = kv.bounds_max[layer][:, cells].transpose(0, 1)
    first = torch.arange(cells.shape[1], device=table.device) * (ps // kv.bound_splits)
    valid = first[None, :] < quest.ends[:, None]  # [R, P * splits]: parts holding a key
    score = quest_page_scores(qs.view(rows, kvh, heads // kvh, dim), lo, hi, valid, quest.union)
    score = score.view(rows, kvh, table.shape[1], kv.bound_splits).amax(dim=-1)  # best part
    last = (quest.num_pages - 1)[:, None, None].expand(rows, kvh, 1)
    score.scatter_(2, last, float("inf"))  # the page being written is always read
    chosen = score.topk(quest.k, dim=-1).indices.sort(dim=-1).values  # [R, KVH, k] in order
    physical = table.gather(1, chosen.flatten(1)).view(rows, kvh, quest.k)
    if quest.hot is not None:
        keys, values = read_tiered(kv, layer, physical, quest.hot)
    else:
        heads_first = torch.arange(kvh, device=table.device)[None, :, None] * num_pages
        flat = (heads_first + physical).flatten()
        shape = (rows, kvh, quest.k * ps, dim)
        keys = kv.keys[layer].view(kvh * num_pages, ps, dim).index_select(0, flat).view(shape)
        values = kv.values[layer].view(kvh * num_pages, ps, dim).index_select(0, flat).view(shape)
    token = chosen[..., None] * ps + torch.arange(ps, device=table.device)  # [R, KVH, k, ps]
    seen = (token < quest.ends[:, None, None, None]).view(rows, kvh, 1, quest.k * ps)
    mask = seen.repeat_interleave(heads // kvh, dim=1)  # [R, H, 1, k * ps]
    return F.scaled_dot_product_attention(
        qs, keys, values, attn_mask=mask, scale=scaling, enable_gqa=heads != kvh
    )


def register() -> str:
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
