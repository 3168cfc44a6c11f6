"""A step never waits on one slow mask: a constrained request whose mask (or forced text, or a
draft's verification mask) misses the deadline leaves the step, parked, and samples once its
grammar work is in; the rest of the batch goes on as if it were not there.

Each test runs a victim batch alone and again beside the slow request: the victims' tokens are
the same and they finish within two steps of the same count (a constrained victim's own mask may
miss the deadline once or twice on a loaded machine: it is parked, as any late mask is); the slow
request's tokens equal its tokens without the delay, or it fails with a 422 naming its grammar."""

from __future__ import annotations

import time

import pytest
from hostile import QUESTION, SLOW_IN_RARE_BRANCH, SLOW_PAST_CHOICES

from services import LLM, SamplingParams, StructuredOutput
from services.engine.engine import LLMEngine
from services.engine.failures import FaultInjector
from services.engine.params import RequestOutput

VICTIM = "The history of the printing press begins"
VICTIM_PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
BOOLEAN = {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}
VICTIM_JSON = SamplingParams(
    max_tokens=24, temperature=0, structured=StructuredOutput(json_schema=BOOLEAN)
)
WORDS = SamplingParams(
    max_tokens=16, temperature=0, structured=StructuredOutput(regex=r"[a-z ]{1,40}")
)
DEEP, RARE = SLOW_PAST_CHOICES, SLOW_IN_RARE_BRANCH


def run(
    engine: LLMEngine, batch: list[tuple[str, object, SamplingParams]]
) -> tuple[dict[str, RequestOutput], dict[str, int]]:
    """Outputs, and the steps each request was unfinished for."""
    reqs = [engine.add_request(p, sp, request_id=rid) for rid, p, sp in batch]  # type: ignore[arg-type]
    steps = dict.fromkeys((r.request_id for r in reqs), 0)
    while engine.has_unfinished():
        engine.step()
        for r in reqs:
            steps[r.request_id] += not r.finished
    outs = {r.request_id: engine.make_output(r) for r in reqs}
    for r in reqs:
        engine.release(r.request_id)
    return outs, steps


@pytest.fixture(scope="module")
def llm(loaded_model):
    """No compile service (so no probe): what reaches decoding is the deadline's to contain."""
    llm = LLM(loaded=loaded_model, kv_cache_memory=64 << 20, grammar_workers=0)
    llm.engine.boundary.faults = FaultInjector()
    yield llm
    llm.engine.grammars.shutdown()


@pytest.fixture(scope="module")
def chat(llm) -> list[int]:
    return llm.engine.apply_chat_template([{"role": "user", "content": QUESTION}])


def victims(chat: list[int]) -> list[tuple[str, object, SamplingParams]]:
    return [("victim", VICTIM, VICTIM_PARAMS), ("victim-json", chat, VICTIM_JSON)]


def assert_victims_unharmed(base: tuple, hit: tuple) -> None:
    for name in ("victim", "victim-json"):
        assert hit[0][name].token_ids == base[0][name].token_ids, (name, hit[0][name].warnings)
        assert abs(hit[1][name] - base[1][name]) <= 2, (name, base[1], hit[1])


def test_a_sleeping_mask_delays_its_own_request_only(llm, chat):
    engine = llm.engine
    batch = [*victims(chat), ("slow", chat, WORDS)]
    run(engine, batch)  # warm: grammars compiled, so both runs below take the same steps
    base = run(engine, batch)
    engine.boundary.faults.delay("slow", "mask", 1.0)  # its first mask sleeps a second
    start = time.monotonic()
    hit = run(engine, batch)
    assert_victims_unharmed(base, hit)
    assert hit[0]["slow"].token_ids == base[0]["slow"].token_ids  # sampled once its mask came
    assert hit[0]["slow"].finish_reason == base[0]["slow"].finish_reason
    assert hit[1]["slow"] > base[1]["slow"] and time.monotonic() - start >= 1.0
    assert engine.grammars.late.parked >= 1


