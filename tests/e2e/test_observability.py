"""Telemetry of the running service: `/metrics` scraped and parsed with `prometheus_client`'s
parser and summed over every replica, one trace across three deployments (spans exported over
OTLP to a receiver in this process), and Ray's log files free of keys and prompts."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
import requests
from e2e_support import KEY_A, KEY_B, KEY_SLOW, METRICS_TOKEN, small_config
from prometheus_client.parser import text_string_to_metric_families

MODEL = "SmolLM2-135M-Instruct"


def post_chat(server: str, key: str, content: str, headers=None, **extra) -> requests.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 16,
        "temperature": 0,
        **extra,
    }
    headers = {"Authorization": f"Bearer {key}", **(headers or {})}
    return requests.post(f"{server}/v1/chat/completions", json=body, headers=headers, timeout=120)


def json_schema(field: str) -> dict:
    schema = {
        "type": "object",
        "properties": {field: {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
        "required": [field, "n"],
    }
    return {"type": "json_schema", "json_schema": {"schema": schema}}


def scrape(server: str) -> dict[str, list]:
    """`/metrics` parsed: family name → samples (name, labels, value)."""
    auth = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    r = requests.get(f"{server}/metrics", headers=auth, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f.samples for f in text_string_to_metric_families(r.text)}


def total(families: dict[str, list], sample: str, **labels: str) -> float:
    family = sample.removesuffix("_total").removesuffix("_count").removesuffix("_bucket")
    return sum(
        s.value
        for s in families.get(family, [])
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_metrics_are_prometheus_text_summed_over_every_replica(server):
    name = f"f{uuid.uuid4().hex[:6]}"
    xgrammar = {"backend": "xgrammar"}  # compiled by the GrammarService: its metrics move
    assert post_chat(
        server,
        KEY_B,
        "Invent a thing.",
        response_format=json_schema(name),
        structured_outputs=xgrammar,
    ).ok
    assert post_chat(server, KEY_B, "Say hi.").ok
    statuses = [post_chat(server, KEY_SLOW, "Hi.", max_tokens=2).status_code for _ in range(4)]
    assert 429 in statuses  # tenant-limited: 3 requests a minute

    deadline = time.monotonic() + 30  # replicas push once a second
    while True:
        fam = scrape(server)
        sources = {s.labels["component"]: s.value for s in fam["structserve_telemetry_sources"]}
        ready = total(fam, "structserve_time_to_first_token_seconds_count", constrained="true")
        # the 429 may have come from the other ingress replica: its push lands within a second
        ready = ready and total(fam, "structserve_throttled_requests_total", reason="rate")
        ok = {"route": "chat", "tenant": "tenant-b", "status": "200"}  # so may the two 200s
        ready = ready and total(fam, "structserve_requests_total", **ok) >= 2
        if (sources.get("GrammarService") == 2 and ready) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    expected = {"Ingress": 2, "LLMReplica": 1, "GrammarService": 2}
    if small_config().llm.engine_process:  # its engine core's metrics, pushed by the replica
        expected["EngineCore"] = 1
    assert sources == expected
    ok = {"route": "chat", "tenant": "tenant-b", "status": "200"}
    assert total(fam, "structserve_requests_total", **ok) >= 2
    assert total(fam, "structserve_throttled_requests_total", reason="rate") >= 1
    for histogram in (
        "structserve_time_to_first_token_seconds",
        "structserve_time_per_output_token_seconds",
        "structserve_grammar_mask_fill_seconds",
        "structserve_grammar_compile_seconds",
    ):
        buckets = [s for s in fam[histogram] if s.name == f"{histogram}_bucket"]
        assert buckets and any(s.labels["le"] == "+Inf" and s.value > 0 for s in buckets)
    assert total(fam, "structserve_grammar_compile_seconds_count", kind="json_schema") >= 1
    assert total(fam, "structserve_grammar_cache_hits_total", level="compiled") >= 1
    assert total(fam, "structserve_kv_pages_capacity") > 0
    for gauge in ("structserve_queue_depth", "structserve_running_requests"):
        assert gauge in fam
    for counter in (
        "structserve_kv_pages_parked",
        "structserve_kv_pages_recalled",
        "structserve_kv_tier_transfer_bytes",
        "structserve_jump_forward_tokens",
        "structserve_forward_passes_saved",
    ):
        assert counter in fam  # 0 until an offloaded request or jump-forward (off by default) runs


def test_one_trace_spans_ingress_replica_and_grammar_service(server, otlp):
    trace_id, parent = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    headers = {"traceparent": f"00-{trace_id}-{parent}-01"}
    name = f"g{uuid.uuid4().hex[:6]}"  # a grammar no cache holds: the service compiles it
    r = post_chat(
        server,
        KEY_A,
        "Invent a thing.",
        response_format=json_schema(name),
        structured_outputs={"backend": "xgrammar"},  # xgrammar's compile: in the GrammarService
        headers=headers,
    )
    assert r.ok, r.text
    wanted = {f"chat {MODEL}", "structserve.generate", "structserve.grammar.resolve"}
    wanted |= {"structserve.grammar.verdict", "structserve.decode"}
    deadline = time.monotonic() + 30  # exported in batches, once a second
    while not wanted <= {s["name"] for s in otlp.trace(trace_id)}:
        assert time.monotonic() < deadline, [s["name"] for s in otlp.trace(trace_id)]
        time.sleep(0.25)
    spans = {s["name"]: s for s in otlp.trace(trace_id)}
    server_span = spans[f"chat {MODEL}"]
    assert server_span["component"] == "Ingress" and server_span["parent"] == parent
    assert server_span["attributes"]["gen_ai.usage.output_tokens"] > 0
    assert server_span["attributes"]["structserve.tenant"] == "tenant-a"
    generate = spans["structserve.generate"]
    assert generate["component"] == "LLMReplica"
    assert generate["parent"] == server_span["span_id"]
    resolve = spans["structserve.grammar.resolve"]
    assert resolve["parent"] == generate["span_id"]
    verdict = spans["structserve.grammar.verdict"]
    assert verdict["component"] == "GrammarService"
    assert verdict["parent"] == resolve["span_id"]
    assert verdict["attributes"]["structserve.grammar.cache_level"] == "compiled"


def _ray_logs() -> Path:
    import ray

    node = ray._private.worker._global_node
    if node is None:
        pytest.skip("no Ray node in this process")
    return Path(node.get_logs_dir_path())


def test_ray_logs_hold_request_lines_but_no_key_or_prompt(server):
    marker = f"marker-{uuid.uuid4().hex[:10]}"
    r = post_chat(server, KEY_A, f"Spell {marker} backwards.")
    assert r.ok
    rid = r.json()["id"]
    deadline = time.monotonic() + 30
    while True:
        found, leaks = [], []
        for path in _ray_logs().rglob("*"):
            if not path.is_file():
                continue
            text = path.read_text(errors="replace")
            leaks += [(path.name, s) for s in (marker, KEY_A, KEY_B) if s in text]
            found += [line for line in text.splitlines() if rid in line and '"msg"' in line]
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not leaks
    record = json.loads(found[0][found[0].index("{") :])
    assert record["tenant"] == "tenant-a" and record["status"] == 200
    assert len(record["trace_id"]) == 32
