"""Containment on the real model: every hostile request and every per-request fault runs batched
beside a victim; the victim's tokens equal its tokens alone, the hostile request ends with an
error naming the cause (or is served sanely), and the engine serves the next request."""

from __future__ import annotations

import pytest
import torch
from hostile import CASES, QUESTION, SLOW_MASK_REGEX, Case, engine_request

from grammar_registry.limits import GrammarLimits
from services import LLM, KVPolicy, SamplingParams, StructuredOutput
from services.engine.engine import LLMEngine
from services.engine.failures import STAGES, FaultInjector
from services.engine.params import RequestOutput

VICTIM = "The history of the printing press begins"
VICTIM_PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
VICTIM_JSON = SamplingParams(
    max_tokens=24,
    temperature=0,
    structured=StructuredOutput(
        json_schema={
            "type": "object",
            "properties": {"answer": {"type": "boolean"}},
            "required": ["answer"],
        }
    ),
)


def run(
    engine: LLMEngine, batch: list[tuple[str, object, SamplingParams]]
) -> dict[str, RequestOutput]:
    reqs = [engine.add_request(p, sp, request_id=rid) for rid, p, sp in batch]  # type: ignore[arg-type]
    while engine.has_unfinished():
        engine.step()
    outs = {r.request_id: engine.make_output(r) for r in reqs}
    for r in reqs:
        engine.release(r.request_id)
    return outs


@pytest.fixture(scope="module")
def llm(loaded_model) -> LLM:
    """Grammars through the compile service (a worker process, the probe), like a server."""
    return LLM(loaded=loaded_model, kv_cache_memory=64 << 20, grammar_workers=1)


def victims_alone(engine: LLMEngine) -> dict:
    """The victims' tokens, each run alone."""
    chat = engine.apply_chat_template([{"role": "user", "content": QUESTION}])
    return {
        "plain": run(engine, [("v", VICTIM, VICTIM_PARAMS)])["v"].token_ids,
        "json": run(engine, [("v", chat, VICTIM_JSON)])["v"].token_ids,
        "chat": chat,
    }


@pytest.fixture(scope="module")
def alone(llm):
    return victims_alone(llm.engine)


def check_victims(engine: LLMEngine, alone: dict, hostile: tuple[str, object, SamplingParams]):
    outs = run(
        engine,
        [("victim", VICTIM, VICTIM_PARAMS), hostile, ("victim-json", alone["chat"], VICTIM_JSON)],
    )
    for name, key in (("victim", "plain"), ("victim-json", "json")):
        out = outs[name]  # why it differs, if it does: a CI log is all there is
        assert out.token_ids == alone[key], (name, out.finish_reason, out.warnings)
    assert outs["victim-json"].validated is True
    after = run(engine, [("next", VICTIM, VICTIM_PARAMS)])["next"]  # the engine still serves
    assert after.token_ids == alone["plain"] and after.finish_reason == "length"
    return outs[hostile[0]]


def check_case(engine: LLMEngine, alone: dict, case: Case, backend: str = "xgrammar") -> None:
    expect = case.expected(backend)
    try:
        prompt, params = engine_request(case, engine, max_tokens=32)
    except ValueError as exc:  # refused while building its parameters: before any work
        assert expect is not None and expect in str(exc), exc
        return
    out = check_victims(engine, alone, ("hostile", prompt, params))
    if expect is None:
        assert out.finish_reason in ("stop", "length"), out.warnings
        assert case.validated is None or out.validated is case.validated, out.warnings
    else:
        assert out.finish_reason == "error"
        assert any(expect in w for w in out.warnings), out.warnings


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_hostile_requests_hurt_no_one(llm, alone, case):
    check_case(llm.engine, alone, case)


