"""Slots and parking: a request takes its adapter's slot (loaded once), waits when every slot is
held by other adapters, and the least recently used unheld adapter leaves first."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from services.lora.layers import LoRASlots
from services.lora.manager import AdapterManager, LoRARequest
from tests.lora_adapters import write_peft
from tests.unit.test_lora_layers import CONFIG


def adapter(folder, rank=4):
    write_peft(folder, CONFIG, rank, ("q_proj",), layers=(0,))
    return LoRARequest(folder.name, str(folder))


def settle(manager, requests=()):
    """Waits for the reads in flight and parks them, as the engine's next step would."""
    for _, read in list(manager.reading.values()):
        read.exception(timeout=30)
    return manager.resolve(list(requests))


def named(name):
    return SimpleNamespace(lora_name=name, finished=False)


@pytest.fixture
def manager():
    slots = LoRASlots(LlamaForCausalLM(CONFIG), max_loras=2, max_rank=8)
    return AdapterManager(slots, max_cpu_loras=3, max_bytes=1 << 20)


def test_slots_are_shared_reused_and_waited_for(manager, tmp_path):
    a, b, c = (adapter(tmp_path / n) for n in "abc")
    for lora in (a, b, c):
        manager.register(lora)
    settle(manager)
    assert manager.acquire("a") == manager.acquire("a") == 0  # one load for two requests
    assert manager.acquire("b") == 1 and manager.loads == 2
    assert manager.acquire("c") is None  # both slots held by others: c waits
    manager.release("b")
    assert manager.acquire("c") == 1 and manager.loads == 3  # b's slot, b unheld
    manager.release("a")
    manager.release("a")
    manager.release("c")
    assert manager.acquire("b") == 0  # a was the least recently used unheld adapter


def test_parking_keeps_what_requests_name_and_weights_by_identity(manager, tmp_path):
    loras = [adapter(tmp_path / n) for n in "abcd"]
    for lora in loras[:3]:
        manager.register(lora)
    settle(manager)
    manager.register(loras[3])
    settle(manager, [named("a")])  # 4 > 3 parked: b leaves, not a (a request names it)
    assert list(manager.parked) == ["a", "c", "d"]
    before = manager.scope("c")
    (tmp_path / "c" / "adapter_model.safetensors").write_bytes(b"")  # rewritten in place
    with pytest.raises(ValueError, match="safetensors"):
        manager.register(loras[2])
    assert manager.scope("c") == before  # the checked weights stay until new ones check out


def test_a_request_waits_while_its_weights_are_read_and_bad_weights_fail_it(manager, tmp_path):
    good, bad = adapter(tmp_path / "good"), adapter(tmp_path / "bad")
    weights = tmp_path / "bad" / "adapter_model.safetensors"
    tensors = load_file(weights)
    first = next(iter(tensors))
    tensors[first] = torch.full_like(tensors[first], float("nan"))
    save_file(tensors, weights)  # shapes fit: only reading the values shows it
    manager.register(good)
    manager.register(bad)  # checked at once: config, header and shapes are fine
    assert manager.acquire("good") is None  # its request waits until a step parks it
    victim, hostile = named("good"), named("bad")
    failed = settle(manager, [victim, hostile])
    assert [(r.lora_name, "NaN" in why) for r, why in failed] == [("bad", True)]
    assert manager.acquire("good") == 0 and "bad" not in manager.parked
