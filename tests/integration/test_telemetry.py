"""Traces, metrics and logs with the SDK's in-memory span exporter and metric reader.

The real deployment classes (ingress, LLM replica on the real model, grammar service with its
worker process and a real Redis) run in this process, joined by stand-ins for deployment handles
(local_deployments.py) that pickle what crosses, so the trace context travels the way it does
between replicas. One structured request must give the whole span tree; each metric family must
move when its event happens; the default logs must hold no key and no prompt.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import time
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from local_deployments import LocalHandle, http_request, plain_ingress_class
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from deployments.grammar_service import GrammarService
from deployments.replica import LLMReplica
from deployments.service_config import (
    GrammarServiceConfig,
    IngressConfig,
    LLMConfig,
    ServiceConfig,
    TenantConfig,
    TenantLimits,
)
from deployments.tenants import digest
from grammar_registry.cache import LRUBytes
from grammar_registry.specs import GrammarSpec
from services import telemetry
from services.telemetry import Telemetry, TelemetrySettings, logs, spans

DB = 14
MODEL = "SmolLM2-135M-Instruct"
KEY_A, KEY_LIMITED = "sk-telemetry-tenant-a-3f9c", "sk-telemetry-limited-77ab"
TRACE_ID, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def redis_url(db: int = DB) -> str:
    base = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    return base.rsplit("/", 1)[0] + f"/{db}" if base.count("/") > 2 else f"{base}/{db}"


@pytest.fixture(scope="module")
def tel():
    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    settings = TelemetrySettings(tenant_labels=True)  # these tests follow each tenant's series
    t = Telemetry(settings, "test", span_exporter=exporter, metric_readers=[reader])
    previous = telemetry.install(t)
    yield SimpleNamespace(telemetry=t, spans=exporter, reader=reader)
    telemetry.install(previous)
    t.shutdown()


@pytest.fixture(scope="module")
def stack(tel):
    client = redis.Redis.from_url(redis_url())
    client.flushdb()
    cfg = ServiceConfig(
        redis_url=redis_url(),
        tenants=[
            TenantConfig(name="tenant-a", api_key_sha256=[digest(KEY_A)]),
            TenantConfig(
                name="tenant-limited",
                api_key_sha256=[digest(KEY_LIMITED)],
                limits=TenantLimits(requests_per_minute=1),
            ),
        ],
        # xgrammar's grammars: the spans and cache levels of the compile service's path
        llm=LLMConfig(
            engine={"kv_cache_memory": 64 << 20, "max_num_seqs": 8, "grammar_backend": "xgrammar"},
            # this process's exporter sees the engine's spans on a thread here; those of a core
            # process of its own are followed over HTTP (tests/e2e/test_observability.py)
            engine_process=False,
        ),
        grammar=GrammarServiceConfig(workers=1, deadline_s=5.0),
        ingress=IngressConfig(listener="proxy"),  # no listener: the tests call the routes
    )
    plain = cfg.model_dump(mode="json")
    grammar = GrammarService(plain)
    to_grammar = LocalHandle(grammar)
    replica = LLMReplica(plain, to_grammar)
    to_replica = LocalHandle(replica)
    ingress = plain_ingress_class()(plain, to_replica, to_grammar)
    yield SimpleNamespace(ingress=ingress, replica=replica, grammar=grammar)
    replica.llm.shutdown()
    grammar.service.close()
    to_replica.close()
    to_grammar.close()
    client.flushdb()


def schema(field: str) -> dict[str, Any]:
    """A small schema of its own per test, so no test finds another's grammar cached."""
    return {
        "type": "object",
        "properties": {field: {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
        "required": [field, "n"],
    }


def chat(stack, key: str, content: str, **extra: Any) -> dict[str, Any]:
    """A chat completion through the real ingress code; an ApiError propagates."""
    headers = extra.pop("headers", {})
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 24,
        "temperature": 0,
        **extra,
    }
    response = asyncio.run(stack.ingress.complete(http_request(body, key, **headers), "chat"))
    return json.loads(response.body)


def structured(field: str) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"schema": schema(field)}}}


