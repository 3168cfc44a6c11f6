"""Every KV policy on the real model: exactness at a budget covering the context, mixed batches,
the memory bound, admission under a small pool, long streams and refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvcache.pages import pages_needed
from services import LLM, KVPolicy, SamplingParams
from services.engine.engine import LLMEngine

PROMPT = (
    "The lighthouse keeper wrote in his log every evening. On Monday the sea was calm and grey. "
    "On Tuesday a storm came from the north and the boats stayed in the harbour. On Wednesday "
    "the keeper repaired the lamp and painted the door blue. On Thursday a ship passed at noon. "
    "The secret word is marigold. On Friday the keeper's sister visited with bread and apples. "
    "Question: what colour did the keeper paint the door? Answer:"
)
PS = 16

POLICIES = {
    "window": KVPolicy(kind="window", budget_tokens=48),
    "sinks": KVPolicy(kind="sinks", budget_tokens=48),
    "sinks_rerotate": KVPolicy(kind="sinks", budget_tokens=48, rerotate=True),
    "h2o": KVPolicy(kind="h2o", budget_tokens=48),
    "snapkv": KVPolicy(kind="snapkv", budget_tokens=48),
    "quest": KVPolicy(kind="quest", budget_tokens=48, dense_layers=2),
    "quest_union": KVPolicy(kind="quest", budget_tokens=48, quest_heads="union"),
}


@pytest.fixture(scope="module")
def llm(loaded_model) -> LLM:
    return LLM(loaded=loaded_model, kv_cache_memory=64 << 20, grammar_workers=0)


def greedy(max_tokens: int = 12, kv: KVPolicy | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, kv=kv)


def test_every_policy_with_a_budget_covering_the_context_equals_full(llm):
    n = len(llm.engine.tokenize(PROMPT)) + 12
    roomy = {name: replace(p, budget_tokens=n + PS) for name, p in POLICIES.items()}
    full = llm.generate(PROMPT, greedy())[0].token_ids
    outs = llm.generate([PROMPT] * len(roomy), [greedy(kv=p) for p in roomy.values()])
    for name, out in zip(roomy, outs, strict=True):
        assert out.token_ids == full, name


def test_a_batch_mixing_policies_equals_each_run_alone(llm):
    names = list(POLICIES)
    params = [greedy(16, POLICIES[n]) for n in names] + [greedy(16)]
    together = llm.generate([PROMPT] * len(params), params)
    for name, p, out in zip([*names, "full"], params, together, strict=True):
        alone = llm.generate(PROMPT, p)[0]
        assert out.token_ids == alone.token_ids, name
    # a budget below the context changes what attention reads: the policies are really in play
    assert len({tuple(o.token_ids) for o in together}) > 1


@pytest.mark.parametrize("name", [n for n, p in POLICIES.items() if p.bounded])
def test_bounded_policies_hold_at_most_budget_plus_one_page(llm, name):
    engine: LLMEngine = llm.engine
    policy = POLICIES[name]
    req = engine.add_request(PROMPT, greedy(40, policy))
    bound = pages_needed(policy.budget, PS) + 1
    held, evicted = [], 0
    while not req.finished:
        engine.step()
        if req.num_computed_tokens >= req.num_prompt_tokens or name != "snapkv":
            held.append(len(req.pages))  # snapkv caches the whole prompt until it has voted
        evicted = max(evicted, req.kv_state.evicted if req.kv_state else 0)
    engine.release(req.request_id)
    assert max(held) <= bound, held
    assert evicted > 0  # the prompt alone is longer than the budget
    assert engine.runner.kv.allocator.num_used == 0


def test_rerotation_keeps_positions_inside_the_cache(llm):
    engine: LLMEngine = llm.engine
    req = engine.add_request(PROMPT, greedy(40, POLICIES["sinks_rerotate"]))
    while not req.finished:
        engine.step()
        state = req.kv_state
        assert state is not None and state.position(req.num_computed_tokens) <= 48 + PS
    engine.release(req.request_id)


def test_bounded_policies_fit_more_long_requests_in_a_small_pool(loaded_model):
    layout_bytes = 2 * 30 * 3 * 64 * 4 * PS  # SmolLM2 fp32: bytes of one page
    # no prefix caching: the four dense requests would share their prompt's pages
    small = LLM(
        loaded=loaded_model,
        kv_cache_memory=40 * layout_bytes,
        grammar_workers=0,
        enable_prefix_caching=False,
    )
    engine = small.engine
    assert engine.runner.kv.num_pages == 40

    def peak_running(kv: KVPolicy | None) -> tuple[int, int]:
        before = engine.scheduler.num_preemptions
        reqs = [engine.add_request(PROMPT * 2, greedy(24, kv)) for _ in range(4)]
        peak = 0
        while engine.has_unfinished():
            engine.step()
            peak = max(peak, len(engine.scheduler.running))
        assert all(r.finish_reason == "length" for r in reqs)
        for r in reqs:
            engine.release(r.request_id)
        return peak, engine.scheduler.num_preemptions - before

    full_peak, _ = peak_running(None)
    window_peak, window_preemptions = peak_running(KVPolicy(kind="window", budget_tokens=64))
    assert full_peak < 4
    assert window_peak == 4 and window_preemptions == 0
    # a prompt longer than the whole pool: refused dense, streamed through a bounded policy
    longer = PROMPT * 8
    assert len(engine.tokenize(longer)) > engine.pool_tokens
    dense = small.generate(longer, greedy(24))[0]
    assert dense.finish_reason == "error"
    streamed = small.generate(longer, greedy(24, POLICIES["sinks_rerotate"]))[0]
    assert streamed.finish_reason == "length" and len(streamed.token_ids) == 24


def test_rerotating_streams_may_run_past_the_trained_context(llm):
    engine: LLMEngine = llm.engine
    past = engine.model_len + 100
    ok = engine.add_request(PROMPT, greedy(past, POLICIES["sinks_rerotate"]))
    assert ok.error_status is None
    engine.abort(ok.request_id)
    engine.release(ok.request_id)
    refused = engine.add_request(PROMPT, greedy(past, POLICIES["window"]))
    assert refused.error_status == 400 and "max_tokens" in refused.warnings[0]
    engine.release(refused.request_id)


@pytest.mark.parametrize(
    ("policy", "field"),
    [
        (KVPolicy(kind="quest", page_size=32), "kv.page_size"),
        (KVPolicy(kind="quest", offload=True), "kv.offload"),
        (KVPolicy(kind="window", budget_tokens=1 << 22), "kv.budget_tokens"),
    ],
)
def test_policies_the_engine_cannot_serve_are_refused_with_the_field(llm, policy, field):
    out = llm.generate(PROMPT, greedy(kv=policy))[0]
    assert out.finish_reason == "error" and out.warnings[0].startswith(field)


def test_prompt_logprobs_match_the_reference_model_through_chunked_prefill(loaded_model):
    import torch

    chunked = LLM(loaded=loaded_model, max_num_batched_tokens=40, grammar_workers=0)
    ids = chunked.engine.tokenize(PROMPT)
    out = chunked.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=True))[0]
    model = loaded_model.model
    model.set_attn_implementation("sdpa")  # the engine switches it back on its next step
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids) - 1
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs), expected, atol=2e-3, rtol=0)


@pytest.fixture(scope="module")
def small(loaded_model) -> LLM:
    """16 pages (256 tokens): a growing dense request takes the pages of a later one."""
    page_bytes = 2 * 30 * 3 * 64 * 4 * PS  # SmolLM2 in float32
    return LLM(loaded=loaded_model, kv_cache_memory=16 * page_bytes, grammar_workers=0)


@pytest.fixture(scope="module")
def hog(llm) -> tuple[list[int], list[int]]:
    """A dense request of 10 pages growing to 15, and the tokens it makes alone."""
    words = llm.engine.tokenize(" one two three four five six seven eight nine ten")
    ids = (words * 20)[:150]
    return ids, llm.generate(ids, greedy(80))[0].token_ids


@pytest.mark.parametrize("name", list(POLICIES))
def test_a_preempted_request_recomputes_to_the_tokens_it_makes_alone(llm, small, hog, name):
    engine: LLMEngine = small.engine
    before = engine.scheduler.num_preemptions
    # admitted second, the policy's request is the one preempted when the hog needs a page
    outs = small.generate([hog[0], PROMPT], [greedy(80), greedy(60, POLICIES[name])])
    assert engine.scheduler.num_preemptions > before
    assert outs[1].token_ids == llm.generate(PROMPT, greedy(60, POLICIES[name]))[0].token_ids
    assert outs[0].token_ids == hog[1]
    assert engine.runner.kv.allocator.num_used == 0
