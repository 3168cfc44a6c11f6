"""LoRA adapters over HTTP with the real `openai` client: two tenants each register their own
adapter (`POST /v1/adapters`, and vLLM's `load_lora_adapter`), each sees only its own in
`/v1/models`, the other's name is a 404 for every verb, completions on an adapter are its own
(not the base model's, not the other tenant's), with a JSON schema and with tool calls; each
hostile adapter is refused with a 400 naming what is wrong while a victim's stream goes on."""

from __future__ import annotations

import json
import os
import uuid

import jsonschema
import openai
import pytest
import redis
import requests
from e2e_support import KEY_A, KEY_B, redis_url
from transformers import AutoConfig

from services.models.loader import resolve_model_dir
from tests.lora_adapters import write_peft

MODEL = "SmolLM2-135M-Instruct"
PROMPT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def base_config():
    return AutoConfig.from_pretrained(resolve_model_dir(None)[1])


@pytest.fixture(scope="module")
def setup(server, adapter_store, base_config):
    """Tenant A's adapter `support` and tenant B's `b-only` (its own `support` too, other
    weights), registered once for the module."""
    tag = uuid.uuid4().hex[:8]
    # strong enough to change the greedy text (not so strong that it stops being text)
    write_peft(adapter_store / f"a-{tag}", base_config, 8, ("q_proj", "v_proj"), b_scale=0.2)
    write_peft(adapter_store / f"b-{tag}", base_config, 4, ("o_proj", "down_proj"), seed=1,
               b_scale=0.5)  # fmt: skip
    name_a = f"support-{tag}"
    assert register(server, KEY_A, name_a, f"a-{tag}").status_code == 201
    assert register(server, KEY_B, name_a, f"b-{tag}").status_code == 201  # names are per tenant
    load = requests.post(
        f"{server}/v1/load_lora_adapter",
        json={"lora_name": f"b-only-{tag}", "lora_path": f"b-{tag}"},
        headers=auth(KEY_B),
        timeout=60,
    )
    assert load.status_code == 200 and "added successfully" in load.text
    yield {"a": name_a, "b_only": f"b-only-{tag}", "tag": tag}
    for key, name in ((KEY_A, name_a), (KEY_B, name_a), (KEY_B, f"b-only-{tag}")):
        requests.delete(f"{server}/v1/adapters/{name}", headers=auth(key), timeout=30)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def register(server: str, key: str, name: str, source: str) -> requests.Response:
    body = {"name": name, "source": source}
    return requests.post(f"{server}/v1/adapters", json=body, headers=auth(key), timeout=60)


def client(server: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=key, max_retries=0, timeout=120)


def greedy(c: openai.OpenAI, model: str, **extra) -> str:
    out = c.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=8, temperature=0, **extra
    )
    return out.choices[0].message.content or ""


def test_each_tenant_sees_and_uses_only_its_own_adapters(server, setup):
    a, b = client(server, KEY_A), client(server, KEY_B)
    seen_a = {m.id for m in a.models.list()}
    seen_b = {m.id for m in b.models.list()}
    assert {MODEL, setup["a"]} <= seen_a and setup["b_only"] not in seen_a
    assert {MODEL, setup["a"], setup["b_only"]} <= seen_b
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        greedy(a, setup["b_only"])
    for verb in (requests.get, requests.delete):  # the same 404 as a name never registered
        got = verb(f"{server}/v1/adapters/{setup['b_only']}", headers=auth(KEY_A), timeout=30)
        assert got.status_code == 404 and got.json()["error"]["code"] == "model_not_found"
    mine = requests.get(f"{server}/v1/adapters", headers=auth(KEY_A), timeout=30).json()
    assert [d["name"] for d in mine["data"]] == [setup["a"]]
    assert mine["data"][0]["rank"] == 8 and mine["data"][0]["target_modules"] == [
        "q_proj",
        "v_proj",
    ]
    base = greedy(a, MODEL)
    on_a = greedy(a, setup["a"])
    assert on_a == greedy(a, setup["a"])  # deterministic on the adapter
    assert on_a != base  # the adapter's weights took part
    assert greedy(b, setup["a"]) != on_a  # B's `support`: B's weights, not A's


def test_registrations_persist_in_redis(server, setup):
    stored = redis.Redis.from_url(redis_url(11)).hkeys("structserve:tenant:tenant-a:adapters")
    assert setup["a"].encode() in stored


