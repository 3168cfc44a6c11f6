"""Engine numbers for telemetry, read from outside the engine.

`EngineStats` registers observable sources (queue depth, running batch, KV pages, jump-forward
counters, the KV host tier: gauges.py reads them all) that are read only when a metric reader
collects, hooks the mask-fill time of each step, and turns a finished request's `RequestMetrics`
into the TTFT and TPOT histograms and the queue / prefill / decode spans. The engine itself knows
nothing of telemetry.

The KV host tier is read as `engine.kv_tier`, with cumulative counters `pages_parked`,
`pages_recalled`, `bytes_to_host`, `bytes_to_device`, `hits`, `misses` and the gauge
`host_bytes_in_use`; without a tier they report 0. Its `on_read` hook records each host read's
latency into a histogram as it happens, as `on_mask_fill` does for masks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context

from services import telemetry
from services.engine.gauges import NAMES, PREFIX_BY_TENANT, numbers
from services.engine.params import RequestMetrics
from services.telemetry import spans

log = logging.getLogger(__name__)

Obs = Iterable[tuple[float, dict[str, str]]]


def kv_tier(engine: Any) -> Any | None:
    return getattr(engine, "kv_tier", None)


class EngineStats:
    def __init__(self, engine: Any | None, tel: telemetry.Telemetry | None = None) -> None:
        """`engine` None: request timings only (an engine core in a process of its own reports
        its numbers itself: core.py)."""
        self.engine: Any = engine
        self.tel = tel or telemetry.get()
        fam = self.tel.metrics
        self._sources = [(name, self._source(name)) for name in NAMES] if engine is not None else []
        for name, source in self._sources:
            fam.observe(name, source)
        if self.tel.enabled and engine is not None:
            engine.grammars.on_mask_fill = fam.mask_fill.record
            if (tier := kv_tier(engine)) is not None:
                tier.on_read = fam.kv_host_read.record

    def _source(self, name: str) -> Any:
        """An observable source (called on the collecting thread: reads only)."""

        def source() -> Obs:
            points = numbers(self.engine).get(name, [])
            if name not in PREFIX_BY_TENANT:
                return points
            counts: dict[str, float] = {}  # by the operator's labelling (none: one series)
            for n, attrs in points:
                label = self.tel.tenant(attrs.get("tenant", "")).get("tenant", "")
                counts[label] = counts.get(label, 0) + n
            return [(n, {"tenant": t} if t else {}) for t, n in counts.items()]

        return source

    # -- per request -------------------------------------------------------------------------

    def finished(self, m: RequestMetrics, constrained: bool, parent: Context | None) -> None:
        """Records a finished request: TTFT and TPOT, and its queue / prefill / decode spans as
        children of `parent` (the replica's generate span). Never raises."""
        try:
            self._record(m, constrained)
            if parent is not None:
                self._spans(m, parent)
        except Exception:
            log.debug("telemetry: recording a finished request failed", exc_info=True)

    def _record(self, m: RequestMetrics, constrained: bool) -> None:
        attrs = {"constrained": "true" if constrained else "false"}
        fam = self.tel.metrics
        if m.first_token_time is not None:
            fam.ttft.record(m.first_token_time - m.arrival_time, attrs)
            if m.finished_time is not None and m.num_output_tokens > 1:
                decode = m.finished_time - m.first_token_time
                fam.tpot.record(decode / (m.num_output_tokens - 1), attrs)

    def _spans(self, m: RequestMetrics, parent: Context) -> None:
        if not trace.get_current_span(parent).is_recording():
            return  # not sampled: no spans to build
        end = m.finished_time
        phases = [
            (spans.QUEUE, m.arrival_time, m.first_scheduled_time, {}),
            (
                spans.PREFILL,
                m.first_scheduled_time,
                m.first_token_time,
                {
                    spans.TOKENS: m.num_prompt_tokens,
                    spans.CACHED_TOKENS: m.num_cached_tokens,
                    spans.PREEMPTIONS: m.num_preemptions,
                },
            ),
            (
                spans.DECODE,
                m.first_token_time,
                end,
                {spans.TOKENS: m.num_output_tokens, spans.FORCED_TOKENS: m.num_forced_tokens},
            ),
        ]
        offset = telemetry.clock_offset_ns()
        for name, start, stop, attrs in phases:
            if start is None or stop is None:
                continue
            begin = offset + int(start * 1e9)
            span = self.tel.tracer.start_span(
                name, context=parent, start_time=begin, attributes=attrs
            )
            span.end(end_time=offset + int(stop * 1e9))

    def close(self) -> None:
        for _, source in self._sources:
            self.tel.metrics.forget(source)
        if self.engine is None:
            return
        if getattr(self.engine.grammars, "on_mask_fill", None) is not None:
            self.engine.grammars.on_mask_fill = None
        if (tier := kv_tier(self.engine)) is not None:
            tier.on_read = None
