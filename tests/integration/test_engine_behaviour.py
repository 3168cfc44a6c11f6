"""Sampling, stopping, refusals, memory and streaming on the real model."""

from __future__ import annotations

import asyncio

import pytest

from services import LLM, SamplingParams
from services.engine.async_llm import AsyncLLM

PROMPT = "Once upon a time in a small village,"


@pytest.fixture(scope="module")
def llm(loaded_model) -> LLM:
    return LLM(loaded=loaded_model, kv_cache_memory=64 << 20)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    sp = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    first = llm.generate(PROMPT, sp)[0].token_ids
    again = llm.generate(PROMPT, sp)[0].token_ids
    others = SamplingParams(max_tokens=24, temperature=1.0, seed=None)
    in_batch = llm.generate(["Hello there", PROMPT, "The weather today"], [others, sp, others])
    assert first == again == in_batch[1].token_ids
    other_seed = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=1.0, seed=99))[0]
    assert other_seed.token_ids != first


def test_max_tokens_ends_with_length(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 7


def test_stop_string_ends_with_stop_and_is_cut(llm):
    free = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    words = free.text.split()
    stop = words[len(words) // 2]
    cut = free.text.index(stop)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[:cut]
    assert len(out.token_ids) < len(free.token_ids)


def test_stop_token_id_ends_with_stop(llm):
    free = llm.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    target = free.token_ids[5]
    first = free.token_ids.index(target)
    sp = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[target])
    out = llm.generate(PROMPT, sp)[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]


def test_eos_ends_a_chat_answer_with_stop(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=100, temperature=0),
    )[0]
    assert out.finish_reason == "stop"
    assert "Paris" in out.text
    assert out.token_ids[-1] in llm.engine.eos_token_ids
    assert "<|im_end|>" not in out.text


def test_a_refused_request_does_not_fail_the_batch(llm):
    ok = SamplingParams(max_tokens=5, temperature=0)
    too_long = SamplingParams(max_tokens=10**6)
    outs = llm.generate([PROMPT, PROMPT, [10**9]], [ok, too_long, ok])
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 5
    assert outs[1].finish_reason == "error" and "max_tokens" in outs[1].warnings[0]
    assert outs[2].finish_reason == "error" and "vocabulary" in outs[2].warnings[0]


def test_string_and_token_prompts_agree(llm):
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ids = llm.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert llm.generate(PROMPT, sp)[0].token_ids == llm.generate([ids], sp)[0].token_ids


def test_kv_pages_grow_with_tokens_held_not_max_tokens(llm):
    engine = llm.engine
    ps = engine.config.page_size
    req = engine.add_request(
        "Hi", SamplingParams(max_tokens=3 * ps, temperature=0, ignore_eos=True)
    )
    engine.step()
    assert len(req.pages) == 1  # a 2-token prompt needs one page, whatever max_tokens says
    while not req.finished:
        engine.step()
        assert len(req.pages) in (0, -(-req.num_computed_tokens // ps), -(-req.num_tokens // ps))
    assert engine.runner.kv.allocator.num_used == 0
    assert req.metrics.num_output_tokens == 3 * ps
    assert req.metrics.time_to_first_token is not None and req.metrics.queue_time is not None
    assert req.metrics.tokens_per_second and req.metrics.tokens_per_second > 0
    engine.release(req.request_id)


def test_async_stream_deltas_add_up_and_early_exit_aborts(loaded_model):
    async def main():
        from services.engine import EngineConfig, LLMEngine

        llm = AsyncLLM(LLMEngine(EngineConfig(kv_cache_memory=32 << 20), loaded_model))
        try:
            sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            texts, ids, last = [], [], None
            async for out in llm.generate(PROMPT, sp):
                texts.append(out.delta_text)
                ids.extend(out.delta_token_ids)
                last = out
            assert last is not None and last.finished and last.finish_reason == "length"
            assert "".join(texts) == last.text and ids == last.token_ids and len(ids) == 12

            async for _ in llm.generate(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True)):
                break  # a client that goes away
            for _ in range(100):
                await asyncio.sleep(0.05)
                if not llm.engine.requests:
                    break
            assert llm.engine.requests == {}
            assert llm.engine.runner.kv.allocator.num_used == 0

            refused = [o async for o in llm.generate(PROMPT, SamplingParams(max_tokens=10**6))]
            assert refused[-1].finish_reason == "error"
        finally:
            llm.shutdown()

    asyncio.run(main())


def test_engine_survives_the_model_being_switched_to_another_attention(llm):
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    before = llm.generate(PROMPT, sp)[0].token_ids
    llm.engine.runner.model.set_attn_implementation("sdpa")  # e.g. a peer run on the same object
    assert llm.generate(PROMPT, sp)[0].token_ids == before
