"""The engine's LoRA against PEFT itself: adapters made and saved by `peft` (ranks 4 to 64,
different target modules and alphas, B not zero), on random-weight Llama and Qwen2 models and on
SmolLM2; greedy rows of the base model and three adapters in one batch, fewer slots than
adapters, with and without prefix caching, with preemption; each row equal to
`PeftModel.generate` with its adapter (or the base model's `generate`)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services import LLM, LoRARequest, SamplingParams
from services.models.loader import resolve_model_dir
from tests.families import build

peft = pytest.importorskip("peft")

NEW = 20
TEXTS = ["The capital of France is", "List three colours:", "Once upon a time, there", "1, 2, 3,"]
ADAPTERS = {  # name -> (rank, alpha, targets)
    "r4": (4, 8, ("q_proj", "v_proj")),
    "r16": (16, 16, ("o_proj", "gate_proj", "down_proj")),
    "r64": (64, 32, ("k_proj", "up_proj", "q_proj")),
}
PLAN = [None, "r4", "r16", "r64", "r4", None, "r16", "r64"]


def adapters(base, root, seed):
    """Each adapter made by PEFT (random B: not the zero start of a fresh fine-tune) and saved
    as PEFT saves it; returns name -> (folder, the PeftModel)."""
    out = {}
    for i, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed + i)
        config = peft.LoraConfig(
            r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
            init_lora_weights=False,
        )  # fmt: skip
        model = peft.get_peft_model(copy.deepcopy(base), config).eval()
        with torch.no_grad():  # PEFT's random B is small: make the adapters change the text
            for module in model.modules():
                if hasattr(module, "lora_B") and "default" in module.lora_B:
                    module.lora_B["default"].weight.mul_(20)
        model.save_pretrained(root / name)
        out[name] = (root / name, model)
    return out


def reference(model, prompts):
    """Greedy tokens up to and including EOS, as `generate` stops."""
    eos = model.generation_config.eos_token_id
    rows = []
    for ids in prompts:
        mask = torch.ones(1, len(ids), dtype=torch.long)
        with torch.no_grad():
            got = model.generate(
                input_ids=torch.tensor([ids]), attention_mask=mask, max_new_tokens=NEW,
                do_sample=False, pad_token_id=eos,
            )[0, len(ids) :].tolist()  # fmt: skip
        rows.append(got)
    return rows


def check(folder, made, prompts, **engine):
    refs = {None: reference(made["base"][1], prompts)}
    refs |= {n: reference(m, prompts) for n, (_, m) in made.items() if n != "base"}
    assert all(refs[n] != refs[None] for n in ADAPTERS)  # each adapter changes the text
    llm = LLM(str(folder), enable_lora=True, max_loras=2, max_lora_rank=64, **engine)
    lora = {n: LoRARequest(n, str(f)) for n, (f, _) in made.items() if n != "base"}
    rows = [prompts[i % len(prompts)] for i in range(len(PLAN))]
    outs = llm.generate(
        rows, SamplingParams(max_tokens=NEW, temperature=0), [lora.get(n) for n in PLAN]
    )  # type: ignore[arg-type]
    for i, (name, out) in enumerate(zip(PLAN, outs, strict=True)):
        want = refs[name][i % len(prompts)]
        assert list(out.token_ids)[: len(want)] == want, (name, i)
    return llm


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_random_weight_families_equal_peft(family, tmp_path):
    tokenizer_dir = resolve_model_dir(None)[1]
    folder = build(family, tmp_path / family, tokenizer_dir, seed=3)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    made = {"base": (folder, base), **adapters(base, tmp_path, seed=11)}
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [tok(t).input_ids for t in TEXTS]
    # ~768 bytes of KV a token: 5 pages of 16 hold two or three of the rows at full length
    small = check(folder, made, prompts, kv_cache_memory=5 * 16 * 768)
    assert small.engine.scheduler.num_preemptions > 0
    check(folder, made, prompts, kv_cache_memory=64 << 20, enable_prefix_caching=False)


def test_smollm2_equals_peft(tmp_path):
    folder = resolve_model_dir(None)[1]
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    made = {"base": (folder, base), **adapters(base, tmp_path, seed=21)}
    tok = AutoTokenizer.from_pretrained(folder)
    check(folder, made, [tok(t).input_ids for t in TEXTS[:2]], kv_cache_memory=64 << 20)
