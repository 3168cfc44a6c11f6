"""Faults on a second application with its own Redis: the LLM replica killed mid-stream, the
batch runner and the LLM replica killed mid-batch (every custom_id comes out exactly once), Redis
stopped. Nothing hangs, nothing is a 500, and the service recovers."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest
import requests
from e2e_support import KEY_A, small_config, wait_healthy

from deployments.service_config import BatchesConfig, FilesConfig, IngressConfig, TenantConfig
from deployments.tenants import digest

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def private_redis(redis_server):
    return redis_server()


@pytest.fixture(scope="module")
def faulty(proxy, private_redis, tmp_path_factory):
    from deployments.app import build_app

    base, serve = proxy
    url, _ = private_redis
    cfg = small_config(
        redis_url=url,
        tenants=[TenantConfig(name="tenant-a", api_key_sha256=[digest(KEY_A)])],
        batches=BatchesConfig(concurrency=4, lease_s=3),
        files=FilesConfig(store=str(tmp_path_factory.mktemp("faulty-files"))),
        ingress=IngressConfig(listener="proxy"),  # beside the main app, on Ray's proxy
    )
    serve.run(build_app(cfg), name="faulty", route_prefix="/faulty", blocking=False)
    wait_healthy(f"{base}/faulty")
    yield f"{base}/faulty"
    serve.delete("faulty")


def _headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY_A}"}


def _kill_llm_replica(kind: str = "LLMReplica") -> None:
    import ray

    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "faulty" in a["name"]]
    replica = next(a for a in names if kind in a["name"])
    ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)


def test_replica_killed_mid_stream_ends_the_stream_and_recovers(faulty):
    body = {
        "model": MODEL,
        "prompt": "Write a long story about a ship.",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    events: list[str] = []
    with requests.post(
        f"{faulty}/v1/completions", headers=_headers(), json=body, stream=True, timeout=120
    ) as r:
        assert r.status_code == 200
        killer = None
        for line in r.iter_lines(decode_unicode=True):
            if not line:
                continue
            events.append(line)
            if killer is None and len(events) >= 2:
                killer = threading.Thread(target=_kill_llm_replica)
                killer.start()
        assert killer is not None
        killer.join()
    payloads = [e.removeprefix("data: ") for e in events]
    assert payloads[-1] == "[DONE]"
    assert any("error" in json.loads(p) for p in payloads[:-1]), payloads[-3:]

    client = openai.OpenAI(base_url=f"{faulty}/v1", api_key=KEY_A, max_retries=0, timeout=60)
    deadline = time.monotonic() + 240
    while True:  # Serve replaces the replica; requests meanwhile get a clean error
        try:
            out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
            assert out.choices[0].text is not None
            break
        except (openai.APIStatusError, openai.APIConnectionError) as exc:
            status = getattr(exc, "status_code", None)
            assert status in (None, 429, 503), exc
            assert time.monotonic() < deadline, "the replica did not come back"
            time.sleep(2)


@pytest.mark.parametrize("kind", ["BatchRunner", "LLMReplica"])
def test_a_batch_survives_a_replica_killed_mid_batch(faulty, kind):
    c = openai.OpenAI(base_url=f"{faulty}/v1", api_key=KEY_A, max_retries=3, timeout=120)
    ids = [f"r{i}" for i in range(16)]
    lines = [
        {
            "custom_id": cid,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Count to {i + 3}."}],
                "max_tokens": 16,
            },
        }
        for i, cid in enumerate(ids)
    ]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    file = c.files.create(file=("b.jsonl", data), purpose="batch")
    batch = c.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 240
    while c.batches.retrieve(batch.id).request_counts.completed < 2:
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.3)
    _kill_llm_replica(kind)
    while (done := c.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, f"still {done.status} after the kill"
        time.sleep(0.5)
    assert done.status == "completed" and done.error_file_id is None
    out = c.files.content(done.output_file_id).text.splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in out) == sorted(ids)  # each exactly once
    wait_healthy(faulty)


def test_redis_stopped_requests_still_succeed_registrations_answer_503(faulty, private_redis):
    _, proc = private_redis
    reg = requests.post(
        f"{faulty}/v1/grammars",
        headers=_headers(),
        json={"name": "digits", "structured_outputs": {"regex": "[0-9]{4}"}},
        timeout=60,
    )
    assert reg.status_code == 201, reg.text
    proc.kill()
    proc.wait()
    client = openai.OpenAI(base_url=f"{faulty}/v1", api_key=KEY_A, max_retries=0, timeout=120)
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A year?"}],
        max_tokens=8,
        extra_body={"structured_outputs": {"regex": "(19|20)[0-9]{2}"}},
    )
    assert len(out.choices[0].message.content) == 4
    for method, path, body in (
        ("post", "/v1/grammars", {"name": "x", "structured_outputs": {"regex": "a+"}}),
        ("get", "/v1/grammars", None),
    ):
        r = requests.request(method, f"{faulty}{path}", headers=_headers(), json=body, timeout=60)
        assert r.status_code == 503, r.text
        assert "unavailable" in r.json()["error"]["message"]
