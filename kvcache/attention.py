"""The attention function transformers calls in every layer, reading and writing the paged pool.

Registered with `AttentionInterface` under `ATTN_IMPLEMENTATION`, so any model transformers defines
runs unmodified: the model computes q, k, v and rotary embeddings from our explicit `position_ids`,
then hands them here with the step's `PagedBatch` in `kwargs`.

The batch is packed: every scheduled token of every request in one row, `[1, T, ...]`.
- Short queries (decode tokens, jump-forward spans) go through one padded, batched attention call.
- Long queries (prompt chunks) run one call each; a chunk with no cached prefix attends to its own
  keys only, with a causal kernel and no gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvcache.pages import PagedKVCache

ATTN_IMPLEMENTATION = "structserve_paged"


@dataclass
class ShortQueries:
    token_index: torch.Tensor  # [B, Qmax] packed index of each query (padding repeats a valid one)
    valid: torch.Tensor  # [B, Qmax] bool
    page_index: torch.Tensor  # [B, Pmax] pages to read, padded with page 0
    mask: torch.Tensor  # [B, 1, Qmax, Pmax * page_size] bool, True = attend


@dataclass
class LongQuery:
    start: int  # packed index of the first query token
    end: int
    page_index: torch.Tensor | None  # [P] pages to read; None: no cached prefix, attend to itself
    mask: torch.Tensor | None  # [1, 1, n, P * page_size] bool


@dataclass
class PagedBatch:
    kv: PagedKVCache
    slot_mapping: torch.Tensor  # [T] slot each new token's keys and values are written to
    short: ShortQueries | None
    long: list[LongQuery]


def _gather_pages(cache: torch.Tensor, page_index: torch.Tensor, page_size: int) -> torch.Tensor:
    """[..., P] page ids -> [..., kv_heads, P * page_size, head_dim] keys or values."""
    paged = cache.view(-1, page_size, *cache.shape[1:])  # [num_pages, ps, KVH, D]
    picked = paged[page_index]  # [..., P, ps, KVH, D]
    picked = picked.flatten(-4, -3)  # [..., P * ps, KVH, D]
    return picked.transpose(-3, -2)


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
    layer: int = module.layer_idx  # type: ignore[assignment]
    ps = batch.kv.page_size
    k_cache, v_cache = batch.kv.keys[layer], batch.kv.values[layer]
    k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, KVH, D]
    k_cache.index_copy_(0, batch.slot_mapping, k_new)
    v_cache.index_copy_(0, batch.slot_mapping, v_new)

    q = query[0].transpose(0, 1)  # [T, H, D]
    out = torch.empty_like(q)
    gqa = query.shape[1] != key.shape[1]
    if batch.short is not None:
        s = batch.short
        qs = q[s.token_index].transpose(1, 2)  # [B, H, Qmax, D]
        ks = _gather_pages(k_cache, s.page_index, ps)
        vs = _gather_pages(v_cache, s.page_index, ps)
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=s.mask, scale=scaling, enable_gqa=gqa
        ).transpose(1, 2)  # [B, Qmax, H, D]
        out[s.token_index[s.valid]] = o[s.valid]
    for lq in batch.long:
        ql = q[lq.start : lq.end].transpose(0, 1)[None]  # [1, H, n, D]
        if lq.page_index is None:
            kl = k_new[lq.start : lq.end].transpose(0, 1)[None]
            vl = v_new[lq.start : lq.end].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                ql, kl, vl, is_causal=True, scale=scaling, enable_gqa=gqa
            )
        else:
            kl = _gather_pages(k_cache, lq.page_index, ps)[None]
            vl = _gather_pages(v_cache, lq.page_index, ps)[None]
            o = F.scaled_dot_product_attention(
                ql, kl, vl, attn_mask=lq.mask, scale=scaling, enable_gqa=gqa
            )
        out[lq.start : lq.end] = o[0].transpose(0, 1)
    return out[None], None


def register() -> str:
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
