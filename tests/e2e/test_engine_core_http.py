"""The engine core in a process of its own (`llm.engine_process`) against the engine on a replica
thread (the plain twin), over HTTP with the real `openai` client: a second application beside
the main one runs the other twin; both answer the same greedy requests with the same tokens
(grammar verdicts fetched through the replica from the GrammarService). SIGKILL of the core
mid-stream ends the stream with an error event within seconds, /healthz says "restarting", a
request sent meanwhile waits and is answered, and the replica is healthy again after."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
import redis
from e2e_support import KEY_A, redis_url, small_config, wait_healthy

from deployments.service_config import IngressConfig, LLMConfig, TenantConfig
from deployments.tenants import digest

MODEL = "SmolLM2-135M-Instruct"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"name": "person", "schema": PERSON}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def apps(proxy, server):
    """(the thread twin's client, the core twin's client, the core twin's app name and base
    URL): the main application's twin is the default's, the second one's the other."""
    from deployments.app import build_app

    base, serve = proxy
    redis.Redis.from_url(redis_url(13)).flushdb()
    main = small_config().llm
    cfg = small_config(
        redis_url=redis_url(13),
        llm=LLMConfig(
            engine=main.engine,
            engine_process=not main.engine_process,
            engine_core_timeout_s=10.0,
            max_ongoing_requests=64,
            max_queued_requests=64,
        ),
        ingress=IngressConfig(num_replicas=1, listener="proxy"),  # beside the main app
        tenants=[TenantConfig(name="tenant-a", api_key_sha256=[digest(KEY_A)])],
    )
    serve.run(build_app(cfg), name="core", route_prefix="/core", blocking=False)
    wait_healthy(f"{base}/core")
    kw = {"api_key": KEY_A, "max_retries": 0, "timeout": 120}
    mine = openai.OpenAI(base_url=f"{base}/core/v1", **kw)
    theirs = openai.OpenAI(base_url=f"{server}/v1", **kw)
    if main.engine_process:
        yield mine, theirs, "structserve", server
    else:
        yield theirs, mine, "core", f"{base}/core"
    serve.delete("core")


def core_pids(app: str) -> list[int]:
    """The engine core processes of the application `app` (children of its LLM replica)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            title = Path(f"/proc/{parent}/cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if b"services.engine.core" in cmdline and f":{app}:LLMReplica".encode() in title:
            found.append(int(entry.name))
    return found


def answer(client: openai.OpenAI, **kw):
    body = {"model": MODEL, "temperature": 0, "max_tokens": 40, **kw}
    return client.chat.completions.create(**body).choices[0]


@pytest.mark.parametrize(
    "kw",
    [
        {
            "messages": [{"role": "user", "content": "Describe a person as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": JSON_SCHEMA},
            "extra_body": {"structured_outputs": {"backend": "xgrammar"}},  # via the service
        },
        {
            "messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "tools": TOOLS,
            "tool_choice": "required",
        },
        {"messages": [{"role": "user", "content": "Name a colour."}], "logprobs": True},
    ],
    ids=["json-schema", "required-tool", "logprobs"],
)
def test_the_core_process_answers_as_the_engine_thread(apps, kw):
    thread, core, _, _ = apps
    want, got = answer(thread, **kw), answer(core, **kw)
    assert got.finish_reason == want.finish_reason
    assert got.message.content == want.message.content
    calls = [(c.function.name, c.function.arguments) for c in got.message.tool_calls or []]
    expected = [(c.function.name, c.function.arguments) for c in want.message.tool_calls or []]
    assert calls == expected
    if "logprobs" in kw:
        assert [t.logprob for t in got.logprobs.content] == pytest.approx(
            [t.logprob for t in want.logprobs.content], abs=1e-4
        )


def test_a_core_killed_mid_stream_ends_the_stream_and_comes_back(apps):
    _, core, app, base = apps
    (pid,) = core_pids(app)
    stream = core.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks, killed = 0, None
    with pytest.raises(openai.APIError, match="restarting"):
        for _ in stream:
            chunks += 1
            if chunks == 3:
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
    assert killed is not None and time.monotonic() - killed < 5.0
    health = httpx.get(f"{base}/healthz", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "restarting"
    # sent while the core restarts: it waits for it, then is answered
    again = answer(core, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8)
    assert again.finish_reason == "length" and again.message.content
    assert httpx.get(f"{base}/healthz", timeout=10).status_code == 200
    assert core_pids(app) and core_pids(app) != [pid]
