"""A tenant's adapter folder is hostile input: each way it can be wrong is refused by name,
before anything reads more than its header; a good one comes back with its weights."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from services.lora.adapter import (
    AdapterError,
    BaseShape,
    Limits,
    inspect_adapter,
    resolve,
)
from tests.lora_adapters import write_peft

# SmolLM2-135M's shapes: 576 hidden, 9 heads of 64, 3 KV heads, 1536 MLP, 30 layers
SMOL = SimpleNamespace(
    hidden_size=576,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    num_hidden_layers=30,
)
BASE = BaseShape.of(SMOL)
LIMITS = Limits(max_rank=16, max_bytes=4 << 20)


def write(folder: Path, rank: int = 4, targets=("q_proj", "v_proj"), layers=(0, 1), **over):
    return write_peft(
        folder, SMOL, rank, targets, layers=layers, alpha=2 * rank,
        extra_config=over.get("config"), extra_tensors=over.get("tensors"),
    )  # fmt: skip


def refused(folder: Path, field: str, words: str) -> None:
    with pytest.raises(AdapterError) as err:
        inspect_adapter(folder, BASE, LIMITS)
    assert err.value.field == field and words in str(err.value), str(err.value)


def test_a_good_adapter_comes_back_with_its_weights_and_scale(tmp_path):
    got = inspect_adapter(write(tmp_path / "a", rank=8), BASE, LIMITS)
    assert got.rank == 8 and got.scale == 2.0 and got.targets == ("q_proj", "v_proj")
    a, b = got.weights[(1, "v_proj")]
    assert a.shape == (8, 576) and b.shape == (192, 8)
    assert set(got.weights) == {(0, "q_proj"), (0, "v_proj"), (1, "q_proj"), (1, "v_proj")}


def test_paths_out_of_the_store_are_refused(tmp_path):
    store = tmp_path / "store"
    write(store / "mine")
    write(tmp_path / "outside")
    assert resolve(store, "mine") == (store / "mine").resolve()
    (store / "link").symlink_to(tmp_path / "outside")
    for source in ("../outside", "/etc", "link", "mine/../../outside", "", "missing"):
        with pytest.raises(AdapterError) as err:
            resolve(store, source)
        assert err.value.field == "source"
    os.symlink(tmp_path / "outside" / "adapter_model.safetensors", store / "w")
    bad = write(store / "linked")
    (bad / "adapter_model.safetensors").unlink()
    (bad / "adapter_model.safetensors").symlink_to(
        tmp_path / "outside" / "adapter_model.safetensors"
    )
    refused(bad, "adapter_model.safetensors", "not a link")


def test_missing_files_rank_and_targets_are_named(tmp_path):
    gone = write(tmp_path / "gone")
    (gone / "adapter_config.json").unlink()
    refused(gone, "adapter_config.json", "missing")
    refused(write(tmp_path / "rank", rank=32), "adapter_config.r", "above max_lora_rank 16")
    wrong = write(tmp_path / "t", config={"target_modules": ["q_proj", "lm_head"]})
    refused(wrong, "adapter_config.target_modules", "lm_head")
    refused(write(tmp_path / "dora", config={"use_dora": True}), "adapter_config", "DoRA")


def test_shapes_that_do_not_fit_the_base_model_are_refused(tmp_path):
    odd = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 512)}
    refused(write(tmp_path / "shape", tensors=odd), "adapter_model.safetensors", "needs [4, 576]")
    deep = write(tmp_path / "deep", layers=(0, 30))
    refused(deep, "adapter_model.safetensors", "30 layers")
    stray = {"lm_head.weight": torch.zeros(2, 2)}
    refused(write(tmp_path / "stray", tensors=stray), "adapter_model.safetensors", "not a LoRA")


def test_nan_or_inf_weights_are_refused(tmp_path):
    nan = torch.zeros(192, 4)
    nan[3, 1] = float("nan")
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    refused(write(tmp_path / "nan", tensors={key: nan}), "adapter_model.safetensors", "NaN or Inf")


def test_a_huge_or_lying_file_costs_a_stat_not_a_read(tmp_path):
    big = write(tmp_path / "big")
    with (big / "adapter_model.safetensors").open("r+b") as f:
        f.truncate(10 << 30)  # a sparse 10 GB file: refused by its size alone
    refused(big, "adapter_model.safetensors", "over the")
    liar = write(tmp_path / "liar")
    (liar / "adapter_model.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    refused(liar, "adapter_model.safetensors", "header is longer")
    junk = write(tmp_path / "junk")
    (junk / "adapter_config.json").write_text("{not json")
    refused(junk, "adapter_config.json", "not JSON")
