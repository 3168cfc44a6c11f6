"""Engine metric families on the real model, read through the SDK's in-memory metric reader: each
moves when its event happens (requests queued, admitted, finished; masks filled; a forced span
jumped; pages parked in the KV host tier and read back)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from services import KVPolicy, SamplingParams, StructuredOutput
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.stats import EngineStats
from services.telemetry import Telemetry, TelemetrySettings


@pytest.fixture(scope="module")
def engine(loaded_model):
    cfg = EngineConfig(
        kv_cache_memory=32 << 20, jump_forward=True, grammar_workers=0, kv_tier_pages=64
    )
    eng = LLMEngine(cfg, loaded=loaded_model)
    yield eng
    eng.grammars.shutdown()


@pytest.fixture()
def observed(engine):
    reader = InMemoryMetricReader()
    tel = Telemetry(TelemetrySettings(), "test", metric_readers=[reader])
    stats = EngineStats(engine, tel)
    yield SimpleNamespace(reader=reader, stats=stats)
    stats.close()
    tel.shutdown()


def value(reader, name: str, **labels: str) -> float:
    total = 0.0
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    for p in m.data.data_points:
                        if all(p.attributes.get(k) == v for k, v in labels.items()):
                            total += p.count if hasattr(p, "bucket_counts") else p.value
    return total


def run(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        for req in engine.step():
            if req.finished:
                engine.release(req.request_id)


def test_queue_batch_and_pages_follow_the_requests(engine, observed):
    r = observed.reader
    assert value(r, "structserve.kv.pages_capacity") == engine.runner.kv.num_pages
    assert value(r, "structserve.queue_depth") == 0
    for i in range(3):
        engine.add_request(f"Count to {i + 3}:", SamplingParams(max_tokens=4, temperature=0))
    assert value(r, "structserve.queue_depth") == 3
    assert value(r, "structserve.running_requests") == 0
    engine.step()
    assert value(r, "structserve.queue_depth") == 0
    assert value(r, "structserve.running_requests") == 3
    assert value(r, "structserve.kv.pages_in_use") >= 3
    run(engine)
    assert value(r, "structserve.running_requests") == 0
    assert value(r, "structserve.kv.pages_in_use") == 0


def test_masks_and_jump_forward_count_their_work(engine, observed):
    r = observed.reader
    masks = value(r, "structserve.grammar.mask_fill")
    jumped = value(r, "structserve.jump_forward.tokens")
    saved = value(r, "structserve.forward_passes_saved")
    answer = "The answer is forty-two, as everyone knows"
    req = engine.add_request(
        "What is the answer?",
        SamplingParams(max_tokens=32, temperature=0, structured=StructuredOutput(choice=[answer])),
    )
    run(engine)
    assert req.detokenizer.text == answer
    assert value(r, "structserve.grammar.mask_fill") > masks
    forced = req.metrics.num_forced_tokens
    assert forced > 0
    assert value(r, "structserve.forward_passes_saved") == saved + forced
    assert value(r, "structserve.jump_forward.tokens") >= jumped + forced


def test_finished_requests_feed_ttft_and_tpot(engine, observed):
    r = observed.reader
    req = engine.add_request("Hello", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    run(engine)
    observed.stats.finished(req.metrics, constrained=False, parent=None)
    assert value(r, "structserve.time_to_first_token", constrained="false") == 1
    assert value(r, "structserve.time_per_output_token", constrained="false") == 1


def test_kv_tier_families_follow_parked_and_selected_pages(engine, observed):
    r = observed.reader
    names = ("structserve.kv.pages_parked", "structserve.kv.pages_recalled")
    before = [value(r, n) for n in names]
    to_host = value(r, "structserve.kv.tier_transfer", direction="to_host")
    selected = value(r, "structserve.kv.tier_selections")
    reads = value(r, "structserve.kv.host_read_latency")
    quest = KVPolicy(kind="quest", budget_tokens=32, offload=True, hot_pages=1)
    story = "The keeper of the lighthouse wrote in his log every single evening. " * 20
    req = engine.add_request(story, SamplingParams(max_tokens=8, temperature=0, kv=quest))
    for _ in range(4):  # prompt chunks of the budget's size: cold pages are parked as they fill
        engine.step()
    assert value(r, "structserve.kv.host_bytes_in_use") > 0
    run(engine)
    assert req.finish_reason in ("stop", "length")
    parked, recalled = (value(r, n) - b for n, b in zip(names, before, strict=True))
    assert parked > 0 and recalled > 0
    assert value(r, "structserve.kv.tier_transfer", direction="to_host") > to_host
    assert value(r, "structserve.kv.tier_selections") > selected
    # one histogram sample per host read: a layer's parked cells, read in one copy per step
    assert value(r, "structserve.kv.host_read_latency") - reads > 0
    assert value(r, "structserve.kv.host_bytes_in_use") == 0


def test_speculative_drafts_count_proposed_accepted_and_passes_saved(loaded_model):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    eng = LLMEngine(EngineConfig(kv_cache_memory=32 << 20, speculative=spec), loaded=loaded_model)
    reader = InMemoryMetricReader()
    tel = Telemetry(TelemetrySettings(), "test", metric_readers=[reader])
    stats = EngineStats(eng, tel)
    text = "one fish, two fish, red fish, blue fish; " * 3
    req = eng.add_request(text, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    run(eng)
    m = req.metrics
    assert m.num_accepted_draft_tokens > 0
    assert value(reader, "structserve.speculative.draft_tokens", result="proposed") == (
        m.num_draft_tokens
    )
    accepted = value(reader, "structserve.speculative.draft_tokens", result="accepted")
    assert accepted == m.num_accepted_draft_tokens
    assert value(reader, "structserve.forward_passes_saved", source="speculative") == accepted
    stats.close()
    tel.shutdown()
    eng.grammars.shutdown()
