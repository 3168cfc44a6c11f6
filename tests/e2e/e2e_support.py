"""Shared pieces of the end-to-end suite: the test tenants' keys (the service only ever sees their
sha256) and helpers to configure and wait for a deployment."""

from __future__ import annotations

import os
import socket

import pytest

from deployments import cli
from deployments.service_config import GrammarServiceConfig, LLMConfig, ServiceConfig

KEY_A, KEY_B, KEY_SLOW = "sk-test-tenant-a", "sk-test-tenant-b", "sk-test-limited"
KEY_ONE = "sk-test-one-at-a-time"
KEY_FUZZ = "sk-test-fuzz"  # the HTTP fuzz: few tokens a request, never throttled by rate
KEY_GREEDY, KEY_STEADY = "sk-test-greedy", "sk-test-steady"  # the multi-tenant load test
METRICS_TOKEN = "metrics-test-token"  # /metrics answers only this bearer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_url(db: int) -> str:
    base = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    return base.rsplit("/", 1)[0] + f"/{db}" if base.count("/") > 2 else f"{base}/{db}"


def wait_healthy(url: str, timeout_s: float = 300) -> None:
    if not cli.wait_healthy(url, timeout_s):
        pytest.fail(f"{url} did not become healthy in {timeout_s:.0f} s")


def small_config(**overrides) -> ServiceConfig:
    base = {
        "llm": LLMConfig(
            engine={"kv_cache_memory": 128 << 20, "max_num_seqs": 16, "kv_tier_pages": 64},
            # above every tenant's concurrency: the engine's fair queue decides who waits, not
            # the handle's arrival order; the handle counts a burst (n=16) as queued while it
            # assigns it
            max_ongoing_requests=64,
            max_queued_requests=64,
        ),
        "grammar": GrammarServiceConfig(workers=1, deadline_s=5.0),
    }
    return ServiceConfig(**{**base, **overrides})


class OtlpReceiver:
    """A minimal OTLP/HTTP collector: keeps every span it is sent (as plain dicts), accepts and
    counts metric exports. The service's exporters are the real OpenTelemetry ones."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.spans: list[dict] = []
        self.metric_exports = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.headers.get("content-encoding") == "gzip":
                    import gzip

                    raw = gzip.decompress(raw)
                receiver._take(self.path, raw)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *_args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def _take(self, path: str, raw: bytes) -> None:
        if path.endswith("/v1/metrics"):
            with self._lock:
                self.metric_exports += 1
            return
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        req = ExportTraceServiceRequest.FromString(raw)
        got = []
        for rs in req.resource_spans:
            resource = {a.key: _any(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        {
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex() or None,
                            "name": s.name,
                            "kind": s.kind,
                            "attributes": {a.key: _any(a.value) for a in s.attributes},
                            "component": resource.get("structserve.component"),
                        }
                    )
        with self._lock:
            self.spans.extend(got)

    def trace(self, trace_id: str) -> list[dict]:
        with self._lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def close(self) -> None:
        self._server.shutdown()


def _any(value) -> object:  # an OTLP AnyValue
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_any(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None