def test_structured_output_and_tool_calls_on_an_adapter(server, setup):
    a = client(server, KEY_A)
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 12}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    out = a.chat.completions.create(
        model=setup["a"],
        messages=PROMPT,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    tool = {
        "type": "function",
        "function": {
            "name": "paint",
            "parameters": {
                "type": "object",
                "properties": {"colour": {"type": "string", "maxLength": 12}},
                "required": ["colour"],
            },
        },
    }
    out = a.chat.completions.create(
        model=setup["a"],
        messages=PROMPT,
        max_tokens=60,
        temperature=0,
        tools=[tool],
        tool_choice="required",
    )
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "paint" and "colour" in json.loads(call.function.arguments)


def hostile_adapters(store, config, tag):
    """(source, the field the 400 must name) for each bad adapter."""
    bad = {}
    folder = store / f"missing-{tag}"
    folder.mkdir()
    bad[folder.name] = "adapter_config.json"
    other = type(config).from_dict({**config.to_dict(), "intermediate_size": 64})
    bad[write_peft(store / f"shape-{tag}", other, 4, ("up_proj",)).name] = (
        "adapter_model.safetensors"  # another model's MLP width
    )
    bad[write_peft(store / f"rank-{tag}", config, 64, ("q_proj",)).name] = "adapter_config.r"
    folder = write_peft(store / f"mods-{tag}", config, 4, ("q_proj",))
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["lm_x"]}))
    bad[folder.name] = "adapter_config.target_modules"
    folder = write_peft(store / f"nan-{tag}", config, 4, ("q_proj",), b_scale=float("nan"))
    bad[folder.name] = "adapter_model.safetensors"
    folder = write_peft(store / f"huge-{tag}", config, 4, ("q_proj",))
    os.truncate(folder / "adapter_model.safetensors", 10 << 30)  # sparse: 10 GB by stat
    bad[folder.name] = "adapter_model.safetensors"
    outside = write_peft(store.parent / f"outside-{tag}", config, 4, ("q_proj",))
    os.symlink(outside, store / f"link-{tag}")
    bad[f"link-{tag}"] = "source"
    bad[f"../outside-{tag}"] = "source"
    return bad


def test_hostile_adapters_are_refused_beside_a_victim(server, setup, adapter_store, base_config):
    a, b = client(server, KEY_A), client(server, KEY_B)
    expected = greedy(a, setup["a"])
    victim = a.chat.completions.create(
        model=setup["a"], messages=PROMPT, max_tokens=8, temperature=0, stream=True
    )
    first = next(iter(victim))  # streaming while the registrations are refused
    for source, field in hostile_adapters(adapter_store, base_config, setup["tag"]).items():
        got = register(server, KEY_B, f"bad-{uuid.uuid4().hex[:6]}", source)
        assert got.status_code == 400, (source, got.text)
        assert got.json()["error"]["message"].startswith(field), (source, got.text)
    text = (first.choices[0].delta.content or "") + "".join(
        c.choices[0].delta.content or "" for c in victim if c.choices
    )
    assert text == expected
    names = {m.id for m in b.models.list()}
    assert not any(n.startswith("bad-") for n in names)  # nothing was kept


def test_names_and_caps(server, setup, adapter_store, base_config):
    taken = register(server, KEY_A, MODEL, f"a-{setup['tag']}")
    assert taken.status_code == 409
    again = register(server, KEY_A, setup["a"], f"a-{setup['tag']}")
    assert again.status_code == 409
    # B holds two of its cap of three: one more fits, the next is a 429 naming the cap
    extra = f"extra-{setup['tag']}"
    assert register(server, KEY_B, extra, f"b-{setup['tag']}").status_code == 201
    try:
        over = register(server, KEY_B, f"over-{setup['tag']}", f"b-{setup['tag']}")
        assert over.status_code == 429 and over.json()["error"]["code"] == "adapters_cap"
    finally:
        requests.delete(f"{server}/v1/adapters/{extra}", headers=auth(KEY_B), timeout=30)
    gone = requests.post(
        f"{server}/v1/unload_lora_adapter",
        json={"lora_name": extra},
        headers=auth(KEY_B),
        timeout=30,
    )
    assert gone.status_code == 404  # deleted above
    out = requests.post(
        f"{server}/v1/load_lora_adapter",
        json={"lora_name": "escape", "lora_path": "../etc"},
        headers=auth(KEY_B),
        timeout=30,
    )
    assert out.status_code == 400 and out.json()["error"]["param"] == "lora_path"
