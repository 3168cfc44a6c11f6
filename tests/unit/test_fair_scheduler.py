"""Fair shares in the scheduler, step by step on a simulated engine (no model, no clock): slots
and tokens converge to the weights, an idle tenant's share goes to the others, the greedy
tenant is preempted first, and the plain twin (`fair=False`) keeps arrival order."""

from __future__ import annotations

from collections import Counter

from kvcache.pages import PageAllocator
from services import SamplingParams
from services.engine.config import SchedulingConfig
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.fair_policy import BATCH_HOLD_S
from services.engine.fairness import BATCH_SUFFIX, FairShares
from services.engine.request import Request
from services.engine.scheduler import Scheduler


def request(rid: str, tenant: str, n_prompt: int = 8, max_tokens: int = 10_000) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(1, n_prompt + 1)),
        params=SamplingParams(max_tokens=max_tokens),
        detokenizer=IncrementalDetokenizer(None, [], ()),
        tenant=tenant,
    )


def sched(weights=None, pages=10_000, fair=True, **cfg) -> Scheduler:
    newcomer = cfg.pop("newcomer_steps", False)
    rows, prefill = cfg.pop("batch_rows", None), cfg.pop("batch_prefill", None)
    config = SchedulingConfig(fair_scheduling=fair, **cfg)
    shares = FairShares(weights or {})
    return Scheduler(config, 4, PageAllocator(pages), shares, newcomer, rows, prefill)


def step(s: Scheduler, tokens: Counter | None = None) -> list:
    """One engine step: schedule, compute, append a token where one is sampled."""
    out = s.schedule()
    for c in out.chunks:
        c.request.num_computed_tokens += c.num_tokens
        if tokens is not None:
            tokens[c.request.tenant] += c.num_tokens
    for c in out.chunks:
        if c.request.num_computed_tokens == c.request.num_tokens:
            c.request.token_ids.append(7)
    return out.chunks


def running(s: Scheduler) -> Counter:
    return Counter(r.tenant for r in s.running)


def test_batch_slots_converge_to_the_weights():
    s = sched({"a": 1, "b": 3}, max_num_seqs=8)
    for i in range(20):
        s.add(request(f"a{i}", "a"))
        s.add(request(f"b{i}", "b"))
    tokens: Counter = Counter()
    for _ in range(40):
        step(s, tokens)
    assert running(s) == {"a": 2, "b": 6}
    decode = Counter()
    for _ in range(40):
        step(s, decode)
    assert decode["b"] == 3 * decode["a"]


def test_a_tenant_arriving_at_a_full_batch_gets_its_share_from_the_greedy_one():
    s = sched(max_num_seqs=8)
    for i in range(16):  # a flood: n=16 streams
        s.add(request(f"a{i}", "a"))
    for _ in range(5):
        step(s)
    assert running(s) == {"a": 8}
    s.add(request("b0", "b"))
    s.add(request("b1", "b"))
    chunks = step(s)
    assert {c.request.request_id for c in chunks} >= {"b0", "b1"}  # admitted at once
    assert running(s) == {"a": 6, "b": 2}
    assert s.num_preemptions == 2


def test_beside_interactive_work_the_batch_class_computes_only_its_oldest_rows():
    batch = "acme" + BATCH_SUFFIX
    s = sched(max_num_seqs=16, batch_rows=2)
    now = [0.0]
    s.clock = lambda: now[0]
    for i in range(12):
        s.add(request(f"l{i}", batch))
    for _ in range(3):
        step(s)
    assert len(step(s)) == 12  # alone, the batch has the whole engine
    pages = {r.request_id: list(r.pages) for r in s.running}
    s.add(request("chat", "beta"))
    for _ in range(4):
        ids = [c.request.request_id for c in step(s)]
        assert ids == ["l0", "l1", "chat"]  # the oldest two lines, the interactive request
    s.add(request("l12", batch))  # no more lines admitted meanwhile
    assert [c.request.request_id for c in step(s)] == ["l0", "l1", "chat"]
    paused = [r for r in s.running if r.request_id not in ("l0", "l1", "chat")]
    assert all(r.pages == pages[r.request_id] for r in paused)  # kept, not recomputed
    assert s.num_preemptions == 0
    s.finish(next(r for r in s.running if r.request_id == "chat"))
    now[0] += BATCH_HOLD_S - 0.1
    assert len(step(s)) == 2  # held narrow a while: the next interactive request may follow
    now[0] += 0.2
    assert len(step(s)) == 13  # then every line again, l12 admitted


