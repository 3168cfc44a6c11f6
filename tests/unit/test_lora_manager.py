"""Slots and parking: a request takes its adapter's slot (loaded once), waits when every slot is
held by other adapters, and the least recently used unheld adapter leaves first."""

from __future__ import annotations

import pytest
from transformers import LlamaForCausalLM

from services.lora.layers import LoRASlots
from services.lora.manager import AdapterManager, LoRARequest
from tests.lora_adapters import write_peft
from tests.unit.test_lora_layers import CONFIG


def adapter(folder, rank=4):
    write_peft(folder, CONFIG, rank, ("q_proj",), layers=(0,))
    return LoRARequest(folder.name, str(folder))


@pytest.fixture
def manager():
    slots = LoRASlots(LlamaForCausalLM(CONFIG), max_loras=2, max_rank=8)
    return AdapterManager(slots, max_cpu_loras=3, max_bytes=1 << 20)


def test_slots_are_shared_reused_and_waited_for(manager, tmp_path):
    a, b, c = (adapter(tmp_path / n) for n in "abc")
    for lora in (a, b, c):
        manager.register(lora)
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
    manager.register(loras[3], keep={"a"})  # 4 > 3 parked: b leaves, not a (a request names it)
    assert list(manager.parked) == ["a", "c", "d"]
    before = manager.scope("c")
    (tmp_path / "c" / "adapter_model.safetensors").write_bytes(b"")  # rewritten in place
    with pytest.raises(ValueError, match="safetensors"):
        manager.register(loras[2])
    assert manager.scope("c") == before  # the checked weights stay until new ones check out
