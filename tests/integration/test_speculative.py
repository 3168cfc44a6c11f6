"""Speculative decoding on the real model: prompt-lookup drafts verified in one forward pass
give plain decoding's greedy tokens in mixed batches (constrained or not, penalties, stop
strings, log-probabilities, other KV policies, which decode plainly), after preemption, and every
page comes back. Every grammar kind is covered in test_structured.py."""

from __future__ import annotations

import itertools
import json

import pytest

from services import LLM, KVPolicy, SamplingParams, StructuredOutput
from services.engine.speculative import Speculator

# fixed drafts here (the plain twin of the default adaptive length, tested on its own below)
SPECULATIVE = {
    "method": "ngram",
    "num_speculative_tokens": 5,
    "prompt_lookup_max": 3,
    "draft_length": "fixed",
}
DOC = (
    "Order 7781-B for Maria Gonzalez, 4 Mill Lane, Bristol BS1 4DJ: 2 x steel bracket "
    "(SKU BRK-220) at 4.50, 1 x oak shelf (SKU SHF-901) at 39.00, 3 x wall plug (SKU PLG-004) "
    "at 0.20. Phone 0117 496 0321, email maria.gonzalez@example.org."
)
ORDER = {
    "type": "object",
    "properties": {
        "order": {"type": "string"},
        "name": {"type": "string"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                "required": ["sku", "qty"],
            },
        },
    },
    "required": ["order", "name", "items"],
}


def batch(llm: LLM) -> tuple[list, list[SamplingParams]]:
    def chat(text: str) -> list[int]:
        return llm.engine.apply_chat_template([{"role": "user", "content": text}])

    extract = chat(f"Extract the order as JSON.\n{DOC}")
    repeat = chat("Write the line 'one fish, two fish, red fish' four times.")
    greedy = dict(temperature=0.0, max_tokens=40)
    return (
        [extract, extract, repeat, repeat, repeat, DOC, repeat],
        [
            SamplingParams(**greedy, structured=StructuredOutput(json_schema=ORDER)),
            SamplingParams(**greedy, logprobs=2),
            SamplingParams(**greedy, repetition_penalty=1.3, presence_penalty=0.5),
            SamplingParams(**greedy, stop=["red fish, one"]),
            SamplingParams(**greedy, kv=KVPolicy(kind="window", budget_tokens=48)),
            SamplingParams(**greedy, ignore_eos=True),
            SamplingParams(**greedy, kv=KVPolicy(kind="quest", budget_tokens=32)),
        ],
    )


@pytest.fixture(scope="module")
def plain(loaded_model) -> LLM:
    return LLM(loaded=loaded_model, kv_cache_memory=64 << 20, grammar_workers=0, speculative=None)


@pytest.fixture(scope="module")
def spec(loaded_model) -> LLM:
    return LLM(
        loaded=loaded_model, kv_cache_memory=64 << 20, grammar_workers=0, speculative=SPECULATIVE
    )


def test_greedy_tokens_equal_plain_decoding_in_a_mixed_batch(plain, spec):
    prompts, params = batch(plain)
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert [t.top for t in got[1].logprobs] == [t.top for t in want[1].logprobs]
    drafted = [o.metrics.num_draft_tokens for o in got]
    kept = [o.metrics.num_accepted_draft_tokens for o in got]
    assert drafted[4] == drafted[6] == 0  # window and quest decode plainly
    assert all(0 <= k <= d for k, d in zip(kept, drafted, strict=True))
    assert sum(kept) > 0 and spec.engine.speculator.accepted == sum(kept)
    alloc = spec.engine.runner.kv.allocator
    assert alloc.num_free == alloc.num_pages  # pages of rejected drafts came back too


def test_the_default_drafts_and_keeps_the_plain_tokens(loaded_model, plain):
    """Speculation is on by default (adaptive n-gram drafts of up to 4 tokens, none above 8
    running requests): the plain twin's greedy tokens, with drafts kept."""
    prompts, params = batch(plain)
    want = plain.generate(prompts, params)
    default = LLM(loaded=loaded_model, kv_cache_memory=64 << 20, grammar_workers=0)
    assert default.engine.speculator is not None
    got = default.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.metrics.num_accepted_draft_tokens for o in got) > 0


