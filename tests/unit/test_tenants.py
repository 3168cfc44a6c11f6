"""API keys at the ingress (deployments/tenants.py): revoked without a restart (the keys file read
again when it changes, Redis keys looked up per request), tenant names and digests checked."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path

import fakeredis
import pytest

from deployments.quota import LimitError
from deployments.service_config import ServiceConfig
from deployments.tenants import (
    AuthError,
    Tenants,
    add_key,
    digest,
    list_keys,
    parse_keys,
    revoke_key,
)


def who(tenants: Tenants, key: str) -> str | None:
    try:
        return asyncio.run(tenants.authenticate(f"Bearer {key}"))
    except AuthError:
        return None


def write_keys(path: Path, keys: dict[str, list[str]], stamp: float) -> None:
    path.write_text(json.dumps({t: [digest(k) for k in ks] for t, ks in keys.items()}))
    os.utime(path, (stamp, stamp))  # a distinct mtime, as a Secret's update gives


def test_the_keys_file_is_read_again_when_it_changes(tmp_path: Path, monkeypatch) -> None:
    import deployments.tenants as tenants_mod

    monkeypatch.setattr(tenants_mod, "RELOAD_S", 0.0)
    path = tmp_path / "keys.json"
    write_keys(path, {"acme": ["sk-acme"], "beta": ["sk-beta"]}, 1000)
    tenants = Tenants(ServiceConfig(api_keys_file=str(path)))
    assert (who(tenants, "sk-acme"), who(tenants, "sk-beta")) == ("acme", "beta")
    write_keys(path, {"beta": ["sk-beta", "sk-beta2"]}, 2000)  # acme's key revoked
    assert who(tenants, "sk-acme") is None
    assert (who(tenants, "sk-beta"), who(tenants, "sk-beta2")) == ("beta", "beta")
    path.write_text("{not json")  # a broken update keeps the keys read before
    os.utime(path, (3000, 3000))
    assert who(tenants, "sk-beta2") == "beta"
    write_keys(path, {"bad name": ["sk-x"]}, 4000)  # so does an invalid tenant name
    assert who(tenants, "sk-beta2") == "beta" and who(tenants, "sk-x") is None


def test_redis_keys_are_revoked_for_the_next_request() -> None:
    client = fakeredis.FakeRedis()
    tenants = Tenants(ServiceConfig(), redis=client)
    add_key(client, "acme", "sk-live")
    d = add_key(client, "acme", "sk-other")
    assert who(tenants, "sk-live") == "acme"
    assert [t for _, t in list_keys(client)] == ["acme", "acme"]
    assert revoke_key(client, "sk-live")  # by the key
    assert who(tenants, "sk-live") is None
    assert revoke_key(client, d.upper())  # by its digest, any case
    assert who(tenants, "sk-other") is None
    assert not revoke_key(client, "sk-live")  # already gone


@pytest.mark.parametrize(
    "raw, fragment",
    [
        ({"a b": [digest("k")]}, "tenant name"),
        ({"x" * 65: [digest("k")]}, "tenant name"),
        ({"acme": ["not-a-digest"]}, "not a sha256"),
        ({"acme": digest("k")}, "expected a list"),
        ([digest("k")], "expected an object"),
    ],
)
def test_a_keys_file_names_its_first_problem(raw: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_keys(raw)


def test_tenant_names_are_checked_wherever_they_come_from() -> None:
    with pytest.raises(ValueError, match="tenant name"):
        add_key(fakeredis.FakeRedis(), "acme:grammars", "sk-x")  # would reach into Redis keys
    with pytest.raises(ValueError, match="name"):
        ServiceConfig.model_validate({"tenants": [{"name": "a{b}"}]})
    assert parse_keys({"ok.name-1_2": [digest("k").upper()]}) == [(digest("k"), "ok.name-1_2")]


def test_a_request_cancelled_while_its_slot_is_taken_gives_it_back() -> None:
    """The client leaves (its handler is cancelled) while the limit is consulted: the slot the
    thread goes on to take is released once it has it, not held for ever."""
    tenants = Tenants(ServiceConfig(tenants=[{"name": "one", "limits": {"max_concurrent": 1}}]))
    take, gate = tenants.quota.admit, threading.Event()

    def slow(*args: object) -> object:
        gate.wait(5)
        return take(*args)

    async def main() -> None:
        tenants.quota.admit = slow  # type: ignore[method-assign]
        task = asyncio.create_task(tenants.admit("one"))
        await asyncio.sleep(0.05)
        task.cancel()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        tenants.quota.admit = take  # type: ignore[method-assign]
        for _ in range(50):  # the thread finishes, then the release runs
            await asyncio.sleep(0.02)
            try:
                tenants.release(await tenants.admit("one"))
                return
            except LimitError:
                continue
        raise AssertionError("the cancelled request's slot was never released")

    asyncio.run(main())
