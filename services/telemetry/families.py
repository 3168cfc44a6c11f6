"""Every metric family the service exports, defined once (names, units, buckets, labels).

Instrument names are dotted OpenTelemetry names; `/metrics` writes them the Prometheus way
(`structserve.grammar.compile` with unit `s` → `structserve_grammar_compile_seconds`, counters
end in `_total`). Values that live in a component (queue depth, KV pages, counters kept by the
engine) are observable instruments: the component registers a callback with `observe()` and pays
nothing until a reader collects.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

# An observation source: yields (value, attributes) when a reader collects.
Source = Callable[[], Iterable[tuple[float, dict[str, str]]]]

# Seconds. TTFT spans compile waits and long prompts; TPOT is a decode step; masks are microseconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
MASK_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1)
# A host-tier read is one layer's parked cells: tens of microseconds to milliseconds.
HOST_READ_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05, 0.25)

# Where a grammar lookup was answered (metric label and span attribute): the replica's compiled
# LRU, the grammar service's recent verdicts, Redis, a worker compile, or the static limits
# (refused before any cache). A refusal found in a cache counts at that cache's level.
CACHE_LEVELS = ("l1", "recent", "redis", "compiled", "rejected")


class Families:
    """The instruments; with a no-op meter every call is a no-op."""

    def __init__(self, meter: Meter) -> None:
        self._lock = threading.Lock()
        self._sources: dict[str, list[Source]] = {}
        m = meter
        # -- ingress
        self.requests = m.create_counter(
            "structserve.requests",
            unit="{request}",
            description="HTTP requests by route, tenant and status (499: the client went away).",
        )
        self.throttled = m.create_counter(
            "structserve.throttled_requests",
            unit="{request}",
            description="429 answers by reason (the error's code; deployments/answers.py "
            "REASONS_429): rate, concurrency, tokens (tenant limits), replica_busy, grammar_busy, "
            "kv_tier_full, registrations_cap, adapters_cap, files_cap, batches_cap.",
        )
        # -- engine (replicas)
        self.ttft = m.create_histogram(
            "structserve.time_to_first_token",
            unit="s",
            description="Engine arrival to first sampled token.",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS,
        )
        self.tpot = m.create_histogram(
            "structserve.time_per_output_token",
            unit="s",
            description="Decode time per output token after the first.",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS,
        )
        self.mask_fill = m.create_histogram(
            "structserve.grammar.mask_fill",
            unit="s",
            description="Time to fill the grammar bitmasks of one engine step.",
            explicit_bucket_boundaries_advisory=MASK_BUCKETS,
        )
        self.kv_host_read = m.create_histogram(
            "structserve.kv.host_read_latency",
            unit="s",
            description="Time to read one layer's parked KV cells back from the host tier (host "
            "time: the gather and, on CUDA, issuing the copy that overlaps compute).",
            explicit_bucket_boundaries_advisory=HOST_READ_BUCKETS,
        )
        self._gauge(m, "structserve.queue_depth", "{request}", "Requests waiting to be scheduled.")
        self._gauge(m, "structserve.running_requests", "{request}", "The running batch size.")
        self._gauge(m, "structserve.kv.pages_in_use", "{page}", "KV cache pages held.")
        self._gauge(m, "structserve.kv.pages_capacity", "{page}", "KV cache pages in the pool.")
        self._counter(
            m,
            "structserve.grammar.late",
            "{request}",
            "Times a constrained request left a step because its mask (or forced text) missed the "
            "mask deadline; it sampled once the mask came in.",
        )
        self._counter(
            m,
            "structserve.jump_forward.tokens",
            "{token}",
            "Tokens that jump-forward put in outputs without sampling them.",
        )
        self._counter(
            m,
            "structserve.forward_passes_saved",
            "{pass}",
            "Decode steps not run: jump-forward appended a forced span (source=jump_forward), or "
            "a speculative draft token was accepted (source=speculative).",
        )
        self._counter(
            m,
            "structserve.speculative.draft_tokens",
            "{token}",
            "Speculative draft tokens verified (result=proposed) and kept (result=accepted); "
            "accepted / proposed is the acceptance rate.",
        )
        self._counter(
            m, "structserve.kv.pages_parked", "{page}", "KV pages moved to the host tier."
        )
        self._counter(
            m,
            "structserve.kv.pages_recalled",
            "{page}",
            "KV pages read back from the host tier (full-page equivalents: a read is per layer "
            "and KV head).",
        )
        self._counter(
            m,
            "structserve.kv.tier_transfer",
            "By",
            "Bytes moved between the device pool and the host tier, by direction.",
        )
        self._counter(
            m,
            "structserve.kv.tier_selections",
            "{page}",
            "Pages Quest selected for offloaded requests, by result: hit (on the device) or miss "
            "(read from the host tier); the hit rate is hit / (hit + miss).",
        )
        self._gauge(m, "structserve.kv.host_bytes_in_use", "By", "Host tier bytes held.")
        self._counter(
            m,
            "structserve.prefix_cache.queries",
            "{token}",
            "Prompt tokens looked up in the prefix cache, by tenant.",
        )
        self._counter(
            m,
            "structserve.prefix_cache.hits",
            "{token}",
            "Prompt tokens served from the prefix cache (not computed), by tenant; the hit rate "
            "is hits / queries.",
        )
        self._counter(
            m,
            "structserve.prefix_cache.evictions",
            "{page}",
            "Cached pages handed out for other contents (their memory was wanted).",
        )
        self._gauge(
            m,
            "structserve.prefix_cache.pages",
            "{page}",
            "Pages the prefix cache holds, by state: in_use (mapped by a request) or evictable.",
        )
        # -- grammars (grammar service and replicas)
        self.grammar_compile = m.create_histogram(
            "structserve.grammar.compile",
            unit="s",
            description="Grammar compile time by kind, outcome (ok or the refusal reason) and "
            "where it ran (worker: the compile service's probe compile; replica: a local compile).",
            explicit_bucket_boundaries_advisory=COMPILE_BUCKETS,
        )
        self.grammar_cache = m.create_counter(
            "structserve.grammar.cache_hits",
            unit="{lookup}",
            description="Grammar lookups by the level that answered: l1, recent, redis; compiled "
            "and rejected (static limits) count lookups no cache held.",
        )

    # -- observable instruments --------------------------------------------------------------

    def observe(self, name: str, source: Source) -> None:
        """Adds a callback for the observable instrument `name`. One source per component and
        attribute set: two sources reporting the same attributes would not add up."""
        with self._lock:
            if name not in self._sources:
                raise KeyError(f"{name} is not an observable metric family")
            self._sources[name].append(source)

    def forget(self, source: Source) -> None:
        with self._lock:
            for sources in self._sources.values():
                if source in sources:
                    sources.remove(source)

    def _callback(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        self._sources[name] = []

        def collect(_options: CallbackOptions) -> Iterable[Observation]:
            with self._lock:
                sources = list(self._sources[name])
            out: list[Observation] = []
            for source in sources:
                try:
                    out.extend(Observation(v, a) for v, a in source())
                except Exception:  # a broken source must not break the scrape
                    continue
            return out

        return collect

    def _gauge(self, m: Meter, name: str, unit: str, description: str) -> Any:
        return m.create_observable_gauge(
            name, callbacks=[self._callback(name)], unit=unit, description=description
        )

    def _counter(self, m: Meter, name: str, unit: str, description: str) -> Any:
        return m.create_observable_counter(
            name, callbacks=[self._callback(name)], unit=unit, description=description
        )
