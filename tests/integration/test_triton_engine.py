"""The engine on SmolLM2 with the GPU's attention kernel (kvcache/triton_attention.py, run here by
Triton's interpreter) gives the greedy tokens of the plain path (pages gathered, then SDPA): a
decode row reading every page and a Quest row reading its chosen pages in place, in float32 and
in bfloat16. The interpreter takes ~10 ms a program (a row's KV head in a layer), so the runs
are short; tests/unit/test_triton_attention.py covers every variant on random pages."""

from __future__ import annotations

import pytest

from services import LLM, KVPolicy, SamplingParams
from services.models import load_model

pytest.importorskip("kvcache.triton_attention")

STORY = (
    "The lighthouse keeper wrote in his log every evening. On Monday the sea was calm. On "
    "Tuesday a storm came from the north. The secret word is marigold. Question: what is the "
    "secret word? Answer:"
)


def run(loaded_model, dtype: str, **runner) -> list[list[int]]:  # type: ignore[no-untyped-def]
    # an engine prepares the model it is given for its dtype: bfloat16 runs get their own copy
    loaded = loaded_model if dtype == "float32" else load_model()
    llm = LLM(loaded=loaded, dtype=dtype, kv_cache_memory=32 << 20, grammar_workers=0, **runner)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    quest = SamplingParams(
        max_tokens=4,
        temperature=0.0,
        ignore_eos=True,
        kv=KVPolicy(kind="quest", budget_tokens=32, dense_layers=2),
    )
    outs = llm.generate([STORY, STORY], [greedy, quest])
    assert all(o.finish_reason == "length" for o in outs), [o.warnings for o in outs]
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_kernel_gives_the_gather_paths_greedy_tokens(loaded_model, dtype):
    plain = run(loaded_model, dtype, inplace_attention=False)
    kernel = run(loaded_model, dtype, attention_kernel="triton")
    assert kernel == plain
