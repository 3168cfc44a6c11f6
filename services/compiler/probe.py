"""The mask-time probe: what admission learns of a grammar's masks before any request decodes
with it. The compile workers probe xgrammar's grammars; `LocalBuilds` probes llguidance's."""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

# A few steps of masks along a random path through the grammar.
PROBE_STEPS = 8


def probe_masks(
    backend: Any, compiled: Any, steps: int, seed: int, stop_above_ms: float = float("inf")
) -> float:
    """The median mask time (ms) over the first `steps` choice points along a seeded random path;
    a single mask slower than `stop_above_ms` ends the probe and is the answer. Times are this
    thread's CPU time, as the decode-time budget counts them (`masks.py`): a busy host does not
    make a cheap grammar look slow."""
    import torch

    state = backend.new_state(compiled)
    bitmask = backend.allocate_bitmask(1)
    rng = random.Random(seed)
    times = []
    for _ in range(steps):
        if state.is_terminated():  # a terminated matcher raises on any further call
            break
        # Text the grammar forces costs one cheap mask per token: timing it would let a long
        # literal prefix hide the slow part behind it from every probe step.
        forced = state.jump_forward()
        if forced and not state.accept_string(forced):
            break
        start = time.thread_time()
        state.fill_bitmask(bitmask, 0)
        times.append((time.thread_time() - start) * 1000)
        if times[-1] > stop_above_ms:
            return times[-1]
        words = bitmask[0].to(torch.int64) & 0xFFFFFFFF
        bits = ((words.unsqueeze(1) >> torch.arange(32)) & 1).flatten()[: backend.vocab_size]
        allowed = bits.nonzero().flatten().tolist()
        if not allowed or not state.accept_token(rng.choice(allowed)):
            break
    return statistics.median(times) if times else 0.0