def trace_spans(tel, trace_id: int, until: str, timeout_s: float = 20.0) -> list[Any]:
    """The finished spans of one trace, once one named `until` is among them."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = [s for s in tel.spans.get_finished_spans() if s.context.trace_id == trace_id]
        if any(s.name == until for s in got) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def one(found: list[Any], name: str) -> Any:
    named = [s for s in found if s.name == name]
    assert len(named) == 1, (name, [s.name for s in found])
    return named[0]


def metric(tel, name: str, **labels: str) -> float:
    """A counter's value or a histogram's count, summed over points matching `labels`."""
    total = 0.0
    data = tel.reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name != name:
                    continue
                for p in m.data.data_points:
                    if all(p.attributes.get(k) == v for k, v in labels.items()):
                        total += p.count if hasattr(p, "bucket_counts") else p.value
    return total


# -- traces -------------------------------------------------------------------------------------


def test_span_tree_of_one_structured_request(stack, tel):
    traceparent = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
    out = chat(
        stack, KEY_A, "Invent a city.", headers={"traceparent": traceparent}, **structured("city")
    )
    found = trace_spans(tel, int(TRACE_ID, 16), until=spans.GENERATE)

    server = one(found, f"chat {MODEL}")
    assert server.kind is SpanKind.SERVER
    assert server.parent.span_id == int(CLIENT_SPAN, 16) and server.parent.is_remote
    a = server.attributes
    assert a[spans.OPERATION_NAME] == "chat" and a[spans.PROVIDER_NAME] == "structserve"
    assert a[spans.REQUEST_MODEL] == MODEL and a[spans.REQUEST_MAX_TOKENS] == 24
    assert a[spans.USAGE_INPUT_TOKENS] == out["usage"]["prompt_tokens"] > 0
    assert a[spans.USAGE_OUTPUT_TOKENS] == out["usage"]["completion_tokens"] > 0
    assert list(a[spans.RESPONSE_FINISH_REASONS]) == [out["choices"][0]["finish_reason"]]
    assert a[spans.RESPONSE_ID] == out["id"] and a[spans.OUTPUT_TYPE] == "json"
    assert a[spans.TENANT] == "tenant-a" and a[spans.HTTP_STATUS] == 200
    assert spans.INPUT_MESSAGES not in a  # prompts only with log_prompts

    generate = one(found, spans.GENERATE)
    assert generate.parent.span_id == server.context.span_id
    assert generate.attributes[spans.REQUEST_ID].startswith(f"{out['id']}-0-")
    assert generate.attributes[spans.USAGE_OUTPUT_TOKENS] == out["usage"]["completion_tokens"]

    resolve = one(found, spans.GRAMMAR_RESOLVE)
    assert resolve.parent.span_id == generate.context.span_id
    assert resolve.attributes[spans.CACHE_LEVEL] == "compiled"
    assert resolve.attributes[spans.GRAMMAR_OUTCOME] == "ok"
    assert resolve.attributes[spans.GRAMMAR_BACKEND] == "xgrammar"
    verdict = one(found, spans.GRAMMAR_VERDICT)  # the grammar service's, through the handle
    assert verdict.parent.span_id == resolve.context.span_id
    assert verdict.attributes[spans.CACHE_LEVEL] == "compiled"
    assert verdict.attributes[spans.GRAMMAR_BACKEND] == "xgrammar"
    assert verdict.attributes[spans.GRAMMAR_KIND] == "json_schema"

    queue, prefill, decode = (one(found, n) for n in (spans.QUEUE, spans.PREFILL, spans.DECODE))
    for span in (queue, prefill, decode):
        assert span.parent.span_id == generate.context.span_id
    assert queue.end_time == prefill.start_time and prefill.end_time == decode.start_time
    assert server.start_time <= queue.start_time <= decode.end_time <= server.end_time
    assert decode.attributes[spans.TOKENS] == out["usage"]["completion_tokens"]
    assert {s.context.trace_id for s in found} == {int(TRACE_ID, 16)}


def test_a_grammar_already_loaded_resolves_at_l1_without_the_service(stack, tel):
    chat(stack, KEY_A, "Invent a river.", **structured("river"))
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    parent = f"00-{trace_id}-b7ad6b7169203331-01"
    chat(stack, KEY_A, "Invent a river.", headers={"traceparent": parent}, **structured("river"))
    found = trace_spans(tel, int(trace_id, 16), until=spans.GENERATE)
    assert one(found, spans.GRAMMAR_RESOLVE).attributes[spans.CACHE_LEVEL] == "l1"
    assert not [s for s in found if s.name == spans.GRAMMAR_VERDICT]


def test_a_request_without_traceparent_starts_its_own_trace(stack, tel):
    before = {s.context.span_id for s in tel.spans.get_finished_spans()}
    chat(stack, KEY_A, "Say hi.")
    time.sleep(0.5)  # the replica side ends its span after the last delta
    new = [s for s in tel.spans.get_finished_spans() if s.context.span_id not in before]
    server = one(new, f"chat {MODEL}")
    assert server.parent is None
    assert one(new, spans.GENERATE).parent.span_id == server.context.span_id


# -- metrics ------------------------------------------------------------------------------------


def test_request_metric_families_move_with_their_events(stack, tel):
    from deployments.ingress import ApiError

    ok = {"route": "chat", "tenant": "tenant-a", "status": "200"}
    before = {
        "ok": metric(tel, "structserve.requests", **ok),
        "ttft": metric(tel, "structserve.time_to_first_token", constrained="true"),
        "tpot": metric(tel, "structserve.time_per_output_token", constrained="true"),
        "masks": metric(tel, "structserve.grammar.mask_fill"),
        "l1": metric(tel, "structserve.grammar.cache_hits", level="l1"),
        "compiled": metric(tel, "structserve.grammar.cache_hits", level="compiled"),
        "worker": metric(tel, "structserve.grammar.compile", kind="json_schema", where="worker"),
    }
    chat(stack, KEY_A, "Invent a lake.", **structured("lake"))
    assert metric(tel, "structserve.requests", **ok) == before["ok"] + 1
    assert metric(tel, "structserve.grammar.cache_hits", level="compiled") == before["compiled"] + 1
    assert (
        metric(tel, "structserve.grammar.compile", kind="json_schema", outcome="ok", where="worker")
        == before["worker"] + 1
    )
    deadline = time.monotonic() + 10  # recorded on the replica's side as the sequence ends
    while metric(tel, "structserve.time_to_first_token", constrained="true") == before["ttft"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert (
        metric(tel, "structserve.time_per_output_token", constrained="true") == before["tpot"] + 1
    )
    assert metric(tel, "structserve.grammar.mask_fill") > before["masks"]

    chat(stack, KEY_A, "Invent a lake.", **structured("lake"))
    assert metric(tel, "structserve.grammar.cache_hits", level="l1") == before["l1"] + 1

    limited = {"reason": "rate", "tenant": "tenant-limited"}
    throttled = metric(tel, "structserve.throttled_requests", **limited)
    chat(stack, KEY_LIMITED, "Hi.", max_tokens=2)
    with pytest.raises(ApiError) as err:
        chat(stack, KEY_LIMITED, "Hi.", max_tokens=2)
    assert err.value.status == 429
    assert metric(tel, "structserve.throttled_requests", **limited) == throttled + 1
    assert metric(tel, "structserve.requests", tenant="tenant-limited", status="429") == 1

    with pytest.raises(ApiError):
        chat(stack, "sk-nobody", "Hi.")
    assert metric(tel, "structserve.requests", tenant="unauthenticated", status="401") >= 1


def test_grammar_cache_levels_and_compile_outcomes(stack, tel):
    service = stack.grammar.service

    def level(name: str) -> float:
        return metric(tel, "structserve.grammar.cache_hits", level=name)

    spec = GrammarSpec(kind="json_schema", source=schema("levels"))
    counts = {n: level(n) for n in ("compiled", "recent", "redis", "rejected")}
    assert service.verdict(spec).source == "compiled"
    assert service.verdict(spec).source == "recent"
    service.recent = LRUBytes(1 << 20)  # as a second grammar replica would start: Redis has it
    assert service.verdict(spec).source == "redis"
    huge = GrammarSpec(kind="regex", source="(.{0,50}){0,50}")
    assert service.verdict(huge).source == "rejected"
    for name in counts:
        assert level(name) == counts[name] + 1, name

    invalid = metric(tel, "structserve.grammar.compile", kind="regex", outcome="invalid")
    bad = service.verdict(GrammarSpec(kind="regex", source="(unclosed"))
    assert not bad.ok and bad.reason == "invalid"
    assert (
        metric(tel, "structserve.grammar.compile", kind="regex", outcome="invalid") == invalid + 1
    )


# -- logs ---------------------------------------------------------------------------------------


def test_default_logs_hold_ids_but_no_key_or_prompt(stack, tel):
    from deployments.ingress import ApiError

    marker = "zebra-lantern-quartz"
    buf = io.StringIO()
    logs.install(stream=buf)
    try:
        traceparent = f"00-{'ab' * 16}-{'cd' * 8}-01"
        out = chat(stack, KEY_A, f"Tell me about {marker}.", headers={"traceparent": traceparent})
        with pytest.raises(ApiError):
            chat(stack, "sk-wrong-key-9d1e", f"Also {marker}.")
    finally:
        logs.uninstall()
    text = buf.getvalue()
    lines = [json.loads(line) for line in text.splitlines()]
    done = [r for r in lines if r.get("msg") == "request" and r.get("request_id") == out["id"]]
    assert done and done[0]["tenant"] == "tenant-a" and done[0]["trace_id"] == "ab" * 16
    assert done[0]["status"] == 200 and done[0]["completion_tokens"] > 0
    assert any(r.get("status") == 401 and r.get("tenant") == "unauthenticated" for r in lines)
    for secret in (marker, KEY_A, "sk-wrong-key-9d1e"):
        assert secret not in text


def test_log_prompts_puts_the_prompt_in_logs_and_spans(stack, tel):
    marker = "violet-anchor-ember"
    buf = io.StringIO()
    opted = Telemetry(TelemetrySettings(log_prompts=True), "test", span_exporter=tel.spans)
    previous = telemetry.install(opted)
    logs.install(log_prompts=True, stream=buf)
    try:
        chat(stack, KEY_A, f"Describe {marker}.", max_tokens=4)
    finally:
        logs.uninstall()
        telemetry.install(previous)
        opted.shutdown()
    assert marker in buf.getvalue()
    assert KEY_A not in buf.getvalue()
    server = [s for s in tel.spans.get_finished_spans() if s.name == f"chat {MODEL}"][-1]
    assert marker in server.attributes[spans.INPUT_MESSAGES]


# -- safety -------------------------------------------------------------------------------------


class _BrokenExporter(InMemorySpanExporter):
    def export(self, spans):  # type: ignore[no-untyped-def]
        raise RuntimeError("collector down")


def test_broken_telemetry_never_fails_a_request_and_metrics_still_answer(stack, tel):
    from prometheus_client.parser import text_string_to_metric_families

    broken = Telemetry(TelemetrySettings(), "test", span_exporter=_BrokenExporter())

    def bad_source() -> list:
        raise RuntimeError("source broke")

    broken.metrics.observe("structserve.queue_depth", bad_source)
    previous = telemetry.install(broken)
    try:
        out = chat(stack, KEY_A, "Invent a tree.", **structured("tree"))
        assert out["choices"][0]["message"]["content"]
        # no hub here: /metrics answers with this replica's own metrics
        page = asyncio.run(stack.ingress.metrics(SimpleNamespace(headers={})))
    finally:
        telemetry.install(previous)
        broken.shutdown()
    names = {f.name for f in text_string_to_metric_families(page.body.decode())}
    assert "structserve_requests" in names