@pytest.mark.parametrize("shape", ["deep", "rare"])
def test_a_real_slow_regex_fails_alone_and_is_refused_next_time(llm, chat, shape):
    """Seconds of CPU per mask on the attacker's path: the request fails (422, its grammar
    named) once its slow masks add up to the strikes, the victims never wait for it, and the
    same grammar is refused at admission afterwards."""
    engine = llm.engine
    if shape == "deep":
        regex, bias = DEEP, None
    else:  # steered into the rare branch, as a tenant would with logit_bias
        regex = RARE
        bias = {engine.tokenizer.encode("z", add_special_tokens=False)[0]: 100.0}
    hostile = SamplingParams(
        max_tokens=40, temperature=0, logit_bias=bias, structured=StructuredOutput(regex=regex)
    )
    base = run(engine, victims(chat))
    hit = run(engine, [*victims(chat), ("hostile", chat, hostile)])
    assert_victims_unharmed(base, hit)
    out = hit[0]["hostile"]
    assert out.finish_reason == "error" and out.error_status == 422, out.warnings
    assert "masks slower than the budget" in out.warnings[-1]
    assert "the grammar (regex " in out.warnings[-1]  # named, by a digest of its key
    again = run(engine, [("again", chat, hostile)])[0]["again"]
    assert again.error_status == 422 and not again.token_ids


def test_a_stream_whose_parked_request_fails_gets_its_last_output(llm, chat):
    """Served: the request fails while parked (its fill still running); its stream ends with
    the error, as every other stream ends, never left waiting."""
    import asyncio

    from services.engine.async_llm import AsyncLLM

    hostile = SamplingParams(
        max_tokens=60, temperature=0, structured=StructuredOutput(regex=r"q([ab]\n){12}(.?){0,900}")
    )

    async def main() -> RequestOutput:
        allm = AsyncLLM(llm.engine)
        try:
            outs = [out async for out in allm.add_request(chat, hostile, "streamed")]
            return outs[-1]
        finally:
            allm._commands.put(None)  # stop the loop, keep the shared engine's grammars

    last = asyncio.run(asyncio.wait_for(main(), 60))
    assert last.finished and last.finish_reason == "error" and last.error_status == 422
    assert "masks slower than the budget" in last.warnings[-1]


def test_no_deadline_is_the_plain_twin(loaded_model, chat):
    """`mask_deadline_ms=None` waits for every mask: with no mask late, the same tokens."""
    batch = [
        *victims(chat),
        ("words", chat, WORDS),
        (
            "choice",
            chat,
            SamplingParams(
                max_tokens=8, temperature=0, structured=StructuredOutput(choice=["yes", "no"])
            ),
        ),
    ]
    outs = []
    for deadline in (None, 20.0):
        twin = LLM(
            loaded=loaded_model,
            kv_cache_memory=64 << 20,
            grammar_workers=0,
            mask_deadline_ms=deadline,
        )
        outs.append({k: o.token_ids for k, o in run(twin.engine, batch)[0].items()})
        if deadline is None:
            assert twin.engine.grammars.late.parked == 0  # the twin never leaves a row out
        twin.engine.grammars.shutdown()
    assert outs[0] == outs[1]


def test_a_late_draft_verification_mask_parks_the_walk(loaded_model, chat):
    """Speculation: a verification mask that misses the deadline ends the walk there; the
    request samples that position once the mask is in, with the tokens of plain decoding."""
    llm = LLM(
        loaded=loaded_model,
        kv_cache_memory=64 << 20,
        grammar_workers=0,
        speculative={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2},
    )
    engine = llm.engine
    listing = {"type": "array", "items": BOOLEAN, "minItems": 3, "maxItems": 3}
    params = SamplingParams(
        max_tokens=40, temperature=0, structured=StructuredOutput(json_schema=listing)
    )
    batch = [("victim", VICTIM, VICTIM_PARAMS), ("drafted", chat, params)]
    base = run(engine, batch)
    late = {"n": 0}

    def slow_in_walks(stage: str, req) -> None:  # a draft's masks are filled while it has one
        if stage == "mask" and req.request_id == "drafted" and req.draft and late["n"] < 3:
            late["n"] += 1
            time.sleep(0.2)

    engine.grammars.check = slow_in_walks
    hit = run(engine, batch)
    assert late["n"] >= 1 and engine.grammars.late.parked >= 1
    assert hit[0]["victim"].token_ids == base[0]["victim"].token_ids
    assert hit[0]["drafted"].token_ids == base[0]["drafted"].token_ids
    assert hit[0]["drafted"].metrics.num_draft_tokens > 0
    engine.grammars.shutdown()


