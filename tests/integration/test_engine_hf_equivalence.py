"""Greedy tokens of the engine equal Hugging Face `generate`, token for token.

The reference runs one prompt at a time with the model's own SDPA attention and a dynamic cache,
EOS ignored (`eos_token_id=[]`; None would fall back to the model's), as `ignore_eos=True` does.
"""

from __future__ import annotations

import copy

import pytest
import torch

from services import LLM, SamplingParams
from services.models import eos_token_ids

NEW_TOKENS = 64
PS = 16


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    chats = [
        "What is the capital of France?",
        "Write a short poem about autumn leaves.",
        "Explain what a hash table is to a child, in detail, with an example.",
    ]
    texts = [
        "def quicksort(arr):",
        "The history of the Roman Empire spans many centuries. " * 6,
        "1, 2, 3, 4, 5,",
        "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, " * 3,
        "Dear diary,",
    ]
    out = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True
        )
        for c in chats
    ]
    out = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in out]
    out += [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert len({len(p) for p in out}) >= 6  # different lengths
    return out


@pytest.fixture(scope="module")
def hf_tokens(loaded_model, prompts) -> list[list[int]]:
    model = loaded_model.model
    model.set_attn_implementation("sdpa")
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = []
    config.do_sample = False
    config.max_new_tokens = NEW_TOKENS
    refs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            refs.append(out[0, len(p) :].tolist())
    return refs


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def run(loaded_model, prompts, **engine_kwargs):
    engine_kwargs.setdefault("kv_cache_memory", 64 << 20)
    llm = LLM(loaded=loaded_model, **engine_kwargs)
    outs = llm.generate(prompts, GREEDY)
    assert all(o.finish_reason == "length" for o in outs)
    assert llm.engine.runner.kv.allocator.num_used == 0  # every page came back
    return llm, [o.token_ids for o in outs]


def test_greedy_equals_hf_generate(loaded_model, prompts, hf_tokens):
    llm, tokens = run(loaded_model, prompts)
    assert llm.engine.scheduler.num_preemptions == 0
    for i, (ours, ref) in enumerate(zip(tokens, hf_tokens, strict=True)):
        assert len(ours) == NEW_TOKENS
        assert ours == ref, f"prompt {i}: ours {ours} != hf {ref}"


def test_greedy_equals_hf_generate_with_preemption(loaded_model, prompts, hf_tokens):
    # room for about two of the eight requests at full length: the rest wait or are preempted
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    pages = 2 * (-(-longest // PS)) + 2
    bytes_per_page = loaded_model.model.config.num_hidden_layers * 2 * 3 * 64 * 4 * PS
    llm, tokens = run(loaded_model, prompts, kv_cache_memory=pages * bytes_per_page)
    assert llm.engine.runner.kv.num_pages == pages
    assert llm.engine.scheduler.num_preemptions > 0
    assert tokens == hf_tokens


def test_chunked_prefill_equals_unchunked(loaded_model, prompts, hf_tokens):
    # the default run above is the unchunked twin: a 2048-token budget never splits these prompts
    _, chunked = run(loaded_model, prompts, max_num_batched_tokens=48)
    assert max(len(p) for p in prompts) > 48  # so the long prompts really are split
    assert chunked == hf_tokens


def test_repetition_penalty_and_min_tokens_equal_hf_generate(loaded_model, prompts):
    """HF's RepetitionPenaltyLogitsProcessor (prompt and output tokens) and min_new_tokens, in
    one batch of the engine beside rows without them; EOS stays possible after min_tokens."""
    model = loaded_model.model
    model.set_attn_implementation("sdpa")
    config = copy.deepcopy(model.generation_config)
    config.do_sample, config.max_new_tokens = False, 24
    config.repetition_penalty, config.min_new_tokens = 1.3, 6
    config.eos_token_id = sorted(
        eos_token_ids(model.generation_config, model.config, loaded_model.tokenizer)
    )
    refs = []
    with torch.inference_mode():
        for p in prompts[:4]:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            refs.append(out[0, len(p) :].tolist())  # batch of one: ends at its EOS, no padding
    penalized = SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3, min_tokens=6)
    plain = SamplingParams(max_tokens=24, temperature=0.0)
    llm = LLM(loaded=loaded_model, kv_cache_memory=64 << 20)
    outs = llm.generate(prompts[:4] + prompts[:2], [penalized] * 4 + [plain] * 2)
    for i, (out, ref) in enumerate(zip(outs[:4], refs, strict=True)):
        assert out.token_ids == ref and len(out.token_ids) >= 6, i
    assert [o.token_ids for o in outs[4:]] == [
        o.token_ids for o in llm.generate(prompts[:2], plain)
    ]


@pytest.mark.parametrize(
    "twin",
    [{"packed_weights": False}, {"inplace_attention": False}, {"fused_forward": False}],
    ids=["plain-linears", "gathered-attention", "transformers-forward"],
)
def test_the_plain_twins_of_the_fast_paths_equal_hf_generate(
    loaded_model, prompts, hf_tokens, twin
):
    """The default run above has packed weights, in-place attention and the fused forward (on
    CPU); each plain twin gives the same tokens, with preemption in play."""
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    pages = 2 * (-(-longest // PS)) + 2
    bytes_per_page = loaded_model.model.config.num_hidden_layers * 2 * 3 * 64 * 4 * PS
    llm, tokens = run(loaded_model, prompts, kv_cache_memory=pages * bytes_per_page, **twin)
    assert llm.engine.scheduler.num_preemptions > 0
    assert (llm.engine.runner.kv.kernel is None) == (twin.get("inplace_attention") is False)
    assert llm.engine.runner.packed == twin.get("packed_weights", True)
    assert (llm.engine.runner.fused is None) == (twin.get("fused_forward") is False)
    assert tokens == hf_tokens
