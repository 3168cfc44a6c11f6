"""Batched LoRA equals each adapter merged into the weights: base rows and rows of two adapters
(different ranks and targets) in one forward, through plain and packed linears."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.lora.adapter import Adapter, BaseShape
from services.lora.layers import LoRASlots, lora_tokens
from services.models import packed

CONFIG = LlamaConfig(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def random_adapter(rank: int, targets: tuple[str, ...], seed: int) -> Adapter:
    g = torch.Generator().manual_seed(seed)
    dims = BaseShape.of(CONFIG).dims
    weights = {}
    for layer in range(CONFIG.num_hidden_layers):
        for module in targets:
            d_in, d_out = dims[module]
            a = torch.randn(rank, d_in, generator=g) * 0.2
            b = torch.randn(d_out, rank, generator=g) * 0.2
            weights[(layer, module)] = (a, b)
    return Adapter(rank, 16 / rank, targets, weights)


def merged(model: torch.nn.Module, adapter: Adapter) -> torch.nn.Module:
    out = copy.deepcopy(model)
    with torch.no_grad():
        for (layer, module), (a, b) in adapter.weights.items():
            block = out.model.layers[layer]
            linear = getattr(
                block.self_attn if hasattr(block.self_attn, module) else block.mlp, module
            )
            linear.weight += adapter.scale * (b @ a)
    return out


@pytest.mark.parametrize(("pack", "stacked"), [(False, True), (True, True), (False, False)])
def test_mixed_rows_equal_the_merged_models(pack, stacked):
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG).eval()
    first = random_adapter(4, ("q_proj", "v_proj", "down_proj"), seed=1)
    second = random_adapter(8, ("k_proj", "o_proj", "gate_proj", "up_proj"), seed=2)
    references = [model, merged(model, first), merged(model, second)]
    ids = torch.randint(0, CONFIG.vocab_size, (3, 7))
    with torch.inference_mode():
        want = torch.cat([ref(input_ids=ids[i : i + 1]).logits for i, ref in enumerate(references)])
    if pack and not packed.pack_linears(model):
        pytest.skip("oneDNN packing unavailable here")
    slots = LoRASlots(model, max_loras=3, max_rank=8, stacked=stacked)
    slots.load(0, first)
    slots.load(2, second)
    per_token = torch.tensor([-1, 0, 2]).repeat_interleave(7)  # row 0 base, 1 first, 2 second
    with torch.inference_mode(), packed.packed_products(), lora_tokens(per_token):
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with torch.inference_mode():  # outside the block: the base model, untouched
        torch.testing.assert_close(model(input_ids=ids[:1]).logits, want[:1], rtol=1e-4, atol=1e-4)


def test_a_base_only_step_and_a_cleared_slot_change_nothing():
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG).eval()
    ids = torch.randint(0, CONFIG.vocab_size, (1, 5))
    with torch.inference_mode():
        want = model(input_ids=ids).logits
    slots = LoRASlots(model, max_loras=2, max_rank=8)
    slots.load(1, random_adapter(8, ("q_proj",), seed=3))
    with torch.inference_mode(), lora_tokens(torch.full((5,), -1)):
        torch.testing.assert_close(model(input_ids=ids).logits, want)
    slots.clear(1)
    with torch.inference_mode(), lora_tokens(torch.full((5,), 1)):
        torch.testing.assert_close(model(input_ids=ids).logits, want)
    with pytest.raises(ValueError, match="max_lora_rank"):
        slots.load(0, random_adapter(16, ("q_proj",), seed=4))
