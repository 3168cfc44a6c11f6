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
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvcache.hot_set import HotSet
from kvcache.pages import PagedKVCache

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


@dataclass
class CollectRead:
    """Rows whose attention weights feed the per-slot scores (H2O accumulates, SnapKV observes)."""

    mode: str  # "accumulate" | "observe"
    key_slots: torch.Tensor  # [R, S] (or [S]) slot of each key position; padding: the sink slot
    q_weight: torch.Tensor  # [R, Q] (or [Q]) 1.0 for the queries whose weights count
    kernel_size: int  # "observe": votes are average-pooled over this many neighbours
    voters: int = 0  # "observe" in a long query: how many trailing queries vote


@dataclass
class HostRead:
    """Parked pages in a group's page index: read from the host tier, per layer, in one copy."""

    positions: torch.Tensor  # [M] entries of the flattened page index that are parked
    slots: torch.Tensor  # [M] their host slots (kept on the host: the copy is issued from there)
    resident: torch.Tensor  # [N] the other entries, read from the pool (only those)
    pages: torch.Tensor  # [N] their pool pages

    def to(self, device: torch.device) -> HostRead:
        positions, resident, pages = (
            t.to(device, non_blocking=True) for t in (self.positions, self.resident, self.pages)
        )
        return HostRead(positions, self.slots, resident, pages)


@dataclass
class BoundsUpdate:
    """New keys that move Quest's per-page min/max."""

    tokens: torch.Tensor  # [N] packed index of each key
    pages: torch.Tensor  # [N] its page
    fresh: torch.Tensor  # [F] pages whose first key arrives now: old bounds are dropped


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

    def to(self, device: torch.device) -> PagedBatch:
        return _move(self, device)


def _move(obj: Any, device: torch.device) -> Any:
    """A copy of a metadata dataclass with every tensor moved (non-blocking) to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, HostRead):
        return obj.to(device)
    if isinstance(obj, list):
        return [_move(o, device) for o in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, PagedKVCache):
        changes = {f.name: _move(getattr(obj, f.name), device) for f in dataclasses.fields(obj)}
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
    if paged_batch is None:
        raise RuntimeError(
            f"{ATTN_IMPLEMENTATION} attention needs a PagedBatch in the model kwargs"
        )
    batch = paged_batch
    kv = batch.kv
    layer: int = module.layer_idx  # type: ignore[assignment]
    kv.keys[layer].index_copy_(1, batch.slot_mapping, key[0])
    kv.values[layer].index_copy_(1, batch.slot_mapping, value[0])
    if batch.bounds is not None:
        _update_bounds(kv, layer, key[0], batch.bounds)
    if batch.zero_slots is not None:
        kv.scores[layer].index_fill_(1, batch.zero_slots, 0.0)

    q = query[0].transpose(0, 1)  # [T, H, D]
    out = torch.empty_like(q)
    gqa = query.shape[1] != key.shape[1]
    for s in batch.short:
        rows = s.token_index.shape[0]
        qs = q[s.token_index].transpose(1, 2)  # [R, H, Qmax, D]
        quest = s.quest
        if (
            quest is not None
            and layer >= quest.dense_layers
            and quest.k < quest.page_table.shape[1]
        ):
            o = _quest_attention(kv, layer, qs, quest, scaling)
        else:  # every page (Quest too when its budget covers every page: the exact twin)
            ks, vs = _gather(kv, layer, s.page_index, rows, s.host)
            if s.collect is not None:
                o = _collecting_attention(kv, layer, qs, ks, vs, s.mask, s.collect, scaling)
            else:
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=s.mask, scale=scaling, enable_gqa=gqa
                )
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
        elif lq.page_index is None:
            o = F.scaled_dot_product_attention(
                ql, kl, vl, is_causal=True, scale=scaling, enable_gqa=gqa
            )
        else:
            o = F.scaled_dot_product_attention(
                ql, kl, vl, attn_mask=lq.mask, scale=scaling, enable_gqa=gqa
            )
        out[lq.start : lq.end] = o[0].transpose(0, 1)
        if lq.collect is not None and lq.collect.mode == "observe":
            _observe(kv, layer, ql, kl, vl, lq.mask, lq.collect, scaling)
    return out[None], None


def _observe(
    kv: PagedKVCache,
    layer: int,
    q: torch.Tensor,  # [1, H, n, D]
    k: torch.Tensor,  # [1, KVH, S, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # [1, 1, n, S]; None: the chunk attends to itself, causally
    collect: CollectRead,
    scaling: float | None,
) -> None:
    """SnapKV's vote: only the chunk's last queries (the observation window) are materialised."""
    n, s = q.shape[2], k.shape[2]
    w = int(collect.q_weight.shape[0] - collect.voters)  # first voting query
    if mask is None:
        mask = (
            torch.arange(s, device=q.device)[None, :] <= torch.arange(n, device=q.device)[:, None]
        )[None, None]
    one = CollectRead(
        collect.mode, collect.key_slots[None], collect.q_weight[None, w:], collect.kernel_size
    )
    _collecting_attention(kv, layer, q[:, :, w:], k, v, mask[:, :, w:], one, scaling)


def _update_bounds(kv: PagedKVCache, layer: int, keys: torch.Tensor, upd: BoundsUpdate) -> None:
    """keys `[KVH, T, D]`: fold the new keys into their pages' channel-wise min and max."""
    new = keys.index_select(1, upd.tokens)  # [KVH, N, D] post-RoPE, as Quest's bounds need
    lo, hi = kv.bounds_min[layer], kv.bounds_max[layer]
    if upd.fresh.numel():
        lo.index_fill_(1, upd.fresh, float("inf"))
        hi.index_fill_(1, upd.fresh, float("-inf"))
    index = upd.pages[None, :, None].expand_as(new)
    lo.scatter_reduce_(1, index, new, "amin")
    hi.scatter_reduce_(1, index, new, "amax")


