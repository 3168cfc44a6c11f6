"""Telemetry: the OpenTelemetry SDK's tracer and meter providers, configured once per process.

Traces follow the GenAI semantic conventions pinned in `spans.SEMCONV_VERSION` (1.37.0): the
ingress opens a SERVER span per request (`chat {model}` / `text_completion {model}`) and the W3C
trace context crosses every deployment handle call as a small carrier dict, so one trace holds
the ingress, the LLM replica (generate, grammar resolution, queue wait, prefill, decode) and the
grammar service. With `otlp_endpoint` set, spans and metrics go to an OTLP collector (http/protobuf
or grpc); otherwise spans stay in this process (a bounded buffer of recent spans) and are never
sent anywhere. `sampling_ratio` samples whole traces (parent-based: a replica follows the ingress).

Metrics (families.py) are recorded through the OpenTelemetry metrics API into an in-memory reader
in each process. `/metrics` is aggregated across replicas by *push*: every replica process sends
its cumulative snapshot (snapshot.py) to one small `TelemetryHub` deployment through a deployment
handle once a second, and the ingress's `/metrics` asks the hub for the sum. Chosen over Ray's
`ray.util.metrics` because that API exports through each node's Ray metrics agent (a separate
port per node, Ray's own tags, no single endpoint to scrape), and over pulling through handles
because a handle routes to *one* replica and cannot reach them all. Pushing through the hub works
with any number of replicas, on any node, and the sum never goes backwards when one dies.

`enabled=False` installs no-op providers: instruments and spans cost a function call, nothing is
pushed. Telemetry never fails a request: every exporter, callback and push swallows its errors.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import NoOpMeter
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.telemetry import logs
from services.telemetry.families import Families
from services.telemetry.snapshot import Family, families_from
from services.telemetry.spans import SCHEMA_URL

log = logging.getLogger(__name__)

__all__ = ["Telemetry", "TelemetrySettings", "configure", "get", "install"]

_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(frozen=True)
class TelemetrySettings:
    """The service config's `telemetry` section, as the processes use it."""

    enabled: bool = True
    otlp_endpoint: str | None = None
    otlp_protocol: str = "http/protobuf"  # or "grpc"
    sampling_ratio: float = 1.0
    log_prompts: bool = False
    export_interval_s: float = 5.0
    # this process takes trace context from clients (the ingress): their `sampled` flag is a
    # claim, not an order; the decision is ours, at `sampling_ratio`
    edge: bool = False
    # metric series labelled by tenant (requests, 429s, prefix-cache tokens); off: summed over
    # tenants, so whoever scrapes learns no tenant's traffic (spans and logs still name it)
    tenant_labels: bool = False


class OwnDice(Sampler):
    """Samples at `ratio` by a random draw of ours: neither the client's `sampled` flag nor a
    trace id chosen to fall under TraceIdRatioBased's bound can force a trace on."""

    def __init__(self, ratio: float) -> None:
        self._ratio = ratio

    def should_sample(
        self,
        parent_context: Any,
        trace_id: int,
        name: str,
        kind: Any = None,
        attributes: Any = None,
        links: Any = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        if random.random() < self._ratio:
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, trace_state)
        return SamplingResult(Decision.DROP, None, trace_state)

    def get_description(self) -> str:
        return f"OwnDice{{{self._ratio}}}"


class LocalSpans(SpanProcessor):
    """Keeps the most recent finished spans in this process (no endpoint: nothing leaves)."""

    def __init__(self, maxlen: int = 2048) -> None:
        self.spans: deque[Any] = deque(maxlen=maxlen)

    def on_end(self, span: Any) -> None:
        self.spans.append(span)


