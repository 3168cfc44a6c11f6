"""LoRA in the engine: rows of the base model and of several adapters in one batch give the
tokens of each adapter merged into the weights (what PEFT's merge gives), with slots too few
for every adapter at once, speculation on, and no prefix-cache hit across adapters."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from services import LLM, LoRARequest, SamplingParams
from services.models import load_model
from tests.lora_adapters import write_peft

PROMPTS = [
    "The capital of France is",
    "List three colours:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The capital of France is",
]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def write_adapter(folder: Path, config, rank: int, targets: tuple[str, ...], seed: int) -> Path:
    """Weights large enough to change the greedy text."""
    return write_peft(folder, config, rank, targets, seed=seed)


def merged_llm(base, folder: Path) -> LLM:
    from safetensors.torch import load_file

    loaded = copy.deepcopy(base)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            module = loaded.model.get_submodule(
                name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            )
            module.weight += b @ a  # lora_alpha == r: scale 1
    return LLM(loaded=loaded, kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = load_model(None)
    root = tmp_path_factory.mktemp("adapters")
    first = write_adapter(
        root / "first", base.model.config, 8, ("q_proj", "v_proj", "down_proj"), 1
    )
    second = write_adapter(root / "second", base.model.config, 16, ("o_proj", "up_proj"), 2)
    want = {None: LLM(loaded=copy.deepcopy(base), kv_cache_memory=64 << 20)}
    want |= {"first": merged_llm(base, first), "second": merged_llm(base, second)}
    refs = {k: [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] for k, llm in want.items()}
    assert refs["first"] != refs[None] and refs["second"] != refs[None]  # the adapters matter
    return base, {"first": first, "second": second}, refs


@pytest.mark.parametrize(
    "engine",
    [
        {"max_loras": 2},
        {"max_loras": 1, "enable_prefix_caching": False},  # adapters take turns in one slot
        {"max_loras": 2, "speculative": {"method": "ngram", "num_speculative_tokens": 4}},
        {"max_loras": 2, "lora_stacked": False},  # the grouped twin: the same tokens
    ],
)
def test_mixed_batches_equal_the_merged_adapters(setup, engine):
    base, folders, refs = setup
    llm = LLM(
        loaded=copy.deepcopy(base), kv_cache_memory=64 << 20, enable_lora=True,
        max_lora_rank=16, **engine,
    )  # fmt: skip
    lora = {k: LoRARequest(k, str(v)) for k, v in folders.items()}
    plan = [None, "first", "second", "first", "second", None, "first", None]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(plan))]
    outs = llm.generate(prompts, GREEDY, [lora[k] if k else None for k in plan])
    for i, (name, out) in enumerate(zip(plan, outs, strict=True)):
        assert out.token_ids == refs[name][i % len(PROMPTS)], (name, i)
    if engine["max_loras"] == 1 and not engine.get("enable_prefix_caching", True):
        # every adapter load was charged to the tenant, beyond the positions it computed
        positions = sum(len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in outs)
        sched = llm.engine.scheduler
        assert llm.engine.adapters.loads >= 2 and sched.num_preemptions == 0
        assert sched.shares.vtime("default") > positions


def test_no_prefix_hit_across_adapters_or_their_weights(setup):
    base, folders, refs = setup
    llm = LLM(loaded=copy.deepcopy(base), kv_cache_memory=64 << 20, enable_lora=True)
    long = PROMPTS[2]
    (plain,) = llm.generate(long, GREEDY)
    (again,) = llm.generate(long, GREEDY)
    assert again.metrics.num_cached_tokens > 0  # the cache works for the base model
    (tuned,) = llm.generate(long, GREEDY, LoRARequest("first", str(folders["first"])))
    assert tuned.metrics.num_cached_tokens == 0
    assert tuned.token_ids == refs["first"][2] and plain.token_ids == refs[None][2]
    # the same name on other weights: read again, and never given the old weights' pages
    (swapped,) = llm.generate(long, GREEDY, LoRARequest("first", str(folders["second"])))
    assert swapped.metrics.num_cached_tokens == 0 and swapped.token_ids == refs["second"][2]


def test_a_bad_adapter_is_refused_beside_a_victim(setup, tmp_path):
    base, folders, refs = setup
    llm = LLM(loaded=copy.deepcopy(base), kv_cache_memory=64 << 20, enable_lora=True)
    bad = write_adapter(tmp_path / "wide", base.model.config, 32, ("q_proj",), 3)
    outs = llm.generate(PROMPTS[:2], GREEDY, [LoRARequest("wide", str(bad)), None])
    assert outs[0].finish_reason == "error" and "max_lora_rank" in outs[0].warnings[0]
    assert outs[1].token_ids == refs[None][1]
    plain = LLM(loaded=copy.deepcopy(base), kv_cache_memory=64 << 20)
    (out,) = plain.generate(PROMPTS[0], GREEDY, LoRARequest("first", str(folders["first"])))
    assert out.finish_reason == "error" and "enable_lora" in out.warnings[0]
