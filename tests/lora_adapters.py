"""PEFT-shaped LoRA adapter folders for tests (`adapter_config.json` + safetensors)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from services.lora.adapter import ATTENTION, BaseShape


def write_peft(
    folder: Path,
    config: Any,
    rank: int,
    targets: tuple[str, ...],
    *,
    layers: tuple[int, ...] | None = None,
    seed: int = 0,
    b_scale: float = 0.05,
    alpha: int | None = None,
    extra_config: dict[str, Any] | None = None,
    extra_tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """A folder of random A [r, in] (unit-variance products) and B [out, r] * `b_scale` for each
    of `layers` (default: every layer of the model `config` describes) and target module."""
    g = torch.Generator().manual_seed(seed)
    dims = BaseShape.of(config).dims
    tensors = {}
    for layer in range(config.num_hidden_layers) if layers is None else layers:
        for module in targets:
            d_in, d_out = dims[module]
            kind = "self_attn" if module in ATTENTION else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) / d_in**0.5
            tensors[f"{stem}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * b_scale
    tensors |= extra_tensors or {}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    peft = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha or rank}
    peft |= {"target_modules": list(targets)} | (extra_config or {})
    (folder / "adapter_config.json").write_text(json.dumps(peft))
    return folder