def quest_page_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Upper bounds of q·k over each page: q `[R, KVH, G, D]`, bounds `[R, KVH, P, D]`.

    sum_d max(q_d * hi_d, q_d * lo_d) = q⁺·hi + q⁻·lo; returns `[R, KVH, P]`, the largest bound
    over the G query heads sharing a KV head.
    """
    bound = q.clamp(min=0) @ hi.transpose(-1, -2) + q.clamp(max=0) @ lo.transpose(-1, -2)
    return bound.amax(dim=2).float()


def _quest_attention(
    kv: PagedKVCache, layer: int, qs: torch.Tensor, quest: QuestRead, scaling: float | None
) -> torch.Tensor:
    """qs `[R, H, 1, D]` attends to the `quest.k` best pages of each KV head (the last always)."""
    rows, heads, _, dim = qs.shape
    kvh, ps, num_pages = kv.layout.num_kv_heads, kv.page_size, kv.num_pages
    table = quest.page_table  # [R, P]
    lo = kv.bounds_min[layer][:, table].transpose(0, 1)  # [R, KVH, P, D]
    hi = kv.bounds_max[layer][:, table].transpose(0, 1)
    score = quest_page_scores(qs.view(rows, kvh, heads // kvh, dim), lo, hi)
    pages = torch.arange(table.shape[1], device=table.device)
    score.masked_fill_((pages[None, :] >= quest.num_pages[:, None])[:, None], float("-inf"))
    last = (quest.num_pages - 1)[:, None, None].expand(rows, kvh, 1)
    score.scatter_(2, last, float("inf"))  # the page being written is always read
    chosen = score.topk(quest.k, dim=-1).indices.sort(dim=-1).values  # [R, KVH, k] in order
    physical = table.gather(1, chosen.flatten(1)).view(rows, kvh, quest.k)
    if quest.hot is not None:
        keys, values = _quest_read_tiered(kv, layer, physical, quest.hot)
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


def _quest_read_tiered(
    kv: PagedKVCache, layer: int, physical: torch.Tensor, hot: list[HotSet]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages Quest chose `[R, KVH, k]`, some of them parked. Resident pages and hot-set hits are
    read from the pool in one gather; misses from the host tier in one copy for this layer, which
    also fills the hot set's cells. The ids go to the host (on CUDA the layer's one sync): the host
    issues the copy and keeps the hot set's bookkeeping."""
    rows, kvh, k = physical.shape
    ps, dim, num_pages = kv.page_size, kv.layout.head_dim, kv.num_pages
    capacity = kv.host.capacity_pages if kv.host is not None else 0
    ids = physical.tolist()
    cells: list[int] = []
    misses: list[int] = []
    host_cells: list[int] = []
    fills: list[tuple[int, int]] = []
    for r, hot_set in enumerate(hot):
        route = hot_set.route(layer, ids[r], num_pages, capacity)
        fills += [(len(misses) + i, cell) for i, cell in route.fills]
        misses += [len(cells) + pos for pos in route.misses]
        host_cells += route.host_cells
        cells += route.cells
    pools = [c.view(kvh * num_pages, ps, dim) for c in (kv.keys[layer], kv.values[layer])]
    index = torch.tensor(cells).to(kv.device, non_blocking=True)
    out = [pool.index_select(0, index) for pool in pools]  # [R * KVH * k, ps, D]
    if misses:
        assert kv.host is not None
        blocks = kv.host.read_cells(layer, torch.tensor(host_cells))
        dst = torch.tensor(misses).to(kv.device, non_blocking=True)
        kept = torch.tensor([i for i, _ in fills], dtype=torch.long).to(kv.device)
        into = torch.tensor([cell for _, cell in fills], dtype=torch.long).to(kv.device)
        for buf, pool, block in zip(out, pools, blocks, strict=True):
            buf.index_copy_(0, dst, block)
            pool.index_copy_(0, into, block.index_select(0, kept))  # into the hot set's cells
    shape = (rows, kvh, k * ps, dim)
    return out[0].view(shape), out[1].view(shape)


