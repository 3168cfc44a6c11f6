"""What differs between decoder families at the attention call, for `kvcache/attention.py`.

transformers hands each layer's variant to the attention function as keyword arguments:
`sliding_window` (Mistral, Phi 3, Qwen 2/3's windowed layers, Gemma 2/3's local layers: a query
sees the last `sliding_window` keys, its own included), `softcap` (Gemma 2: logits pass through
`tanh(x / cap) * cap` before the softmax) and `scaling` (Gemma's `query_pre_attn_scalar`). The
paged attention honours these; any other argument with a value is refused when the model loads
(`probe`), never ignored, so a family that needs more fails with its name instead of giving
wrong tokens.

The window is applied to the mask each layer reads. Cache entries are positions here (KV
policies, which move entries, are refused on models with windows: `services/engine/admission.py`),
so a query that sees `c` entries sits at position `c - 1` and keeps the entries from `c - window`.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

# Arguments transformers passes that change nothing here: positions come with the batch,
# dropout is off at inference (`dropout` and `scaling` are parameters of the function itself).
IGNORED = frozenset(
    {
        "position_ids",
        "cache_position",
        "use_cache",
        "is_causal",
        "output_attentions",
        "output_router_logits",
    }
)
HONOURED = frozenset({"sliding_window", "softcap"})


class UnsupportedAttention(ValueError):
    """The model's attention needs something the paged attention does not implement."""


@dataclass
class LayerVariant:
    window: int | None = None  # keys a query sees, its own included; None: all
    softcap: float | None = None


@dataclass
class AttentionProfile:
    """Each layer's variant, as the probe saw it (layers without one are absent)."""

    layers: dict[int, LayerVariant] = field(default_factory=dict)
    calls: int = 0  # attention calls seen: one per layer in a forward

    @property
    def windows(self) -> dict[int, int]:
        return {i: v.window for i, v in self.layers.items() if v.window is not None}

    def window_saving(self, num_layers: int, context: int) -> float:
        """The share of a `context`-token request's KV that lies outside its layers' windows: what
        freeing those pages would save (today every layer keeps every page)."""
        outside = sum(max(0, context - w) for w in self.windows.values())
        return outside / (num_layers * context) if context > 0 else 0.0

    def describe(self) -> str | None:
        """What the model's attention adds to the plain kind, for messages (None: nothing)."""
        parts = []
        if w := self.windows:
            parts.append(f"sliding windows ({len(w)} layers, {min(w.values())} tokens)")
        if any(v.softcap is not None for v in self.layers.values()):
            parts.append("soft-capped logits")
        return ", ".join(parts) or None


_PROBE: contextvars.ContextVar[AttentionProfile | None] = contextvars.ContextVar(
    "structserve_attention_probe", default=None
)


@contextmanager
def probing() -> Iterator[AttentionProfile]:
    """Every layer called inside records its variant into the profile yielded."""
    profile = AttentionProfile()
    token = _PROBE.set(profile)
    try:
        yield profile
    finally:
        _PROBE.reset(token)


def layer_variant(layer: int, kwargs: dict[str, Any]) -> LayerVariant:
    """The layer's variant from the call's keyword arguments; `UnsupportedAttention` for one
    the paged attention would have to ignore."""
    extra = sorted(k for k, v in kwargs.items() if v is not None and k not in IGNORED | HONOURED)
    if extra:
        raise UnsupportedAttention(
            f"the model's attention passes {', '.join(extra)}, which the paged attention does "
            "not implement"
        )
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    variant = LayerVariant(
        window=int(window) if window is not None and window > 0 else None,
        softcap=float(softcap) if softcap else None,
    )
    profile = _PROBE.get()
    if profile is not None:
        profile.calls += 1
        if variant.window is not None or variant.softcap is not None:
            profile.layers[layer] = variant
    return variant


def windowed(mask: torch.Tensor, window: int) -> torch.Tensor:
    """`mask` `[..., Q, S]` (causal over cache entries) keeping each query's last `window`."""
    seen = mask.sum(dim=-1, keepdim=True)  # entries the query sees: its position + 1
    keys = torch.arange(mask.shape[-1], device=mask.device)
    return mask & (keys >= seen - window)


def causal(n: int, window: int | None, device: torch.device) -> torch.Tensor:
    """`[1, 1, n, n]` causal mask of a chunk over its own keys, windowed when `window`."""
    q = torch.arange(n, device=device)[:, None]
    k = torch.arange(n, device=device)[None, :]
    mask = k <= q
    if window is not None:
        mask &= k > q - window
    return mask[None, None]


# Explicit attention materialises [B, H, block, S] logits: queries go in blocks of this many.
BLOCK = 256


def softcapped_attention(
    q: torch.Tensor,  # [B, H, Q, D]
    k: torch.Tensor,  # [B, KVH, S, D]
    v: torch.Tensor,
    mask: torch.Tensor,  # [B, 1, Q, S] bool, True = attend
    scale: float | None,
    softcap: float,
) -> torch.Tensor:
    """Attention whose logits are soft-capped before the mask and the softmax (float32 softmax,
    as transformers' eager attention for Gemma 2)."""
    heads, kvh = q.shape[1], k.shape[1]
    if heads != kvh:
        k = k.repeat_interleave(heads // kvh, dim=1)
        v = v.repeat_interleave(heads // kvh, dim=1)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    kt = k.transpose(-1, -2)
    for lo in range(0, q.shape[2], BLOCK):
        hi = min(q.shape[2], lo + BLOCK)
        logits = (q[:, :, lo:hi] @ kt) * scale
        logits = torch.tanh(logits / softcap) * softcap
        logits = logits.masked_fill(~mask[:, :, lo:hi], float("-inf"))
        weights = logits.float().softmax(dim=-1).to(q.dtype)
        out[:, :, lo:hi] = weights @ v
    return out
