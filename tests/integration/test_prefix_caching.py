"""Prefix caching on the real model: the same greedy tokens as the plain twin
(`enable_prefix_caching=False`) for shared prefixes of every length modulo the page, structured
requests, preempted requests, every KV policy and offloaded Quest; and no hit across tenants or
cache salts."""

from __future__ import annotations

import pytest

from services import LLM, KVPolicy, SamplingParams, StructuredOutput

PS = 16
PAGE_BYTES = 2 * 30 * 3 * 64 * 4 * PS  # SmolLM2 in float32: keys and values of one page
TEXT = (
    "The lighthouse keeper wrote in his log every evening. On Monday the sea was calm and grey. "
    "On Tuesday a storm came from the north and the boats stayed in the harbour. On Wednesday "
    "the keeper repaired the lamp and painted the door blue. The secret word is marigold. "
)


@pytest.fixture(scope="module")
def cached(loaded_model) -> LLM:
    return LLM(loaded=loaded_model, kv_cache_memory=256 * PAGE_BYTES, grammar_workers=0)


@pytest.fixture(scope="module")
def plain(loaded_model) -> LLM:
    return LLM(
        loaded=loaded_model,
        kv_cache_memory=256 * PAGE_BYTES,
        grammar_workers=0,
        enable_prefix_caching=False,
    )


def ids(llm: LLM, tag: str, tokens: int) -> list[int]:
    """`tokens` token ids of text starting with `tag` (each test its own prefix chain)."""
    body = llm.engine.tokenize(f"[{tag}] " + TEXT * (tokens // 40 + 1))
    return body[:tokens]


def greedy(max_tokens: int = 6, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def question(llm: LLM, i: int) -> list[int]:
    return llm.engine.tokenize(f" Question {i}: what colour was the door? Answer:")


def test_shared_prefixes_of_every_length_modulo_the_page(cached, plain):
    base = ids(cached, "modulo", 3 * PS + PS)
    lengths = [3 * PS + r for r in range(PS)]
    warm = [base[:n] + question(cached, 0) for n in lengths]
    cached.generate(warm, greedy(2))
    prompts = [base[:n] + question(cached, 1) for n in lengths]
    outs = cached.generate(prompts, greedy())
    twins = plain.generate(prompts, greedy())
    for n, prompt, out, twin in zip(lengths, prompts, outs, twins, strict=True):
        assert out.token_ids == twin.token_ids, n
        shared = max(common(prompt, w) for w in warm)  # n and the questions' common start
        assert out.metrics.num_cached_tokens == min(shared, len(prompt) - 1) // PS * PS, n
        assert twin.metrics.num_cached_tokens == 0


def common(a: list[int], b: list[int]) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def test_a_whole_prompt_in_the_cache_still_computes_its_last_token(cached, plain):
    prompt = ids(cached, "whole", 4 * PS)
    first = cached.generate(prompt, greedy())[0]
    again = cached.generate(prompt, greedy())[0]
    assert again.metrics.num_cached_tokens == 3 * PS
    assert again.token_ids == first.token_ids == plain.generate(prompt, greedy())[0].token_ids


def test_structured_requests_with_a_shared_prefix(cached, plain):
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string"}, "day": {"type": "string"}},
        "required": ["colour", "day"],
    }
    prefix = ids(cached, "structured", 5 * PS)
    prompts = [prefix + question(cached, i) for i in range(3)]
    p = greedy(24, structured=StructuredOutput(json_schema=schema))
    cached.generate(prompts[0], p)
    outs, twins = cached.generate(prompts[1:], p), plain.generate(prompts[1:], p)
    for out, twin in zip(outs, twins, strict=True):
        assert out.token_ids == twin.token_ids and out.metrics.num_cached_tokens == 5 * PS


def test_preempted_requests_recompute_to_the_same_tokens(loaded_model, plain):
    small = LLM(loaded=loaded_model, kv_cache_memory=14 * PAGE_BYTES, grammar_workers=0)
    prefix = ids(small, "preempt", 3 * PS)
    prompts = [prefix + question(small, i) for i in range(5)]
    outs = small.generate(prompts, greedy(64))
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, greedy(64))]
    alloc = small.engine.runner.kv.allocator
    assert alloc.num_free == alloc.num_pages  # every page free or evictable
    assert alloc.num_evictable == alloc.num_cached > 0


