"""The engine core in a process of its own (services/engine/core.py) against its plain twin, the
engine thread in this process (`AsyncLLM`): the same tokens for constrained rows of every kind,
every KV policy, speculation, logprobs, stop strings and prefix-cache hits; then the faults a
replica must survive: the core SIGKILLed mid-stream, a hung loop, a core that cannot start.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import replace
from typing import Any

import pytest

from services import KVPolicy, SamplingParams, StructuredOutput
from services.engine.async_llm import AsyncLLM, EngineDeadError
from services.engine.config import EngineConfig
from services.engine.core_client import CoreClient, CoreStartError, EngineRestarting
from services.engine.engine import LLMEngine
from services.telemetry import TelemetrySettings

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
STORY = (
    "The lighthouse keeper wrote in his log every evening. On Monday the sea was calm. On "
    "Tuesday a storm came from the north. The secret word is marigold. Question: what is the "
    "secret word? Answer:"
)
CONFIG = EngineConfig(
    kv_cache_memory=64 << 20,
    max_num_seqs=8,
    enable_prefix_caching=True,
    speculative={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
)


def requests() -> list[tuple[Any, SamplingParams]]:
    """(chat messages or a prompt, params): every kind the twin must match."""
    greedy = {"temperature": 0.0, "max_tokens": 32}
    kinds = [
        StructuredOutput(json_schema=PERSON),
        StructuredOutput(regex=r"\d{3}-\d{3}-\d{4}"),
        StructuredOutput(choice=["red", "green", "blue"]),
        StructuredOutput(grammar='root ::= "yes" | "no"'),
        StructuredOutput(json_object=True),
    ]
    out: list[tuple[Any, SamplingParams]] = [
        (
            [{"role": "user", "content": "Describe a person as JSON."}],
            SamplingParams(**greedy, structured=s),
        )
        for s in kinds
    ]
    for kind in ("window", "sinks", "h2o", "snapkv", "quest"):
        kv = KVPolicy(
            kind=kind, budget_tokens=32, **({"dense_layers": 2} if kind == "quest" else {})
        )
        out.append((STORY, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, kv=kv)))
    out += [
        (STORY, SamplingParams(max_tokens=24, temperature=0.0, logprobs=3, stop=["."])),
        (STORY, SamplingParams(max_tokens=24, temperature=0.0)),  # a prefix-cache hit
        (STORY, SamplingParams(max_tokens=16, temperature=0.8, seed=7)),
    ]
    return out


async def run_one(llm: Any, prompt: Any, params: SamplingParams) -> Any:
    if isinstance(prompt, list):
        ids = await llm.encoder.encode(messages=prompt, template={"add_generation_prompt": True})
    else:
        ids = await llm.encoder.encode(prompt)
    last = None
    async for out in llm.add_request(ids, params):
        last = out
    return last


def answers(llm: Any) -> list[Any]:
    async def all_of() -> list[Any]:  # one at a time: the same batches on both sides
        return [await run_one(llm, p, s) for p, s in requests()]

    return asyncio.run(all_of())


@pytest.fixture(scope="module")
def core():  # telemetry on: the core keeps its metrics and hands them over with its beats
    client = CoreClient(CONFIG, timeout_s=3.0, telemetry_settings=TelemetrySettings())
    yield client
    client.shutdown()


def test_the_core_process_gives_every_request_the_same_tokens_as_the_engine_thread(core):
    thread = AsyncLLM(LLMEngine(CONFIG))
    try:
        expected = answers(thread)
    finally:
        thread.shutdown()
    got = answers(core)
    for want, have in zip(expected, got, strict=True):
        assert have.finish_reason in ("stop", "length"), have.warnings
        assert have.token_ids == want.token_ids
        assert have.text == want.text
        assert have.finish_reason == want.finish_reason
        assert have.validated == want.validated
        assert have.metrics.num_cached_tokens == want.metrics.num_cached_tokens
        assert have.metrics.num_draft_tokens == want.metrics.num_draft_tokens
        assert (have.logprobs is None) == (want.logprobs is None)
        if want.logprobs is not None:
            assert [t.token_id for t in have.logprobs] == [t.token_id for t in want.logprobs]
    assert got[-2].metrics.num_cached_tokens > 0  # the repeated story hit the prefix cache
    assert sum(o.metrics.num_draft_tokens for o in got) > 0  # and speculation drafted


def test_a_dropped_stream_is_aborted_and_its_neighbours_go_on(core):
    async def main() -> tuple[int, Any]:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        ids = await core.encoder.encode(STORY)
        victim = asyncio.create_task(run_one(core, STORY, SamplingParams(max_tokens=20)))
        dropped = 0
        for _ in range(6):  # open and drop streams beside the victim
            stream = core.add_request(ids, params).__aiter__()
            await stream.__anext__()
            await stream.aclose()  # as a client that goes away: an abort
            dropped += 1
        victim_out = await victim
        for _ in range(100):  # the last abort's output comes back from the core
            if not core._streams:
                break
            await asyncio.sleep(0.05)
        return dropped, victim_out

    dropped, victim = asyncio.run(main())
    assert dropped == 6
    assert victim.finish_reason == "length" and len(victim.token_ids) == 20
    assert not core._streams  # every dropped stream forgotten


def test_the_cores_metrics_reach_the_replica(core):
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    structured = StructuredOutput(json_schema=PERSON)
    asyncio.run(run_one(core, ask, SamplingParams(max_tokens=16, structured=structured)))
    time.sleep(2.5)  # a beat carries them once a second
    families = {f["name"]: f for f in core.metrics}
    assert families["structserve_kv_pages_capacity"]["points"][0]["value"] > 0
    assert families["structserve_grammar_mask_fill_seconds"]["points"][0]["count"] > 0
    assert "structserve_prefix_cache_queries" in " ".join(families)


def kill_mid_stream(core: CoreClient, kill: Any) -> tuple[float, list[Any]]:
    """Starts three long streams, applies `kill` after their first tokens; how long until every
    stream ended, and how each ended."""

    async def one(ids: list[int]) -> Any:
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        try:
            async for out in core.add_request(ids, params):
                if out.finished:
                    return out
        except EngineDeadError as exc:
            return exc
        return None

    async def main() -> tuple[float, list[Any]]:
        ids = await core.encoder.encode(STORY)
        tasks = [asyncio.create_task(one(ids)) for _ in range(3)]
        await asyncio.sleep(1.0)
        began = time.monotonic()
        kill()
        ended = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
        return time.monotonic() - began, ended

    return asyncio.run(main())


def after_restart(core: CoreClient) -> Any:
    async def main() -> Any:
        with pytest.raises(EngineRestarting):
            core.add_request([1, 2, 3], SamplingParams(max_tokens=2))
        await core.wait_ready(120)
        return await run_one(core, STORY, SamplingParams(max_tokens=8, temperature=0.0))

    return asyncio.run(main())


@pytest.mark.parametrize("fault", ["sigkill", "hang"])
def test_a_core_killed_or_hung_mid_stream_fails_its_streams_at_once_and_comes_back(core, fault):
    before = asyncio.run(run_one(core, STORY, SamplingParams(max_tokens=8, temperature=0.0)))
    restarts = core.restarts
    if fault == "sigkill":
        took, ended = kill_mid_stream(core, lambda: os.kill(core.pid, signal.SIGKILL))
    else:
        took, ended = kill_mid_stream(core, lambda: core.inject("hang", 120.0))
    assert all(isinstance(e, EngineDeadError) for e in ended), ended
    assert took < 5.0 if fault == "sigkill" else took < core.timeout_s + 5.0
    assert core.state == "restarting"
    core.check_alive()  # restarting is alive: /healthz says so, Ray does not kill the replica
    again = after_restart(core)
    assert core.state == "ready" and core.restarts == restarts + 1
    assert again.token_ids == before.token_ids


def test_a_core_that_cannot_start_says_why():
    began = time.monotonic()
    with pytest.raises(CoreStartError, match="no-such-model"):
        CoreClient(replace(CONFIG, model="/no-such-model"), start_timeout_s=120)
    assert time.monotonic() - began < 120


def test_a_core_that_cannot_restart_is_down_with_its_reason_not_in_a_loop():
    client = CoreClient(
        replace(CONFIG, enable_prefix_caching=False, speculative=None), timeout_s=3.0
    )
    try:
        client.config = replace(client.config, model="/no-such-model")  # the next start fails
        os.kill(client.pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while client.state != "failed" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.state == "failed"
        with pytest.raises(EngineDeadError, match="no-such-model"):
            client.check_alive()
        time.sleep(1.0)
        assert client.restarts == 1  # tried once, then stayed down for the operator to see
    finally:
        client.shutdown()
