"""Sampling controls and log-probabilities on the real model: logprobs equal the model's own
log-softmax, after the grammar's mask; penalties, bias and min_tokens change what they should."""

from __future__ import annotations

import math

import pytest
import torch

from services import LLM, SamplingParams, StructuredOutput

PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def llm(loaded_model) -> LLM:
    return LLM(loaded=loaded_model, kv_cache_memory=64 << 20, grammar_workers=0)


def test_logprobs_equal_the_models_log_softmax(llm, loaded_model):
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    out = llm.generate(PROMPT, sp)[0]
    assert len(out.logprobs) == len(out.token_ids) == 8
    ids = llm.tokenizer.encode(PROMPT, add_special_tokens=False) + out.token_ids
    model = loaded_model.model
    model.set_attn_implementation("sdpa")  # the engine switches it back on its next step
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    n = len(ids) - len(out.token_ids)
    for j, lp in enumerate(out.logprobs):
        row = ref[n - 1 + j]
        assert lp.token_id == out.token_ids[j]
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-3
        assert lp.top[0][0] == lp.token_id  # greedy: the sampled token is the most likely
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()


def test_logprobs_are_taken_after_the_grammar_mask(llm):
    spec = StructuredOutput(choice=["red", "green", "blue"])
    sp = SamplingParams(max_tokens=4, temperature=0, structured=spec, logprobs=20)
    out = llm.generate(PROMPT, sp)[0]
    first = out.logprobs[0]
    allowed = [t for t, v in first.top if math.isfinite(v)]
    assert first.token_id in allowed and len(allowed) < 20  # the rest are masked: -inf
    for t in allowed:  # only tokens that begin one of the choices
        assert any(c.startswith(llm.tokenizer.decode([t])) for c in spec.choice)
    unmasked = SamplingParams(max_tokens=1, temperature=0, logprobs=0)
    free = llm.generate(PROMPT, unmasked)[0].logprobs[0]
    assert first.logprob > free.logprob or first.token_id != free.token_id
    assert sum(math.exp(v) for v in dict(first.top).values()) == pytest.approx(1, abs=1e-3)


def test_logprobs_of_jump_forward_tokens_are_certain(loaded_model):
    jf = LLM(loaded=loaded_model, kv_cache_memory=32 << 20, grammar_workers=0, jump_forward=True)
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}}
    sp = SamplingParams(
        max_tokens=24, temperature=0, structured=StructuredOutput(json_schema=schema), logprobs=1
    )
    out = jf.generate(PROMPT, sp)[0]
    assert out.metrics.num_forced_tokens > 0
    assert len(out.logprobs) == len(out.token_ids)
    assert sum(lp.logprob == 0.0 for lp in out.logprobs) >= out.metrics.num_forced_tokens


def test_logit_bias_forces_and_forbids_tokens(llm):
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    banned = plain.token_ids[0]
    avoid = SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, logit_bias={banned: -100.0}
    )
    assert banned not in llm.generate(PROMPT, avoid)[0].token_ids
    forced = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    push = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logit_bias={forced: 100.0})
    assert llm.generate(PROMPT, push)[0].token_ids == [forced] * 3


def test_frequency_penalty_breaks_a_repetition(llm):
    loop = "one one one one one one one one"
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    penal = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, frequency_penalty=2.0)
    a, b = llm.generate([loop, loop], [plain, penal])
    assert len(set(b.token_ids)) > len(set(a.token_ids))


def test_min_tokens_holds_back_the_end(llm):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = llm.engine.apply_chat_template(question)
    short = llm.generate(chat, SamplingParams(max_tokens=100, temperature=0))[0]
    assert short.finish_reason == "stop"
    n = len(short.token_ids) + 5
    held = SamplingParams(max_tokens=100, temperature=0, min_tokens=n)
    longer = llm.generate(chat, held)[0]
    assert len(longer.token_ids) >= n
    assert longer.token_ids[: len(short.token_ids) - 1] == short.token_ids[:-1]


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    for sp in (
        SamplingParams(max_tokens=4, stop_token_ids=[10**7]),
        SamplingParams(max_tokens=4, logit_bias={10**7: 1.0}),
    ):
        out = llm.generate(PROMPT, sp)[0]
        assert out.finish_reason == "error" and "outside the vocabulary" in out.warnings[-1]


def test_a_loop_inside_a_string_ends_early_with_a_warning(llm):
    """A bias makes the model write one word forever inside a JSON string: the repeat guard
    ends it at `max_repeat_run` tokens; switched off, it burns the whole budget."""
    (ha,) = llm.tokenizer.encode(" ha", add_special_tokens=False)
    prompt = llm.engine.apply_chat_template([{"role": "user", "content": "Laugh."}])

    def run(max_repeat_run):
        so = StructuredOutput(json_schema={"type": "string"}, max_repeat_run=max_repeat_run)
        sp = SamplingParams(max_tokens=160, temperature=0, logit_bias={ha: 100.0}, structured=so)
        return llm.generate([prompt], sp)[0]

    guarded, plain = run(48), run(None)
    assert guarded.finish_reason == "error" and len(guarded.token_ids) <= 50
    assert any("max_repeat_run" in w and "ha" in w for w in guarded.warnings)
    assert plain.finish_reason == "length" and len(plain.token_ids) == 160
    assert plain.text.startswith(guarded.text)