POLICIES = {
    "full": None,
    "quest": KVPolicy(kind="quest", budget_tokens=48, dense_layers=2),
    "window": KVPolicy(kind="window", budget_tokens=48),
    "sinks": KVPolicy(kind="sinks", budget_tokens=48, rerotate=True),
    "h2o": KVPolicy(kind="h2o", budget_tokens=48),
    "snapkv": KVPolicy(kind="snapkv", budget_tokens=48),
}
SHARES = {"full", "quest"}  # the others rewrite their pages when they compact: they opt out


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_kv_policy_gives_the_same_tokens(cached, plain, name):
    prefix = ids(cached, f"policy-{name}", 6 * PS)
    cached.generate(prefix + question(cached, 0), greedy(2))  # a dense request caches it
    prompt = prefix + question(cached, 1)
    p = greedy(12, kv=POLICIES[name])
    out = cached.generate(prompt, p)[0]
    assert out.token_ids == plain.generate(prompt, p)[0].token_ids
    assert out.metrics.num_cached_tokens == (6 * PS if name in SHARES else 0)
    # and what the policy request left is safe for a dense one to map
    after = cached.generate(prompt, greedy(12))[0]
    assert after.token_ids == plain.generate(prompt, greedy(12))[0].token_ids


def test_offloaded_quest_feeds_the_cache_and_maps_nothing(loaded_model):
    def tiered(caching: bool) -> LLM:
        return LLM(
            loaded=loaded_model,
            kv_cache_memory=40 * PAGE_BYTES,
            kv_tier_pages=120,
            grammar_workers=0,
            enable_prefix_caching=caching,
        )

    on, off = tiered(True), tiered(False)
    prefix = ids(on, "offload", 20 * PS)
    quest = KVPolicy(kind="quest", budget_tokens=64, offload=True)
    prompts = [prefix + question(on, i) for i in range(3)]
    # one at a time: the tenant's share of the tier holds two such requests
    expected = [off.generate(p, greedy(10, kv=quest))[0].token_ids for p in prompts]
    first = on.generate(prompts[0], greedy(10, kv=quest))[0]  # parks its cold pages
    dense = on.generate(prompts[1], greedy(10))[0]  # maps what it offered before parking
    again = on.generate(prompts[2], greedy(10, kv=quest))[0]
    assert [first.token_ids, again.token_ids] == [expected[0], expected[2]]
    assert dense.token_ids == off.generate(prompts[1], greedy(10))[0].token_ids
    assert dense.metrics.num_cached_tokens > 0
    # mapped pages would all be resident: an offloaded request computes its prompt
    assert again.metrics.num_cached_tokens == 0
    tier = on.engine.kv_tier
    assert tier is not None and tier.pages_in_use == 0
    assert on.engine.runner.kv.allocator.num_free == on.engine.runner.kv.num_pages


def test_no_hit_across_tenants_or_cache_salts(cached):
    engine = cached.engine
    prompt = ids(cached, "tenants", 4 * PS) + question(cached, 0)

    def cached_tokens(tenant: str, salt: str | None = None) -> int:
        req = engine.add_request(prompt, greedy(2, cache_salt=salt), tenant=tenant)
        while not req.done:
            engine.step()
        engine.release(req.request_id)
        return req.metrics.num_cached_tokens

    assert cached_tokens("a") == 0
    assert cached_tokens("a") == 4 * PS  # the same tenant hits
    assert cached_tokens("b") == 0  # another tenant computes its own
    assert cached_tokens("a", "mine") == 0 and cached_tokens("a", "mine") == 4 * PS
    assert cached_tokens("a", "yours") == 0
    prefix = engine.scheduler.prefix
    assert prefix is not None and prefix.hit["b"] == 0 and prefix.hit["a"] == 8 * PS
