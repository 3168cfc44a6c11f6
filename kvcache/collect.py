"""Attention that also yields its softmax weights, summed per key into the slot scores the
H2O and SnapKV policies evict by (`kvcache/policies.py`); called from `kvcache/attention.py`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcache.pages import PagedKVCache


@dataclass
class CollectRead:
    """Rows whose attention weights feed the per-slot scores (H2O accumulates, SnapKV observes)."""

    mode: str  # "accumulate" | "observe"
    key_slots: torch.Tensor  # [R, S] (or [S]) slot of each key position; padding: the sink slot
    q_weight: torch.Tensor  # [R, Q] (or [Q]) 1.0 for the queries whose weights count
    kernel_size: int  # "observe": votes are average-pooled over this many neighbours
    voters: int = 0  # "observe" in a long query: how many trailing queries vote


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