def test_the_batch_class_takes_a_wave_of_prompts_over_several_steps():
    batch = "acme" + BATCH_SUFFIX
    s = sched(max_num_seqs=16, batch_prefill=20)
    for i in range(4):
        s.add(request(f"l{i}", batch, n_prompt=10))
    chunks = step(s)
    assert sum(c.num_tokens for c in chunks) == 20  # 40 prompt tokens waiting: 20 this step
    s.add(request("chat", "beta", n_prompt=30))
    chunks = {c.request.request_id: c.num_tokens for c in step(s)}
    assert chunks["chat"] == 30 and sum(chunks.values()) == 30 + 2 + 20  # 2 lines decode
    twin = sched(max_num_seqs=16)
    for i in range(4):
        twin.add(request(f"l{i}", batch, n_prompt=10))
    assert sum(c.num_tokens for c in step(twin)) == 40


def test_the_batch_row_cap_is_off_in_its_plain_twin():
    batch = "acme" + BATCH_SUFFIX
    s = sched(max_num_seqs=16, batch_rows=16)
    for i in range(6):
        s.add(request(f"l{i}", batch))
    step(s)
    s.add(request("chat", "beta"))
    step(s)
    assert len(step(s)) == 7


def test_an_idle_tenants_share_goes_to_the_others_and_idling_earns_no_credit():
    s = sched({"a": 1, "b": 1}, max_num_seqs=4)
    for i in range(8):
        s.add(request(f"a{i}", "a"))
    for _ in range(30):
        step(s)
    assert running(s) == {"a": 4}  # b idle: a has every slot
    busy_a = s.shares.vtime("a")
    s.add(request("b0", "b"))
    assert s.shares.vtime("b") == busy_a > 0  # b starts where a is: no credit for idling
    s.add(request("b1", "b"))
    s.add(request("b2", "b"))
    step(s)
    assert running(s) == {"a": 2, "b": 2}  # equal shares
    decode = Counter()
    for _ in range(10):
        step(s, decode)
    assert decode["a"] == decode["b"]


def test_prefill_tokens_per_step_are_shared_while_both_have_prompts():
    s = sched(max_num_batched_tokens=64, max_num_seqs=8)
    s.add(request("a-long", "a", n_prompt=1000))
    step(s)
    s.add(request("b-short", "b", n_prompt=40))
    chunks = {c.request.request_id: c.num_tokens for c in step(s)}
    assert chunks == {"a-long": 32, "b-short": 32}  # not 64 for a, nothing for b
    chunks = {c.request.request_id: c.num_tokens for c in step(s)}
    assert chunks["b-short"] == 8 and chunks["a-long"] == 56  # b done: a takes the rest


def test_for_pages_the_tenant_furthest_over_its_share_is_preempted_first():
    # 12 pages of 4 tokens; every request needs 3 pages once it decodes past 8 tokens
    s = sched(pages=12, max_num_seqs=8)
    for i in range(3):
        s.add(request(f"a{i}", "a", n_prompt=7))
    step(s)
    s.add(request("b0", "b", n_prompt=7))  # the newest: arrival order would preempt it first
    step(s)
    assert running(s) == {"a": 3, "b": 1}
    preempted = []
    for _ in range(12):
        out = s.schedule()
        preempted += [r.tenant for r in out.preempted]
        for c in out.chunks:
            c.request.num_computed_tokens += c.num_tokens
            if c.request.num_computed_tokens == c.request.num_tokens:
                c.request.token_ids.append(7)
    assert preempted and set(preempted) == {"a"}
    assert any(r.request_id == "b0" for r in s.running)


def test_the_plain_twin_keeps_arrival_order():
    s = sched(max_num_seqs=4, fair=False)
    for i in range(6):
        s.add(request(f"a{i}", "a"))
    s.add(request("b0", "b"))
    for _ in range(3):
        step(s)
    assert running(s) == {"a": 4} and s.num_preemptions == 0


def test_time_spent_for_a_tenant_is_charged_at_the_engine_rate(monkeypatch):
    from services.engine import fairness

    clock = iter([0.0, 0.5, 1.0])
    monkeypatch.setattr(fairness.time, "perf_counter", lambda: next(clock))
    shares = fairness.FairShares({"a": 2.0})
    shares.charge_time("a", 1.0)
    assert shares.vtime("a") == 0  # no rate known yet: nothing to convert with
    shares.stepped(100)
    shares.stepped(50)  # 100 tokens in 0.5 s: 200 a second
    shares.charge_time("a", 0.25)  # 50 tokens' worth, at weight 2
    assert shares.vtime("a") == 25
    shares.stepped(0)
    assert shares._rate == 0.8 * 200 + 0.2 * 100