@pytest.fixture(scope="module", params=["llguidance", "auto"])
def other_backend(request, loaded_model):
    """An engine per other grammar backend, with the compile service (the workers for
    xgrammar's grammars, `LocalBuilds` for llguidance's), and its victims alone."""
    llm = LLM(
        loaded=loaded_model,
        kv_cache_memory=64 << 20,
        grammar_workers=1,
        grammar_backend=request.param,
    )
    yield request.param, llm.engine, victims_alone(llm.engine)
    llm.engine.grammars.shutdown()


@pytest.mark.parametrize("case", [c for c in CASES if c.structured], ids=lambda c: c.name)
def test_hostile_grammars_are_refused_or_bounded_with_every_backend(other_backend, case):
    """The victims' JSON request uses the backend too."""
    backend, engine, alone = other_backend
    check_case(engine, alone, case, backend)


def test_llguidance_parser_limits_refuse_at_admission_and_bound_each_mask(loaded_model):
    """`GrammarLimits` sets llguidance's parser limits: with a tiny lexer, the admission probe
    refuses the grammar (400, named), and with no probe (the plain twin, no compile service) the
    decode that runs past them fails alone with a 422 instead of ending early as if complete."""
    from services.compiler import CompilerConfig, build_provider

    tiny = GrammarLimits(max_lexer_states=50)
    spec = StructuredOutput(regex=SLOW_MASK_REGEX, backend="llguidance")
    hostile = SamplingParams(max_tokens=32, temperature=0, structured=spec)
    # the victims' JSON on xgrammar: the tiny limits are llguidance's
    xgrammar = {"kv_cache_memory": 64 << 20, "grammar_backend": "xgrammar"}
    plain = LLM(loaded=loaded_model, grammar_workers=0, **xgrammar)
    backends = plain.engine.grammars.backend
    provider = build_provider(backends, 1, config=CompilerConfig(limits=tiny))
    guarded = LLM(loaded=loaded_model, grammar_provider=provider, **xgrammar)
    alone = victims_alone(guarded.engine)
    out = check_victims(guarded.engine, alone, ("hostile", alone["chat"], hostile))
    assert out.finish_reason == "error" and out.error_status == 400, out.warnings
    assert "parser's limits" in out.warnings[-1] and not out.token_ids
    provider.shutdown()
    assert backends.limits is tiny  # shared with the plain engine: no probe, the limits alone
    out = check_victims(
        plain.engine, victims_alone(plain.engine), ("hostile", alone["chat"], hostile)
    )
    assert out.finish_reason == "error" and out.error_status == 422, out.warnings
    assert "parser's limits" in out.warnings[-1] and 0 < len(out.token_ids) < 32
    again = run(plain.engine, [("again", alone["chat"], hostile)])["again"]
    assert again.error_status == 422 and not again.token_ids  # refused now, before decoding
    plain.engine.grammars.shutdown()


def test_a_temperature_too_small_to_sample_decodes_greedily(llm):
    tiny = SamplingParams(max_tokens=12, temperature=1e-39, ignore_eos=True)
    greedy = llm.generate(VICTIM, VICTIM_PARAMS)[0].token_ids
    assert llm.generate(VICTIM, tiny)[0].token_ids == greedy


def test_non_finite_logits_fail_their_row_alone(llm, alone, monkeypatch):
    engine = llm.engine
    forward = engine.runner.forward

    def poisoned(chunks):
        logits = forward(chunks).clone()  # an inference tensor: not writable out here
        rows = [c.request.request_id for c in chunks if c.samples]
        if "hostile" in rows:
            logits[rows.index("hostile")] = float("nan")
        return logits

    monkeypatch.setattr(engine.runner, "forward", poisoned)
    out = check_victims(engine, alone, ("hostile", VICTIM, VICTIM_PARAMS))
    assert out.finish_reason == "error" and "not finite" in out.warnings[-1]
    assert out.error_status == 422


