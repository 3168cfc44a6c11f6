"""Engine numbers for telemetry, read from outside the engine.

`EngineStats` registers observable sources (queue depth, running batch, KV pages, jump-forward
counters, the KV host tier) that are read only when a metric reader collects, hooks the mask-fill
time of each step, and turns a finished request's `RequestMetrics` into the TTFT and TPOT
histograms and the queue / prefill / decode spans. The engine itself knows nothing of telemetry.

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
from services.engine.params import RequestMetrics
from services.telemetry import spans

log = logging.getLogger(__name__)

Obs = Iterable[tuple[float, dict[str, str]]]


def kv_tier(engine: Any) -> Any | None:
    return getattr(engine, "kv_tier", None)


class EngineStats:
    def __init__(self, engine: Any | None, tel: telemetry.Telemetry | None = None) -> None:
        """`engine` None (a core in its own process): request timings only."""
        self.engine: Any = engine
        self.tel = tel or telemetry.get()
        fam = self.tel.metrics
        self._sources = [
            ("structserve.queue_depth", self._queue_depth),
            ("structserve.running_requests", self._running),
            ("structserve.kv.pages_in_use", self._pages_in_use),
            ("structserve.kv.pages_capacity", self._pages_capacity),
            ("structserve.jump_forward.tokens", self._jump_tokens),
            ("structserve.grammar.late", self._late),
            ("structserve.forward_passes_saved", self._passes_saved),
            ("structserve.speculative.draft_tokens", self._draft_tokens),
            ("structserve.kv.pages_parked", self._tier("pages_parked")),
            ("structserve.kv.pages_recalled", self._tier("pages_recalled")),
            ("structserve.kv.tier_transfer", self._tier_bytes),
            ("structserve.kv.tier_selections", self._tier_selections),
            ("structserve.kv.host_bytes_in_use", self._tier("host_bytes_in_use")),
            ("structserve.prefix_cache.queries", self._prefix_tokens("queried")),
            ("structserve.prefix_cache.hits", self._prefix_tokens("hit")),
            ("structserve.prefix_cache.evictions", self._prefix_evictions),
            ("structserve.prefix_cache.pages", self._prefix_pages),
        ]
        if engine is None:
            self._sources = []
        for name, source in self._sources:
            fam.observe(name, source)
        if self.tel.enabled and engine is not None:
            engine.grammars.on_mask_fill = fam.mask_fill.record
            if (tier := kv_tier(engine)) is not None:
                tier.on_read = fam.kv_host_read.record

    # -- observable sources (called on the collecting thread: reads only) --------------------

    def _queue_depth(self) -> Obs:
        return [(len(self.engine.scheduler.waiting), {})]

    def _running(self) -> Obs:
        return [(len(self.engine.scheduler.running), {})]

    def _pages_in_use(self) -> Obs:
        return [(self.engine.runner.kv.allocator.num_used, {})]

    def _pages_capacity(self) -> Obs:
        return [(self.engine.runner.kv.allocator.num_pages, {})]

    def _jump_tokens(self) -> Obs:
        return [(self.engine.grammars.forced.tokens, {})]

    def _late(self) -> Obs:
        return [(self.engine.grammars.late.parked, {})]

    def _passes_saved(self) -> Obs:
        spec = getattr(self.engine, "speculator", None)
        return [
            (self.engine.grammars.forced.passes_saved, {"source": "jump_forward"}),
            (spec.accepted if spec is not None else 0, {"source": "speculative"}),
        ]

    def _draft_tokens(self) -> Obs:
        spec = getattr(self.engine, "speculator", None)
        if spec is None:
            return []
        return [(spec.proposed, {"result": "proposed"}), (spec.accepted, {"result": "accepted"})]

    def _tier(self, field: str) -> Any:
        def source() -> Obs:
            return [(getattr(kv_tier(self.engine), field, 0) or 0, {})]

        return source

    def _tier_bytes(self) -> Obs:
        tier = kv_tier(self.engine)
        return [
            (getattr(tier, "bytes_to_host", 0) or 0, {"direction": "to_host"}),
            (getattr(tier, "bytes_to_device", 0) or 0, {"direction": "to_device"}),
        ]

    def _tier_selections(self) -> Obs:
        tier = kv_tier(self.engine)
        return [
            (getattr(tier, "hits", 0) or 0, {"result": "hit"}),
            (getattr(tier, "misses", 0) or 0, {"result": "miss"}),
        ]

    def _prefix_tokens(self, counter: str) -> Any:
        def source() -> Obs:
            prefix = self.engine.scheduler.prefix
            if prefix is None:
                return []
            counts: dict[str, int] = {}
            for t, n in dict(getattr(prefix, counter)).items():
                label = self.tel.tenant(t).get("tenant", "")
                counts[label] = counts.get(label, 0) + n
            return [(n, {"tenant": t} if t else {}) for t, n in counts.items()]

        return source

    def _prefix_evictions(self) -> Obs:
        prefix = self.engine.scheduler.prefix
        return [] if prefix is None else [(prefix.allocator.evictions, {})]

    def _prefix_pages(self) -> Obs:
        prefix = self.engine.scheduler.prefix
        if prefix is None:
            return []
        alloc = prefix.allocator
        evictable = alloc.num_evictable
        in_use = alloc.num_cached - evictable
        return [(in_use, {"state": "in_use"}), (evictable, {"state": "evictable"})]

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
