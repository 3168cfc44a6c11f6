"""Telemetry pieces without the model: snapshots add up and print as Prometheus text that the
Prometheus parser reads back, a gone replica's totals stay, JSON logs mask keys and drop prompts,
trace context round-trips, and disabled telemetry is a no-op."""

from __future__ import annotations

import io
import json
import logging

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from services.telemetry import Telemetry, TelemetrySettings, logs
from services.telemetry.snapshot import Aggregator, merge, prom_name, render


def process_snapshot(requests: int, ttft: list[float], queue: int) -> list[dict]:
    """What one replica process would push: recorded through the real SDK."""
    t = Telemetry(TelemetrySettings(), "test")
    t.metrics.requests.add(requests, {"route": "chat", "tenant": "a", "status": "200"})
    for seconds in ttft:
        t.metrics.ttft.record(seconds, {"constrained": "false"})
    t.metrics.observe("structserve.queue_depth", lambda: [(queue, {})])
    snap = t.snapshot()
    t.shutdown()
    return snap


def parsed(text: str) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_prometheus_names_follow_units_and_kinds():
    assert prom_name("structserve.grammar.compile", "s") == "structserve_grammar_compile_seconds"
    assert prom_name("structserve.kv.tier_transfer", "By") == "structserve_kv_tier_transfer_bytes"
    assert prom_name("structserve.queue_depth", "{request}") == "structserve_queue_depth"


def test_snapshots_of_two_replicas_add_up_in_the_prometheus_text():
    a = process_snapshot(2, [0.02, 0.3], queue=1)
    b = process_snapshot(3, [0.02], queue=4)
    got = parsed(render(merge([a, b])))
    ok = (("route", "chat"), ("status", "200"), ("tenant", "a"))
    assert got["structserve_requests_total"][ok] == 5
    assert got["structserve_queue_depth"][()] == 5
    lab = (("constrained", "false"),)
    assert got["structserve_time_to_first_token_seconds_count"][lab] == 3
    assert abs(got["structserve_time_to_first_token_seconds_sum"][lab] - 0.34) < 1e-9
    buckets = got["structserve_time_to_first_token_seconds_bucket"]
    assert buckets[(*lab, ("le", "0.025"))] == 2  # cumulative: both 0.02s
    assert buckets[(*lab, ("le", "0.25"))] == 2
    assert buckets[(*lab, ("le", "0.5"))] == 3
    assert buckets[(*lab, ("le", "+Inf"))] == 3


def test_a_replica_that_stops_pushing_keeps_its_totals_and_loses_its_gauges():
    hub = Aggregator(stale_s=0.0)  # every source is stale at the next read
    hub.push("replica-1", "LLMReplica", process_snapshot(2, [0.1], queue=7))
    first = parsed(hub.render())
    assert "structserve_telemetry_sources" not in first  # no live source
    assert "structserve_queue_depth" not in first
    hub.stale_s = 60.0
    hub.push("replica-2", "LLMReplica", process_snapshot(1, [0.1], queue=3))
    got = parsed(hub.render())
    ok = (("route", "chat"), ("status", "200"), ("tenant", "a"))
    assert got["structserve_requests_total"][ok] == 3  # never backwards
    assert got["structserve_queue_depth"][()] == 3
    assert got["structserve_telemetry_sources"][(("component", "LLMReplica"),)] == 1


def test_histograms_with_other_bounds_are_not_mixed():
    a = process_snapshot(1, [0.1], queue=0)
    b = json.loads(json.dumps(a))
    for fam in b:
        for p in fam["points"]:
            if "bounds" in p:
                p["bounds"] = [1.0] * len(p["bounds"])
    got = parsed(render(merge([a, b])))
    assert got["structserve_time_to_first_token_seconds_count"][(("constrained", "false"),)] == 1


