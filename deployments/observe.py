"""The ingress's view of one request: its server span, its counters and its log line.

`observe()` opens the request (a `RequestObs`) when it arrives (the W3C context from the client's
`traceparent` header becomes the parent); the ingress fills in the tenant and the body as it learns
them and calls `finish()` once, with the HTTP status, when the answer is complete (a stream: when
its last event is sent). `carrier` is the trace context to pass through deployment handles.
Nothing here raises into the request: telemetry failures are logged at debug level and dropped.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services import telemetry
from services.telemetry import spans

log = logging.getLogger(__name__)

UNAUTHENTICATED = "unauthenticated"  # the tenant label before the key is checked


class RequestObs:
    def __init__(self, tel: telemetry.Telemetry, route: str, headers: Mapping[str, str]) -> None:
        self.tel = tel
        self.route = route
        self.tenant = UNAUTHENTICATED
        self.engine_tenant: str | None = None  # the engine's class for it, when not the tenant
        self.request_id: str | None = None
        self.start = time.perf_counter()
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0}
        self.finish_reasons: list[str] = []
        self.prompt: Any = None
        self._done = False
        parent = tel.extract(headers)
        self.parent_trace_id = trace.get_current_span(parent).get_span_context().trace_id
        self.span: Any = None
        if route in ("chat", "completions", "responses"):  # a response is a chat answer
            op = "text_completion" if route == "completions" else "chat"
            self.operation = op
            self.span = tel.tracer.start_span(
                op, context=parent, kind=SpanKind.SERVER, attributes={spans.OPERATION_NAME: op}
            )

    @property
    def carrier(self) -> dict[str, str]:
        """The trace context for deployment handle calls."""
        if self.span is None:
            return {}
        return self.tel.inject(trace.set_span_in_context(self.span))

    @property
    def trace_id(self) -> str | None:
        trace_id = self.parent_trace_id
        if self.span is not None and self.span.get_span_context().is_valid:
            trace_id = self.span.get_span_context().trace_id
        return format(trace_id, "032x") if trace_id else None

    def describe(self, body: Any, params: Any, request_id: str, served_model: str) -> None:
        """The request's GenAI attributes, once the body is valid."""
        self.request_id = request_id
        if self.tel.settings.log_prompts:
            self.prompt = getattr(body, "messages", None) or getattr(body, "prompt", None)
        if self.span is None or not self.span.is_recording():
            return
        try:
            structured = params.structured
            attrs: dict[str, Any] = {
                spans.PROVIDER_NAME: spans.PROVIDER,
                spans.REQUEST_MODEL: str(body.model)[:128],
                spans.RESPONSE_MODEL: served_model,
                spans.RESPONSE_ID: request_id,
                spans.REQUEST_MAX_TOKENS: params.max_tokens,
                spans.REQUEST_TEMPERATURE: params.temperature,
                spans.REQUEST_TOP_P: params.top_p,
                spans.TENANT: self.tenant,
                spans.OUTPUT_TYPE: "json" if structured and "json" in structured.kind else "text",
            }
            if params.seed is not None:
                attrs[spans.REQUEST_SEED] = params.seed
            if body.n != 1:
                attrs[spans.REQUEST_CHOICE_COUNT] = body.n
            if structured is not None:
                attrs[spans.GRAMMAR_KIND] = structured.kind
            if self.prompt is not None:
                attrs[spans.INPUT_MESSAGES] = json.dumps(_plain(self.prompt))[:8192]
            # the served model, not the client's string: span names must stay few
            self.span.update_name(f"{self.operation} {served_model}")
            self.span.set_attributes(attrs)
        except Exception:
            log.debug("telemetry: describing the request failed", exc_info=True)

    def add_result(self, delta: Any) -> None:
        """A choice's last delta (a wire.Delta): its usage and finish reason."""
        self.usage["prompt_tokens"] = delta.prompt_tokens
        self.usage["cached_tokens"] = delta.cached_tokens
        self.usage["completion_tokens"] += delta.completion_tokens
        self.finish_reasons.append(str(delta.finish_reason))

    def finish(self, status: int, error: BaseException | None = None) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._record(status, error)
        except Exception:
            log.debug("telemetry: finishing the request failed", exc_info=True)

    def _record(self, status: int, error: BaseException | None) -> None:
        fam = self.tel.metrics
        tenant = self.tel.tenant(self.tenant)
        fam.requests.add(1, {"route": self.route, **tenant, "status": str(status)})
        if status == 429:
            reason = getattr(error, "reason", None) or "replica_busy"
            fam.throttled.add(1, {"reason": reason, **tenant})
        if self.span is not None:
            self.span.set_attribute(spans.HTTP_STATUS, status)
            self.span.set_attribute(spans.TENANT, self.tenant)
            if self.finish_reasons:
                self.span.set_attribute(spans.RESPONSE_FINISH_REASONS, self.finish_reasons)
                self.span.set_attribute(spans.USAGE_INPUT_TOKENS, self.usage["prompt_tokens"])
                self.span.set_attribute(spans.CACHED_TOKENS, self.usage.get("cached_tokens", 0))
                self.span.set_attribute(spans.USAGE_OUTPUT_TOKENS, self.usage["completion_tokens"])
            if status >= 400:
                self.span.set_attribute(spans.ERROR_TYPE, str(status))
                self.span.set_status(Status(StatusCode.ERROR, str(error or status)[:200]))
            self.span.end()
        fields: dict[str, Any] = {
            "request_id": self.request_id,
            "tenant": self.tenant,
            "trace_id": self.trace_id,
            "route": self.route,
            "status": status,
            "duration_ms": round((time.perf_counter() - self.start) * 1e3, 1),
            **self.usage,
            "finish_reasons": self.finish_reasons,
        }
        if status >= 400 and error is not None:
            fields["error"] = str(error)[:300]
        if self.prompt is not None:
            fields["prompt"] = _plain(self.prompt)
        log.info("request", extra=fields)


def _plain(prompt: Any) -> Any:
    if isinstance(prompt, list):
        return [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else m for m in prompt]
    return prompt


def observe(route: str, headers: Mapping[str, str]) -> RequestObs:
    """Opens a request with this process's telemetry."""
    return RequestObs(telemetry.get(), route, headers)
