"""Quest with the host tier on the real model: the same tokens as all-resident, contexts larger
than the device pool, bounded device pages, full host store, tenant caps and cancellation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvcache.pages import pages_needed
from services import LLM, KVPolicy, SamplingParams
from services.engine.engine import LLMEngine
from services.engine.kv_offload import RECENT_PAGES

PS = 16
PAGE_BYTES = 2 * 30 * 3 * 64 * 4 * PS  # SmolLM2 in float32: keys and values of one page
TEXT = (
    "The lighthouse keeper wrote in his log every evening. On Monday the sea was calm and grey. "
    "On Tuesday a storm came from the north. The secret word is marigold. On Wednesday the "
    "keeper painted the door blue and repaired the lamp. "
)


def prompt(llm: LLM, tokens: int) -> list[int]:
    ids = llm.engine.tokenize(TEXT)
    question = llm.engine.tokenize(" What is the secret word? The secret word is")
    body = (ids * (tokens // len(ids) + 1))[: tokens - len(question)]
    return body + question


def greedy(kv: KVPolicy | None, max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, kv=kv)


@pytest.fixture(scope="module")
def tiered(loaded_model) -> LLM:
    """A 40-page (640-token) device pool with a 200-page host tier."""
    return LLM(
        loaded=loaded_model,
        kv_cache_memory=40 * PAGE_BYTES,
        kv_tier_pages=200,
        kv_tier_tenant_pages=120,
        grammar_workers=0,
    )


@pytest.fixture(scope="module")
def roomy(loaded_model) -> LLM:
    return LLM(loaded=loaded_model, kv_cache_memory=256 * PAGE_BYTES, grammar_workers=0)


def small_tiered(loaded_model, **flags) -> LLM:
    """A fresh engine like `tiered` (40 device pages, 200 host pages) with engine `flags`."""
    return LLM(
        loaded=loaded_model,
        kv_cache_memory=40 * PAGE_BYTES,
        kv_tier_pages=200,
        grammar_workers=0,
        **flags,
    )


def empty(llm: LLM) -> bool:
    tier = llm.engine.kv_tier
    return llm.engine.runner.kv.allocator.num_used == 0 and (tier is None or tier.pages_in_use == 0)


@pytest.mark.parametrize("tokens", [200, 480])
@pytest.mark.parametrize("budget", [32, 64])
def test_offloaded_quest_equals_all_resident_quest(tiered, roomy, tokens, budget):
    ids = prompt(tiered, tokens)
    resident = roomy.generate(ids, greedy(KVPolicy(kind="quest", budget_tokens=budget)))[0]
    # every parked selection read from the host each step; one way per layer and head (evicting
    # every step); the default (the budget's pages)
    hot_sizes = (0, 1, None)
    params = [
        greedy(KVPolicy(kind="quest", budget_tokens=budget, offload=True, hot_pages=h))
        for h in hot_sizes
    ]
    outs = tiered.generate([ids] * len(params), params)
    for out in outs:
        assert out.finish_reason == "length", out.warnings
        assert out.token_ids == resident.token_ids
    assert empty(tiered)


def test_quest_bounds_per_half_page_keep_offloaded_equal_to_resident(loaded_model):
    """`quest_bound_tokens=8`: two bounds per page, copied with the page when it is parked and
    rebuilt for the pages a prompt finds in the prefix cache."""
    half = dict(loaded=loaded_model, grammar_workers=0, quest_bound_tokens=8)
    roomy = LLM(kv_cache_memory=256 * PAGE_BYTES, **half)
    tiered = LLM(kv_cache_memory=40 * PAGE_BYTES, kv_tier_pages=200, **half)
    assert roomy.engine.runner.kv.bound_splits == 2
    ids = prompt(roomy, 480)
    quest = KVPolicy(kind="quest", budget_tokens=32)
    resident = roomy.generate(ids, greedy(quest))[0]
    again = roomy.generate(ids, greedy(quest))[0]
    assert again.metrics.num_cached_tokens > 0 and again.token_ids == resident.token_ids
    for hot in (0, None):
        off = tiered.generate(ids, greedy(replace(quest, offload=True, hot_pages=hot)))[0]
        assert off.finish_reason == "length", off.warnings
        assert off.token_ids == resident.token_ids
    assert empty(tiered)


def test_a_context_larger_than_the_device_pool_runs_only_with_the_tier(tiered, roomy):
    ids = prompt(tiered, 1200)  # the device pool holds 640 tokens
    assert len(ids) > tiered.engine.runner.kv.num_pages * PS
    parked_before = tiered.engine.kv_tier.pages_parked
    without = tiered.generate(ids, greedy(KVPolicy(kind="quest", budget_tokens=64)))[0]
    assert without.finish_reason == "error" and without.warnings[0].startswith("max_tokens")
    quest = KVPolicy(kind="quest", budget_tokens=64, offload=True)
    out = tiered.generate(ids, greedy(quest))[0]
    resident = roomy.generate(ids, greedy(KVPolicy(kind="quest", budget_tokens=64)))[0]
    assert out.token_ids == resident.token_ids
    assert tiered.engine.kv_tier.pages_parked - parked_before >= 1200 // PS - 40
    assert empty(tiered)


def test_device_pages_stay_within_sinks_recent_and_hot_set(tiered):
    engine: LLMEngine = tiered.engine
    hot = 3
    policy = KVPolicy(kind="quest", budget_tokens=64, offload=True, hot_pages=hot)
    req = engine.add_request(prompt(tiered, 900), greedy(policy, 24))
    most = 0
    while not req.finished:
        engine.step()
        if req.num_computed_tokens > req.num_prompt_tokens:  # decoding
            most = max(most, engine.offload.device_pages(req))
    engine.release(req.request_id)
    # the sink page, the recent pages, the hot set, and a fresh page for the next token
    assert most <= 1 + RECENT_PAGES + hot + 1
    tier = engine.kv_tier
    assert tier.hit_rate is not None and tier.pages_recalled > 0
    assert tier.read_latency_ms(50) is not None
    assert empty(tiered)


def test_a_tenant_over_its_host_cap_is_refused_at_admission_and_others_run(tiered):
    engine: LLMEngine = tiered.engine
    quest = KVPolicy(kind="quest", budget_tokens=64, offload=True)
    big = engine.add_request(prompt(tiered, 1500), greedy(quest, 500), tenant="acme")
    other = engine.add_request(prompt(tiered, 300), greedy(quest), tenant="globex")
    assert big.finished and big.error_status == 429
    assert big.warnings[0].startswith("kv.offload:") and "acme" in big.warnings[0]
    while not other.finished:
        engine.step()
    assert other.finish_reason == "length"
    for r in (big, other):
        engine.release(r.request_id)
    assert empty(tiered)


def test_a_full_host_store_refuses_new_requests_and_corrupts_nothing(tiered, roomy):
    engine: LLMEngine = tiered.engine
    quest = KVPolicy(kind="quest", budget_tokens=64, offload=True)
    ids = prompt(tiered, 1000)
    holders = [engine.add_request(ids, greedy(quest), tenant=f"t{i}") for i in range(3)]
    refused = engine.add_request(ids, greedy(quest), tenant="t9")
    assert [h.error_status for h in holders] == [None, None, None]
    assert refused.error_status == 429 and "capacity" in refused.warnings[0]
    while engine.has_unfinished():
        engine.step()
    resident = roomy.generate(ids, greedy(KVPolicy(kind="quest", budget_tokens=64)))[0]
    for h in holders:
        assert h.output_token_ids == resident.token_ids
        engine.release(h.request_id)
    engine.release(refused.request_id)
    assert empty(tiered)


def test_cancelling_mid_decode_frees_every_page_on_both_tiers(tiered):
    engine: LLMEngine = tiered.engine
    quest = KVPolicy(kind="quest", budget_tokens=32, offload=True)
    req = engine.add_request(prompt(tiered, 800), greedy(quest, 50))
    while req.num_output_tokens < 5:
        engine.step()
    assert engine.kv_tier.owner_pages(("default", req.request_id)) > 0
    engine.abort(req.request_id)
    engine.release(req.request_id)
    assert empty(tiered)
    assert pages_needed(800, PS) > engine.runner.kv.num_pages // 2  # it really was parked


def test_offload_needs_a_host_tier(roomy):
    out = roomy.generate("hello", greedy(KVPolicy(kind="quest", offload=True)))[0]
    assert out.finish_reason == "error" and out.warnings[0].startswith("kv.offload")


def test_the_hot_set_serves_repeated_selections_from_the_device(tiered):
    engine: LLMEngine = tiered.engine
    ids = prompt(tiered, 700)
    tier = engine.kv_tier
    misses, tokens = [], []
    for hot in (0, 4):
        before = tier.misses
        quest = KVPolicy(kind="quest", budget_tokens=64, offload=True, hot_pages=hot)
        tokens.append(tiered.generate(ids, greedy(quest, 16))[0].token_ids)
        misses.append(tier.misses - before)
    # the same selections (same tokens); without a hot set every parked one is read from the host
    assert tokens[0] == tokens[1]
    assert 0 < misses[1] < misses[0] / 2
    assert empty(tiered)


def test_hot_sets_give_their_pages_back_before_anyone_is_preempted(tiered, roomy):
    engine: LLMEngine = tiered.engine
    quest = KVPolicy(kind="quest", budget_tokens=96, offload=True, hot_pages=20)
    ids = prompt(tiered, 600)
    before = engine.scheduler.num_preemptions
    # three hot sets of 20 pages would take more than the 40-page pool: they shrink instead
    outs = tiered.generate([ids] * 3, [greedy(quest, 40)] * 3)
    assert engine.scheduler.num_preemptions == before
    resident = roomy.generate(ids, greedy(KVPolicy(kind="quest", budget_tokens=96), 40))[0]
    assert all(o.token_ids == resident.token_ids for o in outs)
    assert empty(tiered)


def test_preempted_offloaded_requests_recompute_to_the_same_tokens(tiered, roomy):
    engine: LLMEngine = tiered.engine
    quest = KVPolicy(kind="quest", budget_tokens=96, offload=True, hot_pages=20)
    ids, long = prompt(tiered, 600), prompt(tiered, 420)
    before = engine.scheduler.num_preemptions
    # a dense request's pages cannot be parked: as it grows, an offloaded request is preempted
    # (a salt of its own: mapping the others' cached prefix would spare the pages it must hold)
    params = [greedy(quest, 40), greedy(quest, 40), replace(greedy(None, 60), cache_salt="own")]
    outs = tiered.generate([ids, ids, long], params)
    assert engine.scheduler.num_preemptions > before
    resident = roomy.generate(ids, greedy(KVPolicy(kind="quest", budget_tokens=96), 40))[0]
    dense = roomy.generate(long, greedy(None, 60))[0]
    assert [o.token_ids for o in outs] == [resident.token_ids] * 2 + [dense.token_ids]
    assert empty(tiered)


def test_dense_layers_read_parked_pages_in_place_as_the_gather_does(loaded_model, roomy):
    """On CPU the kernel reads the dense layers' parked pages from the host tier's arena where
    they lie; its plain twin (`inplace_attention=False`) copies them out and runs SDPA. Both
    give the all-resident tokens and count the same cells read from the tier."""
    ids = prompt(roomy, 480)
    quest = KVPolicy(kind="quest", budget_tokens=32, dense_layers=3)
    resident = roomy.generate(ids, greedy(quest))[0]
    cells = {}
    for in_place in (True, False):
        llm = small_tiered(loaded_model, inplace_attention=in_place)
        assert (llm.engine.runner.kv.kernel is not None) == in_place
        out = llm.generate(ids, greedy(replace(quest, offload=True)))[0]
        assert out.finish_reason == "length", out.warnings
        assert out.token_ids == resident.token_ids
        tier = llm.engine.kv_tier
        assert tier is not None and tier.cells_recalled > 0
        cells[in_place] = tier.cells_recalled
        assert empty(llm)
    assert cells[True] == cells[False]


def test_the_native_hot_set_routes_as_its_plain_twin(loaded_model, roomy):
    """`native_hot_set=False` routes in Python (dicts), True in C: both give the all-resident
    tokens with the same hits, misses and cells read, a hot set of one way (misses not kept)
    and of the budget's pages."""
    ids = prompt(roomy, 480)
    quest = KVPolicy(kind="quest", budget_tokens=32)
    resident = roomy.generate(ids, greedy(quest))[0]
    counts = {}
    for native in (True, False):
        llm = small_tiered(loaded_model, native_hot_set=native)
        assert (llm.engine.offload is not None) and (
            llm.engine.offload.router is not None
        ) == native
        params = [greedy(replace(quest, offload=True, hot_pages=h)) for h in (1, None)]
        for out in llm.generate([ids, ids], params):
            assert out.finish_reason == "length", out.warnings
            assert out.token_ids == resident.token_ids
        tier = llm.engine.kv_tier
        assert tier is not None and tier.misses > 0 and tier.hits > 0
        counts[native] = (tier.hits, tier.misses, tier.cells_recalled)
        assert empty(llm)
    assert counts[True] == counts[False]
