"""Decoder families on the engine, equal to transformers token for token.

Each family is a small random-weight model (tests/families.py) with sliding windows shorter than
the prompts where the family has them. The reference is transformers' own `generate` with its
eager attention, one prompt at a time; the engine runs the prompts together, with small prefill
chunks and a pool small enough to preempt. Then a constrained request on each, and the families
the paged attention cannot serve are refused at load, naming what is missing.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from services import LLM, SamplingParams, StructuredOutput
from services.models import load_model
from tests.families import REFUSED, WINDOW, build, configs

NEW_TOKENS = 48
FAMILIES = sorted(configs())


@pytest.fixture(scope="module")
def tokenizer_dir(loaded_model):
    return loaded_model.path


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("families")
    return {f: build(f, root / f, tokenizer_dir) for f in FAMILIES}


@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = [
        "The history of the Roman Empire spans many centuries and " * 5,
        "def fibonacci(n):\n    if n < 2:\n        return n\n" * 2,
        "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, " * 3,
    ]
    out = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert min(len(p) for p in out) > WINDOW  # the windows slide
    return out


def reference(folder, prompts) -> list[list[int]]:
    loaded = load_model(folder, attn_implementation="eager")
    config = copy.deepcopy(loaded.model.generation_config)
    config.eos_token_id, config.do_sample, config.max_new_tokens = [], False, NEW_TOKENS
    config.pad_token_id = 0  # one prompt at a time: never used, but generate wants one
    refs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = loaded.model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=config
            )
            refs.append(out[0, len(p) :].tolist())
    return refs


def pool_bytes(folder, pages: int, page_size: int = 16) -> int:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(folder)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4  # fp32 K and V
    return pages * page_size * per_token


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers(family, folders, prompts):
    refs = reference(folders[family], prompts)
    # chunks of 16 prompt tokens; a pool of 14 pages for 3 requests of up to 9: preemptions
    llm = LLM(
        str(folders[family]),
        max_num_batched_tokens=16,
        kv_cache_memory=pool_bytes(folders[family], 14),
    )
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert list(out.token_ids) == ref, f"{family}: prompt {i}"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_constrained_request_parses(family, folders):
    llm = LLM(str(folders[family]), kv_cache_memory=8 << 20)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    params = SamplingParams(max_tokens=32, structured=StructuredOutput(json_schema=schema))
    out = llm.generate(["A number:"], params)[0]
    assert out.finish_reason == "stop"
    assert 0 <= json.loads(out.text)["n"] <= 9


def test_kv_policies_are_refused_on_a_model_with_windows(folders):
    from services.engine.params import KVPolicy

    llm = LLM(str(folders["mistral"]), kv_cache_memory=8 << 20)
    params = SamplingParams(max_tokens=4, kv=KVPolicy(kind="window", budget_tokens=64))
    out = llm.generate(["Hello there"], params)[0]
    assert out.finish_reason == "error" and "sliding windows" in " ".join(out.warnings)


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_a_family_the_paged_attention_cannot_serve_is_refused_at_load(
    family, tmp_path, tokenizer_dir
):
    folder = build(family, tmp_path / family, tokenizer_dir)
    with pytest.raises(ValueError, match=REFUSED[family][2]):
        LLM(str(folder), kv_cache_memory=4 << 20)