def test_late_forced_text_resumes_the_token_path(loaded_model, chat, monkeypatch):
    """Jump-forward: the text the grammar forces comes late; the token is accepted, the rest
    of its path waits, parked, and the output is the one it would have been."""
    llm = LLM(loaded=loaded_model, kv_cache_memory=64 << 20, grammar_workers=0, jump_forward=True)
    engine = llm.engine
    schema = {
        "type": "object",
        "properties": {"verdict": {"enum": ["yes"]}, "sure": {"type": "boolean"}},
        "required": ["verdict", "sure"],
    }
    forced = SamplingParams(
        max_tokens=24, temperature=0, structured=StructuredOutput(json_schema=schema)
    )
    batch = [("victim", VICTIM, VICTIM_PARAMS), ("forced", chat, forced)]
    base = run(engine, batch)
    backends, calls = engine.grammars.backend, {"n": 0}
    new_state = backends.new_state

    def slow_forced_text(compiled):  # the next grammar state's first forced text sleeps
        state = new_state(compiled)
        real = state.jump_forward

        def late_once() -> str:
            calls["n"] += 1
            if calls["n"] == 1:
                time.sleep(0.5)
            return real()

        state.jump_forward = late_once
        return state

    monkeypatch.setattr(backends, "new_state", slow_forced_text)
    hit = run(engine, batch)
    assert engine.grammars.late.parked >= 1 and calls["n"] >= 1
    assert hit[0]["victim"].token_ids == base[0]["victim"].token_ids
    assert hit[0]["forced"].token_ids == base[0]["forced"].token_ids
    assert hit[0]["forced"].validated is True
    assert base[0]["forced"].metrics.num_forced_tokens > 0  # jump-forward did append spans
    engine.grammars.shutdown()


# -- the probe: where attackers hide ------------------------------------------------------------


@pytest.fixture(scope="module")
def xgrammar(llm):
    return llm.engine.grammars.backend.xgrammar


@pytest.fixture(scope="module")
def probe_fills():
    from services.grammar.workers import GrammarWorkers

    workers = GrammarWorkers(1, "probe")
    yield workers
    workers.shutdown()


@pytest.mark.parametrize(
    ("regex", "path"), [(DEEP, "\n" * 12), (RARE, "zqxjv")], ids=["deep", "rare"]
)
def test_the_probe_finds_both_shapes_and_leaves_the_slow_fill_behind(
    xgrammar, probe_fills, regex, path
):
    """Past 12 choice points, and in the branch few tokens enter: found, with the text that
    reached it, at the stop (the fill that would run for seconds is left on idle cores)."""
    from services.compiler.probe import probe_masks

    compiled = xgrammar.compile(StructuredOutput(regex=regex))
    start = time.monotonic()
    probe = probe_masks(xgrammar, compiled, 32, 0, 80.0, workers=probe_fills)
    assert time.monotonic() - start < 2.0  # a fill of its seconds would take longer
    assert probe.slow_path is not None and probe.worst_ms > 80.0
    assert probe.slow_path.count("\n") == path.count("\n") and path.strip() in probe.slow_path


def test_a_family_path_takes_the_probe_where_its_own_walk_does_not_reach(xgrammar, probe_fills):
    from services.compiler.probe import probe_masks

    deeper = xgrammar.compile(StructuredOutput(regex=r"([ab]\n){40}(.?){0,1000}"))
    alone = probe_masks(xgrammar, deeper, 32, 0, 80.0, workers=probe_fills)
    assert alone.slow_path is None  # 32 choice points do not reach it
    hinted = probe_masks(xgrammar, deeper, 32, 0, 80.0, ["a\n" * 39], workers=probe_fills)
    assert hinted.slow_path is not None and hinted.slow_path.count("\n") == 40


def test_the_probe_passes_real_world_schemas(xgrammar, probe_fills):
    import json
    from pathlib import Path

    from services.compiler.probe import probe_masks

    folder = Path(__file__).resolve().parents[3] / "shared" / "data" / "maskbench"
    if not folder.is_dir():
        pytest.skip("needs ../shared/data/maskbench (the dev schemas)")
    refused = []
    for path in sorted(folder.glob("*.json"))[:40]:
        try:
            compiled = xgrammar.compile(
                StructuredOutput(json_schema=json.loads(path.read_text())["schema"])
            )
        except Exception:  # refused at compile: not the probe's to judge
            continue
        probe = probe_masks(xgrammar, compiled, 32, 0, 80.0, workers=probe_fills)
        if probe.slow_path is not None or probe.median_ms > 20.0:
            refused.append((path.name, probe))
    assert not refused
