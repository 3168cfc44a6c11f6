"""Batched LoRA: tokens of different adapters and of the base model in one forward.

The idea of Punica and S-LoRA: the base weights are shared, each adapter's low-rank pair (A, B)
sits in a slot, and every target linear adds, for each group of tokens that uses one adapter,
`(x @ A.T) @ B.T * scale` to what the base weight gave. The base product keeps whatever path it
has (plain or packed, services/models/packed.py): the delta is added to its output.

Slots are preallocated per target module at `max_rank`, so loading an adapter is a copy, never an
allocation mid-serving; an adapter of a smaller rank uses the first `rank` rows of its slot, and a
module it does not target stays zero (and is skipped). The step says which tokens use which slot
with `lora_tokens(...)`; outside that block, or in a step of base tokens only, a linear computes
exactly as it would without adapters.

Two ways to add the deltas. Stacked (the default): every slot's A in one matrix, so each target
costs two products and a mask whatever the number of adapters in the step: `x @ A_all.T`
`[T, slots * max_rank]`, zeroed outside each token's own slot, then `@ B_all` (the extra columns
cost little next to the base product while `slots * max_rank` is small against the layer's width).
Grouped (the plain twin, `EngineConfig.lora_stacked=False`): a loop over the step's adapter
groups, each gathering its tokens. A step whose tokens all use one adapter takes that adapter's
pair directly either way. A segmented-GEMM kernel is the CUDA path's next step.
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from services.lora.adapter import TARGETS, Adapter, BaseShape

_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(TARGETS) + r")$")


@dataclass
class _Groups:
    """One step's adapter groups: (slot, the flat indices of its tokens); `slots` per token."""

    groups: list[tuple[int, torch.Tensor]]
    slots: torch.Tensor
    whole: bool  # one group, every token: no gather, no mask
    _masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def mask(self, n_slots: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """`[T, n_slots * rank]`: 1 where a column belongs to the token's own slot (built once a
        step, shared by every target)."""
        key = (n_slots, rank, dtype)
        if key not in self._masks:
            owner = torch.arange(n_slots, device=self.slots.device).repeat_interleave(rank)
            self._masks[key] = (self.slots[:, None] == owner[None, :]).to(dtype)
        return self._masks[key]


_STEP: contextvars.ContextVar[_Groups | None] = contextvars.ContextVar(
    "structserve_lora_tokens", default=None
)


@contextmanager
def lora_tokens(slots: torch.Tensor) -> Iterator[None]:
    """Inside this block, token `i` of the forward (flattened over batch and position) uses
    adapter slot `slots[i]`; -1 is the base model. A step of base tokens only changes nothing."""
    present = torch.unique(slots).tolist()
    groups = [(int(s), torch.nonzero(slots == s).flatten()) for s in present if s >= 0]
    whole = len(present) == 1 and len(groups) == 1
    token = _STEP.set(_Groups(groups, slots, whole) if groups else None)
    try:
        yield
    finally:
        _STEP.reset(token)


class _Target:
    """One linear's slots, both sides laid out for `x @ A^T @ B^T` with no transpose at run time:
    A^T [in, slots, max_rank], B^T [slots, max_rank, out] (scale folded in), each slot's pair in
    its first `rank` columns / rows."""

    def __init__(self, linear: torch.nn.Linear, slots: int, max_rank: int, stacked: bool) -> None:
        w = linear.weight
        self.at = torch.zeros(linear.in_features, slots, max_rank, device=w.device, dtype=w.dtype)
        self.bt = torch.zeros(slots, max_rank, linear.out_features, device=w.device, dtype=w.dtype)
        self.rank = [0] * slots  # 0: this slot's adapter does not target this module
        self.stacked = stacked

    def delta(self, x: torch.Tensor, out: torch.Tensor, groups: _Groups) -> torch.Tensor:
        if not any(self.rank[slot] for slot, _ in groups.groups):
            return out  # no adapter in this step targets this module
        flat = x.reshape(-1, x.shape[-1])
        base = out.reshape(-1, out.shape[-1])
        if groups.whole:
            slot = groups.groups[0][0]
            r = self.rank[slot]
            summed = torch.addmm(base, flat @ self.at[:, slot, :r], self.bt[slot, :r])
        elif self.stacked:
            width, n, rank = self.at.shape
            xa = flat @ self.at.view(width, n * rank)
            xa.mul_(groups.mask(n, rank, xa.dtype))
            summed = torch.addmm(base, xa, self.bt.view(n * rank, -1))  # the add in the product
        else:
            summed = base + self._grouped(flat, out, groups)
        return summed.view(out.shape)

    def _grouped(self, flat: torch.Tensor, out: torch.Tensor, groups: _Groups) -> torch.Tensor:
        extra = torch.zeros(flat.shape[0], out.shape[-1], device=out.device, dtype=flat.dtype)
        for slot, idx in groups.groups:
            r = self.rank[slot]
            if r:
                rows = flat.index_select(0, idx)
                extra.index_add_(0, idx, (rows @ self.at[:, slot, :r]) @ self.bt[slot, :r])
        return extra


class LoRASlots:
    """`max_loras` adapter slots on `model`'s target projections (every q/k/v/o and MLP linear
    its names show), wrapped once; `load` puts a checked adapter in a slot."""

    def __init__(
        self, model: torch.nn.Module, max_loras: int, max_rank: int, stacked: bool = True
    ) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.targets: dict[tuple[int, str], _Target] = {}
        for name, module in model.named_modules():
            m = _NAME.search(name)
            if m is None or not isinstance(module, torch.nn.Linear):
                continue
            target = _Target(module, max_loras, max_rank, stacked)
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
            target.at[:, slot, :r].copy_(a.T)
            target.bt[slot, :r].copy_((b * adapter.scale).T)
            target.rank[slot] = r

    @torch.inference_mode()
    def clear(self, slot: int) -> None:
        for target in self.targets.values():
            if target.rank[slot]:
                target.at[:, slot].zero_()
                target.bt[slot].zero_()
                target.rank[slot] = 0


def _with_delta(
    base: Callable[[torch.Tensor], torch.Tensor], target: _Target
) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        out = base(x)
        groups = _STEP.get()
        return out if groups is None else target.delta(x, out, groups)

    return forward
