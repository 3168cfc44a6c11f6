"""Batched LoRA: tokens of different adapters and of the base model in one forward.

The idea of Punica and S-LoRA: the base weights are shared, each adapter's low-rank pair (A, B)
sits in a slot, and every target linear adds, for each group of tokens that uses one adapter,
`(x @ A.T) @ B.T * scale` to what the base weight gave. The base product keeps whatever path it
has (plain or packed, services/models/packed.py): the delta is added to its output.

Slots are preallocated per target module at `max_rank`, so loading an adapter is a copy, never an
allocation mid-serving; an adapter of a smaller rank uses the first `rank` rows of its slot, and a
module it does not target stays zero (and is skipped). The step says which tokens use which slot
with `lora_tokens(...)`; outside that block, or in a step of base tokens only, a linear computes
exactly as it would without adapters. On CPU the groups are a loop (few adapters per step); a
segmented-GEMM kernel is the CUDA path's next step.
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from services.lora.adapter import TARGETS, Adapter, BaseShape

_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(TARGETS) + r")$")


@dataclass(frozen=True)
class _Groups:
    """One step's adapter groups: (slot, the flat indices of its tokens)."""

    groups: list[tuple[int, torch.Tensor]]


_STEP: contextvars.ContextVar[_Groups | None] = contextvars.ContextVar(
    "structserve_lora_tokens", default=None
)


@contextmanager
def lora_tokens(slots: torch.Tensor) -> Iterator[None]:
    """Inside this block, token `i` of the forward (flattened over batch and position) uses
    adapter slot `slots[i]`; -1 is the base model. A step of base tokens only changes nothing."""
    groups = [
        (int(s), torch.nonzero(slots == s).flatten())
        for s in torch.unique(slots).tolist()
        if s >= 0
    ]
    token = _STEP.set(_Groups(groups) if groups else None)
    try:
        yield
    finally:
        _STEP.reset(token)


def active() -> bool:
    """Whether the forward running now has adapter tokens (a fused path that bypasses the
    linears must not take this step)."""
    return _STEP.get() is not None


class _Target:
    """One linear's slots: A [slots, max_rank, in], B [slots, out, max_rank] (scale folded in)."""

    def __init__(self, linear: torch.nn.Linear, slots: int, max_rank: int) -> None:
        w = linear.weight
        self.a = torch.zeros(slots, max_rank, linear.in_features, device=w.device, dtype=w.dtype)
        self.b = torch.zeros(slots, linear.out_features, max_rank, device=w.device, dtype=w.dtype)
        self.rank = [0] * slots  # 0: this slot's adapter does not target this module

    def delta(self, x: torch.Tensor, out: torch.Tensor, groups: _Groups) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        extra = None
        for slot, idx in groups.groups:
            r = self.rank[slot]
            if r == 0:
                continue
            rows = flat.index_select(0, idx)
            d = (rows @ self.a[slot, :r].T) @ self.b[slot, :, :r].T
            if extra is None:
                extra = torch.zeros(flat.shape[0], out.shape[-1], device=out.device, dtype=d.dtype)
            extra.index_add_(0, idx, d)
        return out if extra is None else out + extra.view(out.shape).to(out.dtype)


class LoRASlots:
    """`max_loras` adapter slots on `model`'s target projections (every q/k/v/o and MLP linear
    its names show), wrapped once; `load` puts a checked adapter in a slot."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.targets: dict[tuple[int, str], _Target] = {}
        for name, module in model.named_modules():
            m = _NAME.search(name)
            if m is None or not isinstance(module, torch.nn.Linear):
                continue
            target = _Target(module, max_loras, max_rank)
            self.targets[(int(m[1]), m[2])] = target
            module.forward = _with_delta(module.forward, target)  # type: ignore[method-assign,assignment]
        if not self.targets:
            raise ValueError("the model has no q/k/v/o or MLP projections an adapter can target")
        self.shape = BaseShape.of(model.config)

    @torch.inference_mode()
    def load(self, slot: int, adapter: Adapter) -> None:
        """Copies `adapter` into `slot` (its modules; every other module's slot is zeroed)."""
        if not 0 <= slot < self.max_loras:
            raise IndexError(f"slot {slot} of {self.max_loras}")
        if adapter.rank > self.max_rank:
            raise ValueError(f"rank {adapter.rank} is above max_lora_rank {self.max_rank}")
        self.clear(slot)
        for key, (a, b) in adapter.weights.items():
            target = self.targets[key]
            r = adapter.rank
            target.a[slot, :r].copy_(a)
            target.b[slot, :, :r].copy_(b * adapter.scale)
            target.rank[slot] = r

    @torch.inference_mode()
    def clear(self, slot: int) -> None:
        for target in self.targets.values():
            if target.rank[slot]:
                target.a[slot].zero_()
                target.b[slot].zero_()
                target.rank[slot] = 0


def _with_delta(
    base: Callable[[torch.Tensor], torch.Tensor], target: _Target
) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        out = base(x)
        groups = _STEP.get()
        return out if groups is None else target.delta(x, out, groups)

    return forward
