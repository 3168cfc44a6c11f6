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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvcache.pages import PagedKVCache

ATTN_IMPLEMENTATION = "structserve_paged"


@dataclass
class ShortQueries:
    """One group of requests whose few new tokens attend together."""

    token_index: torch.Tensor  # [R, Qmax] packed index of each query (padding repeats a real one)
    src_index: torch.Tensor  # [N] rows of the flattened [R * Qmax] output that are real queries
    dst_index: torch.Tensor  # [N] their packed index (index tensors, not masks: no device sync)
    page_index: torch.Tensor  # [R * Pmax] pages to read, row-major, padded with page 0
    mask: torch.Tensor  # [R, 1, Qmax, Pmax * page_size] bool, True = attend


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
    short: list[ShortQueries]
    long: list[LongQuery]


def _gather(
    kv: PagedKVCache, layer: int, page_index: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of `page_index` ([rows * P] pages) as `[rows, KVH, P * ps, D]` views."""
    k_buf, v_buf = kv.workspace(page_index.numel())
    out = []
    for cache, buf in ((kv.keys[layer], k_buf), (kv.values[layer], v_buf)):
        paged = cache.view(cache.shape[0], -1, kv.page_size, cache.shape[-1])  # [KVH, NP, ps, D]
        torch.index_select(paged, 1, page_index, out=buf)
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

    q = query[0].transpose(0, 1)  # [T, H, D]
    out = torch.empty_like(q)
    gqa = query.shape[1] != key.shape[1]
    for s in batch.short:
        rows = s.token_index.shape[0]
        ks, vs = _gather(kv, layer, s.page_index, rows)
        qs = q[s.token_index].transpose(1, 2)  # [R, H, Qmax, D]
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=s.mask, scale=scaling, enable_gqa=gqa
        ).transpose(1, 2)  # [R, Qmax, H, D]
        out.index_copy_(0, s.dst_index, o.flatten(0, 1).index_select(0, s.src_index))
    for lq in batch.long:
        ql = query[:, :, lq.start : lq.end]  # [1, H, n, D]
        if lq.page_index is None:
            kl, vl = key[:, :, lq.start : lq.end], value[:, :, lq.start : lq.end]
            o = F.scaled_dot_product_attention(
                ql, kl, vl, is_causal=True, scale=scaling, enable_gqa=gqa
            )
        else:
            kl, vl = _gather(kv, layer, lq.page_index, 1)
            o = F.scaled_dot_product_attention(
                ql, kl, vl, attn_mask=lq.mask, scale=scaling, enable_gqa=gqa
            )
        out[lq.start : lq.end] = o[0].transpose(0, 1)
    return out[None], None


def register() -> str:
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