def test_masks_over_budget_while_decoding_fail_the_request_and_refuse_the_grammar(
    loaded_model, llm, alone
):
    """A lenient compile probe lets a slow grammar through: the decode-time budget fails the
    request (422), downgrades its verdict for the tenant, and the next such request is refused
    at admission; another tenant's verdict is untouched."""
    from hostile import SLOW_ONCE_REGEX

    from services.compiler import CompilerConfig, build_provider

    backend = llm.engine.grammars.backend
    provider = build_provider(backend, 1, config=CompilerConfig(mask_budget_ms=60_000))
    lenient = LLM(loaded=loaded_model, kv_cache_memory=64 << 20, grammar_provider=provider)
    engine = lenient.engine
    spec = StructuredOutput(regex=SLOW_ONCE_REGEX)
    slow = SamplingParams(max_tokens=48, temperature=0, structured=spec)
    out = check_victims(engine, alone, ("hostile", alone["chat"], slow))
    assert out.finish_reason == "error" and out.error_status == 422, out.warnings
    assert "masks slower than the budget" in out.warnings[-1]
    again = run(engine, [("again", alone["chat"], slow)])["again"]
    assert again.finish_reason == "error" and again.error_status == 422 and not again.token_ids
    assert "masks slower than the budget" in again.warnings[-1]
    other = engine.add_request(alone["chat"], slow, request_id="other", tenant="another")
    while not other.finished and other.grammar is None:
        engine.step()
    assert other.grammar is not None  # compiled for the other tenant: its verdict is its own
    engine.abort("other")
    engine.release("other")
    provider.shutdown()


# -- fault injection: an exception inside each per-request stage, in turn ------------------------

JUMPY = StructuredOutput(
    json_schema={"type": "object", "properties": {"verdict": {"enum": ["yes"]}}}
)


@pytest.fixture(scope="module")
def faulty(loaded_model):
    """An engine where every stage is reachable: jump-forward on, a host tier for offload."""
    llm = LLM(
        loaded=loaded_model,
        kv_cache_memory=64 << 20,
        grammar_workers=0,
        jump_forward=True,
        kv_tier_pages=64,
    )
    llm.engine.boundary.faults = FaultInjector()
    return llm


def stage_request(stage: str) -> SamplingParams:
    if stage in ("grammar", "mask", "accept", "jump_forward", "validate"):
        return SamplingParams(max_tokens=24, temperature=0, structured=JUMPY)
    if stage == "kv_compact":
        return SamplingParams(max_tokens=12, temperature=0, kv=KVPolicy(kind="window", window=32))
    if stage == "kv_offload":
        kv = KVPolicy(kind="quest", offload=True, budget_tokens=32)
        return SamplingParams(max_tokens=12, temperature=0, kv=kv)
    return SamplingParams(max_tokens=12, temperature=0)


@pytest.mark.parametrize("stage", [s for s in STAGES if s != "output"])
def test_a_fault_in_any_stage_fails_that_request_alone(faulty, stage):
    engine = faulty.engine
    chat = engine.apply_chat_template([{"role": "user", "content": QUESTION}])
    alone = {
        "plain": run(engine, [("v", VICTIM, VICTIM_PARAMS)])["v"].token_ids,
        "json": run(engine, [("v", chat, VICTIM_JSON)])["v"].token_ids,
        "chat": chat,
    }
    rid = f"hostile-{stage}"
    engine.boundary.faults.arm(rid, stage)
    out = check_victims(engine, alone, (rid, chat, stage_request(stage)))
    assert out.finish_reason == "error", (stage, out.warnings)
    assert any(w.startswith(f"{stage}: internal error") for w in out.warnings), out.warnings
    assert engine.scheduler.allocator.num_free == engine.runner.kv.num_pages  # nothing leaked