class Telemetry:
    def __init__(
        self,
        settings: TelemetrySettings | None = None,
        component: str = "structserve",
        span_exporter: Any | None = None,
        metric_readers: Sequence[Any] = (),
    ) -> None:
        """`span_exporter` and `metric_readers` are added to the configured ones (tests pass the
        SDK's in-memory exporter and reader)."""
        self.settings = s = settings or TelemetrySettings()
        self.component = component
        self.local_spans: LocalSpans | None = None
        self._providers: list[Any] = []
        self.reader: Any | None = None
        if not s.enabled:
            self.tracer: trace.Tracer = trace.NoOpTracer()
            self.metrics = Families(NoOpMeter("structserve"))
            return
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        resource = Resource.create(
            {
                "service.name": "structserve",
                "service.instance.id": f"{socket.gethostname()}-{os.getpid()}",
                "structserve.component": component,
            }
        )
        ratio = TraceIdRatioBased(s.sampling_ratio)
        if s.edge:  # a client's parent: our own draw; inside the service a parent is ours
            sampler = ParentBased(ratio, remote_parent_sampled=OwnDice(s.sampling_ratio))
        else:
            sampler = ParentBased(ratio)
        tracer_provider = TracerProvider(resource=resource, sampler=sampler)
        readers: list[Any] = [*metric_readers]
        self.reader = InMemoryMetricReader()  # what this process pushes to /metrics
        readers.append(self.reader)
        if s.otlp_endpoint:
            span_out, metric_out = _otlp_exporters(s.otlp_endpoint, s.otlp_protocol)
            delay = int(s.export_interval_s * 1000)
            tracer_provider.add_span_processor(
                BatchSpanProcessor(span_out, schedule_delay_millis=delay)
            )
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            readers.append(PeriodicExportingMetricReader(metric_out, delay))
        else:
            self.local_spans = LocalSpans()
            tracer_provider.add_span_processor(self.local_spans)
        if span_exporter is not None:
            tracer_provider.add_span_processor(SimpleSpanProcessor(span_exporter))
        meter_provider = MeterProvider(resource=resource, metric_readers=readers)
        self._providers = [tracer_provider, meter_provider]
        self.tracer = tracer_provider.get_tracer("structserve", schema_url=SCHEMA_URL)
        self.metrics = Families(meter_provider.get_meter("structserve", schema_url=SCHEMA_URL))

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    def tenant(self, tenant: str) -> dict[str, str]:
        """The `tenant` label of a metric point, when the operator asked for tenant labels."""
        return {"tenant": tenant} if self.settings.tenant_labels else {}

    # -- trace context across processes ------------------------------------------------------

    def inject(self, ctx: Context | None = None) -> dict[str, str]:
        """The W3C `traceparent`/`tracestate` of `ctx` (default: the current one) as a dict."""
        carrier: dict[str, str] = {}
        if self.enabled:
            _PROPAGATOR.inject(carrier, context=ctx)
        return carrier

    @staticmethod
    def extract(carrier: Any) -> Context:
        """The context a carrier (HTTP headers, a dict from `inject`) holds; empty if none."""
        if not carrier:
            return Context()
        try:
            return _PROPAGATOR.extract(carrier)
        except Exception:  # a malformed header starts a new trace, never fails the request
            return Context()

    @staticmethod
    def attach(ctx: Context) -> object:
        return otel_context.attach(ctx)

    @staticmethod
    def detach(token: object) -> None:
        otel_context.detach(token)  # type: ignore[arg-type]

    # -- metrics -----------------------------------------------------------------------------

    def snapshot(self) -> list[Family]:
        """This process's metrics, cumulative, as plain data (empty when disabled)."""
        if self.reader is None:
            return []
        try:
            return families_from(self.reader.get_metrics_data())
        except Exception:
            log.warning("telemetry: collecting metrics failed", exc_info=True)
            return []

    def shutdown(self) -> None:
        for provider in self._providers:
            try:
                provider.shutdown()
            except Exception:
                log.debug("telemetry: shutdown failed", exc_info=True)


def _otlp_exporters(endpoint: str, protocol: str) -> tuple[Any, Any]:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = endpoint.startswith("http://")
        return (
            OTLPSpanExporter(endpoint=endpoint, insecure=insecure),
            OTLPMetricExporter(endpoint=endpoint, insecure=insecure),
        )
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as HttpMetricExporter,
    )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )

    base = endpoint.rstrip("/")
    return (
        HttpSpanExporter(endpoint=f"{base}/v1/traces", timeout=5),
        HttpMetricExporter(endpoint=f"{base}/v1/metrics", timeout=5),
    )


_lock = threading.Lock()
_current = Telemetry(TelemetrySettings(enabled=False))
_configured = False


def get() -> Telemetry:
    """This process's telemetry (no-op until `configure` or `install`)."""
    return _current


def install(telemetry: Telemetry) -> Telemetry:
    """Makes `telemetry` this process's; returns the one it replaces (tests restore it)."""
    global _current, _configured
    with _lock:
        previous, _current, _configured = _current, telemetry, True
    return previous


def configure(settings: TelemetrySettings, component: str) -> Telemetry:
    """Sets up this process's telemetry and JSON logs from the service config, once: the first
    call in a process wins (a replica owns its process; a test installs its own first)."""
    global _current, _configured
    with _lock:
        if _configured:
            return _current
        _current, _configured = Telemetry(settings, component), True
    logs.install(log_prompts=settings.log_prompts)
    return _current


def clock_offset_ns() -> int:
    """Epoch nanoseconds minus `time.perf_counter_ns()` now: adding it to a perf-counter reading
    gives a span timestamp (take it once for a set of spans, so shared boundaries stay equal)."""
    return time.time_ns() - time.perf_counter_ns()
