"""Metric snapshots: plain data that crosses a process boundary, adds up, and prints as Prometheus.

A snapshot is a list of families, each `{"name", "type", "help", "points"}` where `name` is the
Prometheus name, `type` is counter, gauge or histogram, and a point is `{"labels", "value"}` or,
for histograms, `{"labels", "bounds", "counts", "sum", "count"}` (`counts` per bucket, the last
one above every bound). `Aggregator` keeps the latest snapshot of every source (one per replica
process) and sums them; a source that stops reporting keeps its counters and histograms (folded
into a retired total, so sums never go backwards when a replica dies) and loses its gauges.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable
from typing import Any

from opentelemetry.sdk.metrics.export import Gauge, Histogram, MetricsData, Sum

Family = dict[str, Any]
_UNIT_SUFFIX = {"s": "seconds", "By": "bytes"}


def prom_name(name: str, unit: str) -> str:
    """`structserve.grammar.compile` (unit s) → `structserve_grammar_compile_seconds`."""
    base = re.sub(r"[^a-zA-Z0-9_:]", "_", name)
    suffix = _UNIT_SUFFIX.get(unit)
    if suffix and not base.endswith("_" + suffix):
        base += "_" + suffix
    return base


def _labels(attributes: Any) -> dict[str, str]:
    return {re.sub(r"[^a-zA-Z0-9_]", "_", k): str(v) for k, v in dict(attributes or {}).items()}


def families_from(data: MetricsData | None) -> list[Family]:
    """An OpenTelemetry reader's cumulative data as a snapshot."""
    out: list[Family] = []
    if data is None:
        return out
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                family = _family(metric)
                if family is not None and family["points"]:
                    out.append(family)
    return out


def _family(metric: Any) -> Family | None:
    d = metric.data
    name, doc = prom_name(metric.name, metric.unit or ""), metric.description or metric.name
    if isinstance(d, Histogram):
        points = [
            {
                "labels": _labels(p.attributes),
                "bounds": [float(b) for b in p.explicit_bounds],
                "counts": [int(c) for c in p.bucket_counts],
                "sum": float(p.sum),
                "count": int(p.count),
            }
            for p in d.data_points
        ]
        return {"name": name, "type": "histogram", "help": doc, "points": points}
    if isinstance(d, Sum | Gauge):
        kind = "counter" if isinstance(d, Sum) and d.is_monotonic else "gauge"
        points = [{"labels": _labels(p.attributes), "value": float(p.value)} for p in d.data_points]
        return {"name": name, "type": kind, "help": doc, "points": points}
    return None


def merge(snapshots: Iterable[list[Family]]) -> list[Family]:
    """Sums snapshots point by point (same name and labels); histograms bucket by bucket."""
    fams: dict[str, Family] = {}
    index: dict[tuple[str, tuple[tuple[str, str], ...]], dict[str, Any]] = {}
    for snap in snapshots:
        for fam in snap:
            mine = fams.setdefault(
                fam["name"], {"name": fam["name"], "type": fam["type"], "help": fam["help"]}
            )
            mine.setdefault("points", [])
            if mine["type"] != fam["type"]:
                continue  # a family redefined between versions: keep the first kind
            for p in fam["points"]:
                key = (fam["name"], tuple(sorted(p["labels"].items())))
                have = index.get(key)
                if have is None:
                    index[key] = have = {**p, "labels": dict(p["labels"])}
                    if "counts" in p:
                        have["counts"] = list(p["counts"])
                    mine["points"].append(have)
                elif "counts" in p:
                    if have["bounds"] != p["bounds"]:
                        continue
                    pairs = zip(have["counts"], p["counts"], strict=True)
                    have["counts"] = [a + b for a, b in pairs]
                    have["sum"] += p["sum"]
                    have["count"] += p["count"]
                else:
                    have["value"] += p["value"]
    return list(fams.values())


def render(families: Iterable[Family]) -> str:
    """Prometheus text format (0.0.4), written by `prometheus_client`."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
    from prometheus_client.exposition import generate_latest
    from prometheus_client.registry import CollectorRegistry
    from prometheus_client.utils import floatToGoString

    built: list[Any] = []
    for fam in sorted(families, key=lambda f: f["name"]):
        names = sorted({k for p in fam["points"] for k in p["labels"]})
        kind = {
            "counter": CounterMetricFamily,
            "gauge": GaugeMetricFamily,
            "histogram": HistogramMetricFamily,
        }[fam["type"]]
        out = kind(fam["name"], fam["help"], labels=names)
        for p in fam["points"]:
            values = [p["labels"].get(k, "") for k in names]
            if fam["type"] == "histogram":
                running, buckets = 0, []
                for bound, count in zip([*p["bounds"], float("inf")], p["counts"], strict=True):
                    running += count
                    buckets.append((floatToGoString(bound), running))
                out.add_metric(values, buckets, p["sum"])
            else:
                out.add_metric(values, p["value"])
        built.append(out)

    class _Fixed:
        def collect(self) -> Iterable[Any]:
            return built

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed())
    return generate_latest(registry).decode()


class Aggregator:
    """The latest snapshot per source, summed; thread-safe."""

    def __init__(self, stale_s: float = 15.0) -> None:
        self.stale_s = stale_s
        self._lock = threading.Lock()
        self._live: dict[str, tuple[str, float, list[Family]]] = {}  # source → (component, t, snap)
        self._retired: list[Family] = []

    def push(self, source: str, component: str, snapshot: list[Family]) -> None:
        with self._lock:
            self._live[source] = (component, time.monotonic(), snapshot)

    def merged(self) -> list[Family]:
        now = time.monotonic()
        with self._lock:
            for source, (_, stamp, snap) in list(self._live.items()):
                if now - stamp > self.stale_s:  # gone: its totals stay, its gauges go
                    del self._live[source]
                    kept = [f for f in snap if f["type"] != "gauge"]
                    self._retired = merge([self._retired, kept])
            live = list(self._live.values())
            retired = self._retired
        by_component: dict[str, int] = {}
        for component, _, _ in live:
            by_component[component] = by_component.get(component, 0) + 1
        sources = {
            "name": "structserve_telemetry_sources",
            "type": "gauge",
            "help": "Processes whose metrics this endpoint sums, by component.",
            "points": [{"labels": {"component": c}, "value": n} for c, n in by_component.items()],
        }
        return [*merge([retired, *(snap for _, _, snap in live)]), sources]

    def render(self) -> str:
        return render(self.merged())
