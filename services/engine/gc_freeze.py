"""Keeps Python's full garbage collections short in a serving process.

A process holding a model, its tokenizer and the libraries has some 400,000 objects tracked by
the collector; a full (generation 2) collection walks them all, about 200 ms on a server CPU,
with the GIL held: every step, stream and request of that process waits, and a tail latency
shows it. Once the process has started, the objects alive then stay for its life: `gc.freeze()`
moves them out of the collector's reach, so later collections walk only what came after (vLLM's
engine does the same after start-up). Cycles among the frozen objects are never collected, which
is why this is done once, after start-up, and never again.
"""

from __future__ import annotations

import gc


def freeze_startup_objects(enabled: bool = True) -> int:
    """Collects once, then freezes what is left; the objects frozen in all (0: disabled, the
    plain twin)."""
    if not enabled:
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
