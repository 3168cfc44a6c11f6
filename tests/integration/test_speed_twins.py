"""The engine's fast paths against their plain twins on the real model: packed linear weights
(`packed_weights`), attention reading pages in place (`inplace_attention`) and the lean forward
with fused steps (`fused_forward`) give the same greedy tokens as `F.linear`, gather-then-SDPA
and transformers' forward, for constrained rows of every grammar kind and for every KV policy,
in one mixed batch. (Unconstrained rows with preemption are compared with
transformers' `generate` in test_engine_hf_equivalence.py.)"""

from __future__ import annotations

import pytest

from services import LLM, KVPolicy, SamplingParams, StructuredOutput
from services.models import fused

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
CONSTRAINED = [
    ("Describe a person as JSON.", StructuredOutput(json_schema=PERSON)),
    ("Give me a phone number.", StructuredOutput(regex=r"\d{3}-\d{3}-\d{4}")),
    ("Pick a color.", StructuredOutput(choice=["red", "green", "blue"])),
    ("Yes or no?", StructuredOutput(grammar='root ::= "yes" | "no"')),
]
STORY = (
    "The lighthouse keeper wrote in his log every evening. On Monday the sea was calm. On "
    "Tuesday a storm came from the north. The secret word is marigold. Question: what is the "
    "secret word? Answer:"
)
POLICIES = [
    KVPolicy(kind="window", budget_tokens=32),
    KVPolicy(kind="sinks", budget_tokens=32),
    KVPolicy(kind="h2o", budget_tokens=32),
    KVPolicy(kind="snapkv", budget_tokens=32),
    KVPolicy(kind="quest", budget_tokens=32, dense_layers=2),
]


def batch(llm: LLM) -> tuple[list, list[SamplingParams]]:
    chat = llm.engine.apply_chat_template
    prompts: list = [chat([{"role": "user", "content": q}]) for q, _ in CONSTRAINED]
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured=s) for _, s in CONSTRAINED]
    prompts += [STORY] * (len(POLICIES) + 1)
    params += [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, kv=p) for p in POLICIES
    ]
    params.append(SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    return prompts, params


@pytest.fixture(scope="module")
def fast(loaded_model) -> list[list[int]]:
    llm = LLM(loaded=loaded_model, kv_cache_memory=64 << 20, grammar_workers=0)
    runner = llm.engine.runner
    assert runner.packed and runner.kv.kernel is not None
    assert runner.fused is not None and isinstance(runner.fused.steps, fused.CSteps)
    outs = llm.generate(*batch(llm))
    assert all(o.finish_reason in ("stop", "length") for o in outs), [o.warnings for o in outs]
    return [o.token_ids for o in outs]


@pytest.mark.parametrize(
    "twin",
    [{"packed_weights": False}, {"inplace_attention": False}, {"fused_forward": False}],
    ids=["plain-linears", "gathered-attention", "transformers-forward"],
)
def test_constrained_rows_and_every_kv_policy_equal_the_plain_twin(loaded_model, fast, twin):
    llm = LLM(loaded=loaded_model, kv_cache_memory=64 << 20, grammar_workers=0, **twin)
    assert [o.token_ids for o in llm.generate(*batch(llm))] == fast


@pytest.fixture(scope="module")
def bf16_model():
    """The real model again, for bfloat16 engines (an engine prepares its model for its dtype)."""
    from services.models import load_model

    return load_model()


@pytest.mark.parametrize(
    "twin",
    [{"inplace_attention": False}, {"fused_forward": False}],
    ids=["gathered-attention", "transformers-forward"],
)
def test_bfloat16_fast_paths_equal_their_plain_twins(bf16_model, twin):
    """In bfloat16 the C attention reads bf16 pages and the fused steps round as transformers'
    bf16 modules do: the same greedy tokens as gather-then-SDPA and transformers' forward for
    the constrained rows, the plain row and the policies that keep by position (window, sinks).
    H2O and SnapKV evict by summed attention weights and Quest picks pages by key bounds, near
    ties in bfloat16: another summation order picks another token or page (the two plain twins
    part there against each other too), so those rows are left out."""
    kw = {"loaded": bf16_model, "dtype": "bfloat16", "kv_cache_memory": 32 << 20}
    fast = LLM(**kw, grammar_workers=0)
    runner = fast.engine.runner
    assert runner.kv.kernel is not None and runner.fused is not None
    assert isinstance(runner.fused.steps, fused.CSteps)
    plain = LLM(**kw, grammar_workers=0, **twin)
    prompts, params = batch(fast)
    kept = [i for i, p in enumerate(params) if p.kv is None or p.kv.kind in ("window", "sinks")]
    assert len(kept) == len(params) - 3
    outs = [[o.token_ids for o in llm.generate(prompts, params)] for llm in (fast, plain)]
    assert [outs[0][i] for i in kept] == [outs[1][i] for i in kept]


def _near_tie_or_equal(a: list, b: list, gap: float) -> bool:
    """Two greedy outputs (with top-2 logprobs) equal, or parting first where the twin's two
    best tokens were within `gap` of each other and the other side took the runner-up: a near
    tie rounded the other way, not a wrong product."""
    for x, y in zip(a, b, strict=True):
        if x.token_id != y.token_id:
            best = dict(y.top)
            return x.token_id in best and y.logprob - best[x.token_id] <= gap
    return True


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_and_two_row_products_equal_onednns(loaded_model, bf16_model, dtype, monkeypatch):
    """A request decoding alone, then two together: products of one and two rows go through
    small_products.c (`small_products`) and give oneDNN's greedy tokens (the twin). In bfloat16
    each product's output is rounded to 8 bits of mantissa after sums in another order, so a
    near tie may part the two; the first parting must be one: within two of bfloat16's steps of
    a logit below 32 (0.125 each)."""
    from services.models import packed

    calls = [0]
    into = packed.SmallProducts.into

    def counted(self, *args):
        calls[0] += 1
        return into(self, *args)

    monkeypatch.setattr(packed.SmallProducts, "into", counted)
    model = loaded_model if dtype == "float32" else bf16_model
    kw = {"loaded": model, "dtype": dtype, "kv_cache_memory": 32 << 20, "grammar_workers": 0}
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    chat = [{"role": "user", "content": "Name three rivers."}]
    outs = []
    for small in (True, False):
        llm = LLM(**kw, speculative=None, small_products=small)
        assert llm.engine.runner.small_products == small
        prompts = [STORY, llm.engine.apply_chat_template(chat)]
        outs.append([llm.generate(prompts[:1], greedy)[0], *llm.generate(prompts, greedy)])
        if small:
            assert calls[0] > 0
            calls[0] = 0
    assert calls[0] == 0  # the twin never took them
    for a, b in zip(*outs, strict=True):
        if dtype == "float32":
            assert a.token_ids == b.token_ids
        else:
            assert _near_tie_or_equal(a.logprobs, b.logprobs, gap=0.25)
