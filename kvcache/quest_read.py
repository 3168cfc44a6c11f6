"""Quest's reading (arXiv 2406.10774): each KV head of a decode row reads the `k` pages whose
key bounds promise the largest scores, from the per-page channel-wise min and max of their keys
(`PagedKVCache.bounds_min/max`, kept by `kvcache/attention.py` as keys are written).

`choose` ranks the pages; `attention` then either copies the chosen pages out (from the pool, or
through the host tier for offloaded rows) and runs SDPA, the plain path, or has the attention
kernel read them where they lie (`kvcache/triton_attention.py`, per-head page tables).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcache.hot_set import HotSet
from kvcache.pages import PagedKVCache
from kvcache.tier_read import read_tiered


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


def choose(
    kv: PagedKVCache, layer: int, qs: torch.Tensor, quest: QuestRead
) -> tuple[torch.Tensor, torch.Tensor]:
    """qs `[R, H, 1, D]`: the `quest.k` best pages of each KV head (the last always), as their
    index in the row and their pool page, both `[R, KVH, k]` in the row's order."""
    rows, heads, _, dim = qs.shape
    kvh, ps = kv.layout.num_kv_heads, kv.page_size
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
    return chosen, physical


def attention(
    kv: PagedKVCache, layer: int, qs: torch.Tensor, quest: QuestRead, scaling: float | None
) -> torch.Tensor:
    """qs `[R, H, 1, D]` attends to its chosen pages, copied out: `[R, H, 1, D]`."""
    rows, heads, _, dim = qs.shape
    kvh, ps, num_pages = kv.layout.num_kv_heads, kv.page_size, kv.num_pages
    chosen, physical = choose(kv, layer, qs, quest)
    if quest.hot is not None:
        keys, values = read_tiered(kv, layer, physical, quest.hot)
    else:
        heads_first = torch.arange(kvh, device=qs.device)[None, :, None] * num_pages
        flat = (heads_first + physical).flatten()
        shape = (rows, kvh, quest.k * ps, dim)
        keys = kv.keys[layer].view(kvh * num_pages, ps, dim).index_select(0, flat).view(shape)
        values = kv.values[layer].view(kvh * num_pages, ps, dim).index_select(0, flat).view(shape)
    token = chosen[..., None] * ps + torch.arange(ps, device=qs.device)  # [R, KVH, k, ps]
    seen = (token < quest.ends[:, None, None, None]).view(rows, kvh, 1, quest.k * ps)
    mask = seen.repeat_interleave(heads // kvh, dim=1)  # [R, H, 1, k * ps]
    return F.scaled_dot_product_attention(
        qs, keys, values, attn_mask=mask, scale=scaling, enable_gqa=heads != kvh
    )