def test_a_fault_while_making_the_output_fails_that_stream_alone(faulty):
    import asyncio

    from services.engine.async_llm import AsyncLLM

    async def main() -> tuple[RequestOutput, RequestOutput]:
        allm = AsyncLLM(faulty.engine)
        try:
            faulty.engine.boundary.faults.arm("stream-hostile", "output")
            hostile = allm.add_request(VICTIM, VICTIM_PARAMS, "stream-hostile")
            victim = allm.add_request(VICTIM, VICTIM_PARAMS, "stream-victim")

            async def last(stream):
                return [out async for out in stream][-1]

            return await asyncio.wait_for(asyncio.gather(last(hostile), last(victim)), 120)
        finally:
            allm._commands.put(None)  # stop the loop, keep the shared engine's grammars

    hostile, victim = asyncio.run(main())
    assert hostile.finish_reason == "error" and "output: internal error" in hostile.warnings[-1]
    assert victim.finish_reason == "length" and len(victim.token_ids) == 12


# -- faults of the whole engine -------------------------------------------------------------------


def test_an_engine_wide_fault_fails_every_request_and_leaves_the_engine_usable(llm, monkeypatch):
    engine = llm.engine
    forward = engine.runner.forward
    calls = {"n": 0}

    def out_of_memory(chunks):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("simulated: out of memory")
        return forward(chunks)

    monkeypatch.setattr(engine.runner, "forward", out_of_memory)
    reqs = [engine.add_request(VICTIM, VICTIM_PARAMS, request_id=f"oom-{i}") for i in range(2)]
    with pytest.raises(torch.OutOfMemoryError):
        while engine.has_unfinished():
            engine.step()
    for r in reqs:
        out = engine.make_output(r)
        assert out.finished and out.finish_reason == "error" and out.error_status == 503
        assert "engine: the step failed" in out.warnings[-1]
        engine.release(r.request_id)
    assert not engine.has_unfinished()
    assert engine.scheduler.allocator.num_free == engine.runner.kv.num_pages
    monkeypatch.setattr(engine.runner, "forward", forward)
    assert llm.generate(VICTIM, VICTIM_PARAMS)[0].finish_reason == "length"


def test_an_engine_wide_fault_answers_every_stream_and_every_later_request(loaded_model):
    import asyncio

    from services.engine.async_llm import AsyncLLM, EngineDeadError

    llm = LLM(loaded=loaded_model, kv_cache_memory=32 << 20, grammar_workers=0)

    def broken(chunks):
        raise torch.OutOfMemoryError("simulated: out of memory")

    llm.engine.runner.forward = broken  # type: ignore[method-assign]

    async def main() -> list[object]:
        allm = AsyncLLM(llm.engine)
        streams = [allm.add_request(VICTIM, VICTIM_PARAMS) for _ in range(3)]

        async def last(stream):
            outs = [out async for out in stream]
            return outs[-1]

        results = await asyncio.wait_for(
            asyncio.gather(*(last(s) for s in streams), return_exceptions=True), 60
        )
        with pytest.raises(EngineDeadError):
            allm.add_request(VICTIM, VICTIM_PARAMS)
        with pytest.raises(EngineDeadError):
            allm.check_alive()
        return results

    results = asyncio.run(main())
    for r in results:  # each stream ends: its error output, or the engine's death
        assert isinstance(r, EngineDeadError) or (
            isinstance(r, RequestOutput) and r.finish_reason == "error"
        ), r


def test_a_validation_that_would_freeze_the_process_is_a_refusal_in_time(loaded_model):
    """xgrammar ignores the chained `if`/`then` (the output is a JSON string); validating it
    would hold the GIL for ~45 s: its worker is killed at the deadline, and the engine, which
    never waited, answers `validated=False` with the reason."""
    import time

    from hostile import FREEZER

    llm = LLM(loaded=loaded_model, kv_cache_memory=32 << 20, validation_timeout_s=0.3)
    chat = llm.engine.apply_chat_template([{"role": "user", "content": QUESTION}])
    params = SamplingParams(
        max_tokens=16, temperature=0, structured=StructuredOutput(json_schema=FREEZER)
    )
    start = time.monotonic()
    out = llm.generate(chat, params)[0]
    assert time.monotonic() - start < 30
    assert out.validated is False and out.finish_reason == "error"
    assert "did not finish within 0.3 s" in out.warnings[-1]
    llm.engine.grammars.shutdown()
    llm.engine.chat.close()
