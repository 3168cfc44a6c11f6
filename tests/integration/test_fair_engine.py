"""Fair shares on the real engine: a tenant arriving behind another's flood is served at once,
and the fair scheduler (with and without newcomer steps) and its plain twin give every request
the same tokens."""

from __future__ import annotations

import pytest

from services import LLM, SamplingParams

PROMPTS = ["The sea is", "A cat", "Trains run", "In winter", "My library", "Rivers flow"]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def run(llm: LLM) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Tenant a floods the batch; b arrives after its first step. The tokens of each request,
    and the step at which each finished."""
    engine = llm.engine
    for i, p in enumerate(PROMPTS[:5]):
        engine.add_request(p, PARAMS, f"a{i}", tenant="a")
    engine.step()
    engine.add_request(PROMPTS[5], PARAMS, "b0", tenant="b")
    done: dict[str, int] = {}
    steps = 1
    while engine.has_unfinished():
        steps += 1
        for req in engine.step():
            if req.finish_reason is not None:
                done.setdefault(req.request_id, steps)
    tokens = {rid: engine.make_output(engine.requests[rid]).token_ids for rid in done}
    for rid in done:
        engine.release(rid)
    return tokens, done


@pytest.fixture(scope="module")
def outcomes(loaded_model):
    out = {}
    for fair, newcomer in ((True, False), (False, False), ("newcomer", True)):
        llm = LLM(
            loaded=loaded_model,
            kv_cache_memory=64 << 20,
            max_num_seqs=4,
            fair_scheduling=bool(fair),
            newcomer_steps=newcomer,
        )
        out[fair] = run(llm)
    return out


def test_the_tenant_behind_a_flood_is_served_at_once(outcomes):
    _, fair_done = outcomes[True]
    _, plain_done = outcomes[False]
    assert fair_done["b0"] < plain_done["b0"]  # plain: b waits for a slot to free
    assert fair_done["b0"] <= min(fair_done[f"a{i}"] for i in range(5)) + 2


def test_newcomer_steps_serve_it_no_later(outcomes):
    assert outcomes["newcomer"][1]["b0"] <= outcomes[True][1]["b0"]


def test_fair_and_plain_give_every_request_the_same_tokens(outcomes):
    assert outcomes[True][0] == outcomes[False][0] == outcomes["newcomer"][0]
