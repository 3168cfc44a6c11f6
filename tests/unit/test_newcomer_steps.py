"""Newcomer steps (EngineConfig.newcomer_steps): a tenant with nothing running has its first
chunk computed in a step of its own, never two such steps in a row; the plain twin mixes it into
the batch. Step by step on a simulated engine (no model)."""

from __future__ import annotations

import torch

from services.engine.config import EngineConfig
from services.engine.fair_policy import NEWCOMER_GAP
from tests.unit.test_fair_scheduler import request, sched, step


def tenants(chunks: list) -> list[str]:
    return [c.request.tenant for c in chunks]


def busy_with_a(newcomer_steps: bool, **cfg):
    s = sched(newcomer_steps=newcomer_steps, **cfg)
    for i in range(4):
        s.add(request(f"a{i}", "a"))
    step(s)  # A's prompts
    return s


def test_a_newcomer_gets_a_step_of_its_own_then_joins_the_batch():
    s = busy_with_a(True)
    s.add(request("b0", "b"))
    first = step(s)
    assert tenants(first) == ["b"] and first[0].num_tokens == 8  # B alone, its whole prompt
    assert sorted(tenants(step(s))) == ["a"] * 4 + ["b"]  # then everyone decodes


def test_never_two_newcomer_steps_in_a_row():
    s = busy_with_a(True)
    s.add(request("b0", "b"))
    assert tenants(step(s)) == ["b"]
    s.add(request("c0", "c"))
    assert sorted(tenants(step(s))) == ["a"] * 4 + ["b", "c"]  # c waits for no extra step


def test_a_tenant_has_one_newcomer_step_in_a_gap():
    s = busy_with_a(True)
    s.add(request("b0", "b", max_tokens=1))
    assert tenants(step(s)) == ["b"]
    s.finish(s.running[-1])  # b is done at once and sends its next request
    step(s)
    s.add(request("b1", "b"))
    assert sorted(tenants(step(s))) == ["a"] * 4 + ["b"]  # within NEWCOMER_GAP: no step of its own
    for _ in range(NEWCOMER_GAP):
        step(s)
    s.finish(next(r for r in s.running if r.tenant == "b"))
    s.add(request("b2", "b"))
    assert tenants(step(s)) == ["b"]


def test_newcomers_arriving_together_share_their_step():
    s = busy_with_a(True)
    s.add(request("b0", "b"))
    s.add(request("c0", "c"))
    assert sorted(tenants(step(s))) == ["b", "c"]


def test_a_running_tenants_new_request_is_not_a_newcomer():
    s = busy_with_a(True)
    s.add(request("a9", "a"))
    assert sorted(tenants(step(s))) == ["a"] * 5


def test_a_newcomer_on_an_idle_engine_is_an_ordinary_step():
    s = sched(newcomer_steps=True)
    s.add(request("b0", "b"))
    s.add(request("a0", "a"))
    assert sorted(tenants(step(s))) == ["a", "b"]


def test_a_full_batch_gives_the_newcomer_a_slot_first():
    s = busy_with_a(True, max_num_seqs=4)
    s.add(request("b0", "b"))
    out = step(s)
    assert tenants(out) == ["b"]
    assert sorted(r.tenant for r in s.running) == ["a"] * 3 + ["b"]


def test_the_plain_twin_mixes_the_newcomer_into_the_batch():
    s = busy_with_a(False)
    s.add(request("b0", "b"))
    assert sorted(tenants(step(s))) == ["a"] * 4 + ["b"]


def test_on_by_default_for_cpu_off_for_cuda_and_never_without_fair_scheduling():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert EngineConfig().newcomer_steps_on(cpu)
    assert not EngineConfig().newcomer_steps_on(cuda)
    assert EngineConfig(newcomer_steps=True).newcomer_steps_on(cuda)
    assert not EngineConfig(newcomer_steps=False).newcomer_steps_on(cpu)
    assert not EngineConfig(fair_scheduling=False, newcomer_steps=True).newcomer_steps_on(cpu)
