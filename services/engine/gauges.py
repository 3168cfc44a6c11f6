"""Every number the engine reports to telemetry, read at once (`numbers`).

`EngineStats` (stats.py) turns them into metric points; with the engine core in a process of its
own (core.py), the core sends them with each heartbeat and the replica reports the latest. Prefix
cache counts are by tenant name here; the replica applies the operator's labelling.
"""

from __future__ import annotations

from typing import Any

Point = tuple[float, dict[str, str]]
Numbers = dict[str, list[Point]]

PREFIX_BY_TENANT = ("structserve.prefix_cache.queries", "structserve.prefix_cache.hits")


def numbers(engine: Any) -> Numbers:
    """Reads only (called off the engine's thread)."""
    sched, grammars = engine.scheduler, engine.grammars
    alloc = engine.runner.kv.allocator
    spec = getattr(engine, "speculator", None)
    tier = getattr(engine, "kv_tier", None)

    def of_tier(field: str) -> float:
        return float(getattr(tier, field, 0) or 0)

    out: Numbers = {
        "structserve.queue_depth": [(len(sched.waiting), {})],
        "structserve.running_requests": [(len(sched.running), {})],
        "structserve.kv.pages_in_use": [(alloc.num_used, {})],
        "structserve.kv.pages_capacity": [(alloc.num_pages, {})],
        "structserve.jump_forward.tokens": [(grammars.forced.tokens, {})],
        "structserve.grammar.late": [(grammars.late.parked, {})],
        "structserve.forward_passes_saved": [
            (grammars.forced.passes_saved, {"source": "jump_forward"}),
            (spec.accepted if spec is not None else 0, {"source": "speculative"}),
        ],
        "structserve.speculative.draft_tokens": []
        if spec is None
        else [(spec.proposed, {"result": "proposed"}), (spec.accepted, {"result": "accepted"})],
        "structserve.kv.pages_parked": [(of_tier("pages_parked"), {})],
        "structserve.kv.pages_recalled": [(of_tier("pages_recalled"), {})],
        "structserve.kv.tier_transfer": [
            (of_tier("bytes_to_host"), {"direction": "to_host"}),
            (of_tier("bytes_to_device"), {"direction": "to_device"}),
        ],
        "structserve.kv.tier_selections": [
            (of_tier("hits"), {"result": "hit"}),
            (of_tier("misses"), {"result": "miss"}),
        ],
        "structserve.kv.host_bytes_in_use": [(of_tier("host_bytes_in_use"), {})],
    }
    prefix = sched.prefix
    if prefix is not None:
        for name, counter in zip(PREFIX_BY_TENANT, ("queried", "hit"), strict=True):
            counts = dict(getattr(prefix, counter))
            out[name] = [(n, {"tenant": t}) for t, n in counts.items()]
        out["structserve.prefix_cache.evictions"] = [(prefix.allocator.evictions, {})]
        evictable = prefix.allocator.num_evictable
        in_use = prefix.allocator.num_cached - evictable
        out["structserve.prefix_cache.pages"] = [
            (in_use, {"state": "in_use"}),
            (evictable, {"state": "evictable"}),
        ]
    return out


NAMES = (
    "structserve.queue_depth",
    "structserve.running_requests",
    "structserve.kv.pages_in_use",
    "structserve.kv.pages_capacity",
    "structserve.jump_forward.tokens",
    "structserve.grammar.late",
    "structserve.forward_passes_saved",
    "structserve.speculative.draft_tokens",
    "structserve.kv.pages_parked",
    "structserve.kv.pages_recalled",
    "structserve.kv.tier_transfer",
    "structserve.kv.tier_selections",
    "structserve.kv.host_bytes_in_use",
    *PREFIX_BY_TENANT,
    "structserve.prefix_cache.evictions",
    "structserve.prefix_cache.pages",
)