# Explicit attention materialises [H, block, S] weights: queries go in blocks of this many.
COLLECT_BLOCK = 256


def _collecting_attention(
    kv: PagedKVCache,
    layer: int,
    q: torch.Tensor,  # [B, H, Q, D]
    k: torch.Tensor,  # [B, KVH, S, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # [B, 1, Q, S] bool; None: causal over the query's own keys
    collect: CollectRead,
    scaling: float | None,
) -> torch.Tensor:
    """Attention with explicit softmax weights, summed per key into the slot scores."""
    b, heads, nq, dim = q.shape
    kvh, s = k.shape[1], k.shape[2]
    scale = scaling if scaling is not None else dim**-0.5
    q5 = q.view(b, kvh, heads // kvh, nq, dim).float()
    kt = k.float().transpose(-1, -2)[:, :, None]  # [B, KVH, 1, D, S]
    vf = v.float()[:, :, None]
    out = torch.empty(b, kvh, heads // kvh, nq, dim, device=q.device)
    votes = torch.zeros(b, kvh, s, device=q.device)
    for lo in range(0, nq, COLLECT_BLOCK):
        hi = min(nq, lo + COLLECT_BLOCK)
        logits = (q5[:, :, :, lo:hi] @ kt) * scale  # [B, KVH, G, n, S]
        if mask is None:
            allowed = (
                torch.arange(s, device=q.device)[None, :]
                <= torch.arange(lo, hi, device=q.device)[:, None]
            )
        else:
            allowed = mask[:, :, None, lo:hi]  # [B, 1, 1, n, S]
        weights = logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out[:, :, :, lo:hi] = weights @ vf
        votes += torch.einsum("bkgqs,bq->bks", weights, collect.q_weight[:, lo:hi])
    if collect.mode == "observe":
        pad = collect.kernel_size // 2
        pooled = F.avg_pool1d(votes.view(b * kvh, 1, s), collect.kernel_size, 1, pad)
        votes = pooled.view(b, kvh, s)
        kv.scores[layer].index_fill_(1, collect.key_slots.flatten(), 0.0)
    # [KVH, B * S]: the scores of KV head h live in row h of the layer's [KVH, slots] scores
    kv.scores[layer].index_add_(1, collect.key_slots.flatten(), votes.transpose(0, 1).flatten(1))
    return out.view(b, heads, nq, dim).to(q.dtype)


def register() -> str:
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