def test_json_logs_mask_keys_drop_prompts_and_carry_the_trace():
    exporter = InMemorySpanExporter()
    tel = Telemetry(TelemetrySettings(), "test", span_exporter=exporter)
    buf = io.StringIO()
    logs.install(stream=buf)
    log = logging.getLogger("deployments.test")
    try:
        with tel.tracer.start_as_current_span("work") as span, logs.log_context(tenant="t1"):
            log.warning(
                "auth header was Bearer sk-live-123 and api_key=sk-live-456",
                extra={"prompt": "secret prompt", "request_id": "r1"},
            )
        trace_id = format(span.get_span_context().trace_id, "032x")
    finally:
        logs.uninstall()
        tel.shutdown()
    record = json.loads(buf.getvalue().splitlines()[-1])
    assert "sk-live" not in buf.getvalue() and "secret prompt" not in buf.getvalue()
    assert record["msg"].count("[redacted]") == 2
    assert record["tenant"] == "t1" and record["request_id"] == "r1"
    assert record["trace_id"] == trace_id and record["level"] == "WARNING"


def test_trace_context_round_trips_and_bad_headers_start_fresh():
    tel = Telemetry(TelemetrySettings(), "test")
    with tel.tracer.start_as_current_span("parent") as span:
        carrier = tel.inject()
    ctx = tel.extract(carrier)
    from opentelemetry import trace

    assert trace.get_current_span(ctx).get_span_context().span_id == span.get_span_context().span_id
    bad = tel.extract({"traceparent": "00-not-a-trace-at-all"})
    assert not trace.get_current_span(bad).get_span_context().is_valid
    tel.shutdown()


def test_sampling_ratio_zero_records_no_span_but_keeps_metrics():
    exporter = InMemorySpanExporter()
    tel = Telemetry(TelemetrySettings(sampling_ratio=0.0), "test", span_exporter=exporter)
    tel.tracer.start_span("dropped").end()
    tel.metrics.requests.add(1, {"route": "chat", "tenant": "a", "status": "200"})
    assert exporter.get_finished_spans() == ()
    assert [f["name"] for f in tel.snapshot()] == ["structserve_requests"]
    tel.shutdown()


def test_a_clients_sampled_flag_cannot_force_a_trace_on_at_the_edge():
    """At the ingress the client's `sampled` flag and trace id are claims; inside the service
    a remote parent is one of ours and is followed."""
    forced = {"traceparent": f"00-{'00' * 8}{'01' * 8}-{'cd' * 8}-01"}  # under any ratio bound
    for edge, kept in ((True, 0), (False, 1)):
        exporter = InMemorySpanExporter()
        settings = TelemetrySettings(sampling_ratio=0.0, edge=edge)
        tel = Telemetry(settings, "test", span_exporter=exporter)
        tel.tracer.start_span("request", tel.extract(forced)).end()
        assert len(exporter.get_finished_spans()) == kept
        tel.shutdown()
    exporter = InMemorySpanExporter()
    tel = Telemetry(TelemetrySettings(sampling_ratio=1.0, edge=True), "t", span_exporter=exporter)
    tel.tracer.start_span("request", tel.extract(forced)).end()
    (span,) = exporter.get_finished_spans()
    assert span.context.trace_id == int("00" * 8 + "01" * 8, 16)  # the client's trace goes on
    tel.shutdown()


def test_disabled_telemetry_is_a_no_op():
    tel = Telemetry(TelemetrySettings(enabled=False), "test")
    span = tel.tracer.start_span("nothing")
    assert not span.is_recording()
    tel.metrics.requests.add(1, {"route": "chat"})
    tel.metrics.observe("structserve.queue_depth", lambda: [(1, {})])
    assert tel.snapshot() == [] and tel.inject() == {}


def test_otlp_exporters_for_both_protocols():
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcSpanExporter,
    )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )

    from services.telemetry import _otlp_exporters

    spans_http, metrics_http = _otlp_exporters("http://collector:4318/", "http/protobuf")
    assert isinstance(spans_http, HttpSpanExporter)
    assert spans_http._endpoint == "http://collector:4318/v1/traces"
    assert metrics_http._endpoint == "http://collector:4318/v1/metrics"
    spans_grpc, metrics_grpc = _otlp_exporters("http://collector:4317", "grpc")
    assert isinstance(spans_grpc, GrpcSpanExporter)
    for exporter in (spans_http, metrics_http, spans_grpc, metrics_grpc):
        exporter.shutdown()
