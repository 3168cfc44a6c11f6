"""The mask budget counts a grammar's own CPU time, not the time its fill waited for a core or
the GIL: a cheap grammar filled on a busy host is not failed for the load around it."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from services.engine.structured.masks import MaskFiller


class _Backend:
    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, 1, dtype=torch.int32)

    def apply_bitmask(self, logits, bitmask, rows) -> None:
        pass


class _State:
    def __init__(self, fill) -> None:
        self.fill = fill

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        self.fill()
        return False


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_waiting_is_not_charged_to_the_grammar_and_computing_is():
    filler = MaskFiller(_Backend(), max_rows=2, overlap=False)  # type: ignore[arg-type]
    waits = SimpleNamespace(grammar=_State(lambda: time.sleep(0.2)))  # descheduled, GIL free
    works = SimpleNamespace(grammar=_State(lambda: _spin(0.2)))  # a slow grammar
    masks = filler.apply(filler.start([waits, works]), torch.zeros(2, 8))  # type: ignore[list-item]
    assert masks is not None and not masks.failed
    assert masks.seconds[0] < 0.05 < 0.15 < masks.seconds[1]
    assert filler.fill_seconds[-1] >= 0.4  # the step's fill time stays the wall clock