def test_a_crowded_batch_decodes_plainly(loaded_model, plain):
    """`disable_by_batch_size`: no drafts while more requests run than it allows; a request
    running alone drafts again."""
    prompts, params = batch(plain)
    prompts, params = prompts[:2], params[:2]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM(
        loaded=loaded_model,
        kv_cache_memory=64 << 20,
        grammar_workers=0,
        speculative={**SPECULATIVE, "disable_by_batch_size": 1},
        # in lockstep: a mask late on a loaded machine would make the constrained request a
        # step behind, alone (and drafting) at its end
        mask_deadline_ms=None,
    )
    crowded = llm.generate(prompts, params)
    assert [o.token_ids for o in crowded] == want
    # both run together until the shorter ends; only then may the other draft
    shorter = min(range(2), key=lambda i: len(want[i]))
    assert crowded[shorter].metrics.num_draft_tokens == 0
    alone = llm.generate(prompts[:1], params[:1])[0]
    assert alone.token_ids == want[0] and alone.metrics.num_draft_tokens > 0


def test_adaptive_drafts_shrink_after_a_miss_and_keep_the_plain_tokens(
    loaded_model, plain, monkeypatch
):
    prompts, params = batch(plain)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM(
        loaded=loaded_model,
        kv_cache_memory=64 << 20,
        grammar_workers=0,
        speculative={**SPECULATIVE, "draft_length": "adaptive"},
    )
    walks: dict[str, list[tuple[int, int]]] = {}  # request -> (draft length, kept) per step
    walk = Speculator._walk

    def recorded(req, draft, rows, engine, stage):
        kept = walk(req, draft, rows, engine, stage)
        walks.setdefault(req.request_id, []).append((len(draft), kept))
        return kept

    monkeypatch.setattr(Speculator, "_walk", staticmethod(recorded))
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    pairs = [(a, b) for steps in walks.values() for a, b in itertools.pairwise(steps)]
    assert any(kept < length for (length, kept), _ in pairs)  # some draft missed
    for (length, kept), (after, _) in pairs:
        if kept < length:  # missed: the next draft is at most one longer than what was kept
            assert after <= kept + 1
    assert max(length for steps in walks.values() for length, _ in steps) == 5  # grew to the cap


def test_preempted_requests_recompute_to_the_plain_tokens(loaded_model, plain):
    """Room for about two requests at full length: the rest wait or are preempted, drafts and
    all."""
    prompts, params = batch(plain)
    prompts, params = prompts[:4] * 2, [params[0], params[2], params[3], params[5]] * 2
    want = [o.token_ids for o in plain.generate(prompts, params)]
    cfg = loaded_model.model.config
    ps = 16
    pages = 2 * (-(-(max(len(p) for p in prompts) + 40) // ps)) + 2
    page_bytes = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 64 * 4 * ps
    small = LLM(
        loaded=loaded_model,
        kv_cache_memory=pages * page_bytes,
        grammar_workers=0,
        speculative=SPECULATIVE,
        enable_prefix_caching=False,  # the twin extraction prompts would share their pages
    )
    got = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == want
    alloc = small.engine.runner.kv.allocator
    assert alloc.num_free == alloc.num_pages


def test_sampling_with_drafts_finishes_and_follows_the_grammar(spec):
    prompts, _ = batch(spec)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, seed=7, **extra)
        for extra in ({"structured": StructuredOutput(json_schema=ORDER)}, {})
    ]
    outs = spec.generate([prompts[0], prompts[2]], params)
    assert outs[0].finish_reason in ("stop", "length") and outs[1].finish_reason in (
        "stop",
        "length",
    )
    if outs[0].finish_reason == "stop":
        json.loads(outs[0].text)
    again = spec.generate([prompts[0], prompts[2]], params)  # seeded: the same draws again
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def test_a_request_failing_inside_its_draft_walk_fails_alone(loaded_model, plain, monkeypatch):
    """An error while a drafted request's rows are walked (the repeat guard's 422 in real use)
    ends that request alone; the batch and the engine go on."""
    from services.engine.failures import RequestError
    from services.engine.speculative import Speculator

    llm = LLM(
        loaded=loaded_model, kv_cache_memory=64 << 20, grammar_workers=0, speculative=SPECULATIVE
    )
    walk = Speculator._walk

    def failing(req, *args):
        if req.request_id == "hostile":
            raise RequestError("structured.max_repeat_run: stand-in", status=422)
        return walk(req, *args)

    monkeypatch.setattr(Speculator, "_walk", staticmethod(failing))
    engine = llm.engine
    text = "one fish, two fish, red fish, blue fish; " * 4
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = plain.generate(text, params)[0].token_ids
    hostile = engine.add_request(text, params, request_id="hostile")
    victim = engine.add_request(text, params, request_id="victim")
    while engine.has_unfinished():
        engine.step()
    assert hostile.finish_reason == "error" and hostile.error_status == 422
    assert hostile.metrics.num_draft_tokens > 0  # it failed in a walk
    assert victim.output_token_ids == want and victim.metrics.num_accepted_draft_tokens > 0
    assert llm.generate(text, params)[0].token_ids == want
