"""Adapter registrations (services/lora/registry.py) on fakeredis: scoped by tenant, capped in
count and bytes, the base model's and the operator's names untakeable; vLLM's LoRA flags."""

from __future__ import annotations

import fakeredis
import pytest

from deployments.cli import build_config
from grammar_registry.registrations import RegistrationError
from services.lora.registry import AdapterCaps, AdapterRecord, AdapterRegistry, engine_name


def record(name, size=100, operator=False):
    return AdapterRecord(
        name=name, source=f"src/{name}", rank=4, target_modules=["q_proj"], bytes=size,
        operator=operator,
    )  # fmt: skip


@pytest.fixture
def registry():
    caps = AdapterCaps(max_adapters=2, max_bytes=250)
    ops = {"shared": record("shared", operator=True)}
    return AdapterRegistry(fakeredis.FakeRedis(), caps, ops)


def status(fn, *args):
    with pytest.raises(RegistrationError) as err:
        fn(*args)
    return err.value.status


def test_each_tenant_has_its_own_names(registry):
    registry.add("a", record("mine"))
    registry.add("b", record("mine", size=50))  # the same name, another tenant: fine
    assert registry.get("b", "mine").bytes == 50
    assert status(registry.get, "b", "only-a") == status(registry.get, "b", "never") == 404
    registry.add("a", record("only-a"))
    assert status(registry.get, "b", "only-a") == status(registry.delete, "b", "only-a") == 404
    assert [r.name for r in registry.list("a", with_modules=True)] == ["shared", "mine", "only-a"]
    assert engine_name("a", registry.get("a", "mine")) != engine_name(
        "b", registry.get("b", "mine")
    )
    assert engine_name("a", registry.get("a", "shared")) == engine_name(
        "b", registry.get("b", "shared")
    )


def test_names_and_caps(registry):
    assert status(registry.add, "a", record("base"), ("base",)) == 409
    assert status(registry.add, "a", record("shared")) == 409  # the operator's
    assert status(registry.delete, "a", "shared") == 403
    registry.add("a", record("one", size=200))
    assert status(registry.add, "a", record("one")) == 409
    assert status(registry.add, "a", record("two", size=51)) == 429  # 251 bytes > 250
    registry.add("a", record("two", size=50))
    assert status(registry.check_new, "a", "three") == 429  # two of two: before any read
    registry.delete("a", "one")
    registry.check_new("a", "three")


def test_a_dead_store_is_a_503():
    class Dead:
        def __getattr__(self, name):
            def fail(*args):
                raise ConnectionError("down")

            return fail

    assert status(AdapterRegistry(Dead()).get, "a", "x") == 503


def test_vllm_lora_flags():
    import argparse

    args = argparse.Namespace(
        config=None, model=None, redis_url=None, port=None, host="127.0.0.1",
        lora_modules=["sql=/models/sql-lora"], adapter_store="/srv/adapters", max_loras=4,
        max_lora_rank=32, enable_lora=False, max_cpu_loras=None,
    )  # fmt: skip
    cfg = build_config(args)
    assert cfg.llm.engine.enable_lora and cfg.llm.engine.max_loras == 4
    assert cfg.llm.engine.max_lora_rank == 32
    assert cfg.adapters.modules == {"sql": "/models/sql-lora"}
    assert cfg.adapters.store == "/srv/adapters"
    with pytest.raises(SystemExit, match="name=path"):
        build_config(argparse.Namespace(**{**vars(args), "lora_modules": ["nopath"]}))
