"""Which adapters an engine knows, which sit in its slots, and which requests hold them.

An adapter is checked once at admission (`register`: its config, sizes and shapes, a `stat` and a
header, services/lora/adapter.py), then its weights are read on a thread of their own while the
engine steps (a request of an adapter being read waits in the queue; `resolve`, each step, parks
it when read or names the requests to fail when its weights are bad), and parked in host memory;
up to `max_cpu_loras` stay parked (least recently used leave first). A request takes a
slot when it is admitted (`acquire`): its adapter's slot if resident, else a free slot or the
least recently used one no running request holds, loaded from host memory. With every slot held by
other adapters the request waits in the queue (the scheduler skips it, as vLLM's does), so a step
never needs more than `max_loras` adapters. `release` at finish or preemption.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.lora.adapter import WEIGHTS, Adapter, Limits, check_adapter
from services.lora.layers import LoRASlots


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request: `name` identifies it (prefix caching and slots go by it),
    `path` is its PEFT folder (`adapter_config.json` + `adapter_model.safetensors`)."""

    name: str
    path: str


class AdapterManager:
    def __init__(self, slots: LoRASlots, max_cpu_loras: int, max_bytes: int) -> None:
        self.slots = slots
        self.max_cpu_loras = max(max_cpu_loras, slots.max_loras)
        self.limits = Limits(max_rank=slots.max_rank, max_bytes=max_bytes)
        # name -> (which weights: `_identity`, the checked adapter), least recently used first
        self.parked: OrderedDict[str, tuple[str, Adapter]] = OrderedDict()
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, LRU first
        self.holders: dict[str, int] = {}  # name -> running requests holding its slot
        # name -> (which weights, their read in flight): its requests wait until it is parked
        self.reading: dict[str, tuple[str, Future[Adapter]]] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
        self.loads = 0
        self.last_load_s = 0.0

    @classmethod
    def on(cls, slots: LoRASlots | None, config: Any) -> AdapterManager | None:
        """The manager of a runner's slots (None without LoRA), sized by an EngineConfig."""
        if slots is None:
            return None
        return cls(slots, config.max_cpu_loras or config.max_loras, config.max_lora_bytes)

    def refusal(self, lora: LoRARequest, keep: set[str]) -> str | None:
        """Registers `lora`, or why it cannot be served (a 400's message)."""
        try:
            self.register(lora, keep)
        except ValueError as exc:
            return f"lora_request: {exc}"
        return None

    def register(self, lora: LoRARequest, keep: frozenset[str] | set[str] = frozenset()) -> None:
        """Checks the adapter and starts reading its weights, unless it is parked (or being
        read) from the same weights; `AdapterError` (a ValueError naming the field) when it is
        wrong for this model. The adapters in `keep` (named by requests not yet finished) stay."""
        identity = _identity(Path(lora.path))
        known = self._identity_of(lora.name)
        if known == identity:
            if lora.name in self.parked:
                self.parked.move_to_end(lora.name)
            return
        if known is not None and (self.holders.get(lora.name) or lora.name in keep):
            raise ValueError(f"{lora.name!r} is in use with other weights")
        checked = check_adapter(Path(lora.path), self.slots.shape, self.limits)
        self.parked.pop(lora.name, None)
        self._forget_slot(lora.name)  # new weights under an old name: its slot is stale
        self.reading[lora.name] = (identity, self._reader.submit(checked.read))

    def resolve(self, requests: Iterable[Any]) -> list[tuple[Any, str]]:
        """Parks the adapters whose weights are read; for one whose weights are bad, each of
        `requests` (unfinished, with `lora_name`) that named it, with why (a 400)."""
        failed: list[tuple[Any, str]] = []
        for name, (identity, read) in list(self.reading.items()):
            if not read.done():
                continue
            del self.reading[name]
            try:
                adapter = read.result()
            except Exception as exc:  # AdapterError (NaN, unreadable) or the file gone
                why = f"lora_request: {exc}"
                failed += [(r, why) for r in requests if r.lora_name == name and not r.finished]
                continue
            self.parked[name] = (identity, adapter)
            self._evict(keep={r.lora_name for r in requests if not r.finished}, new=name)
        return failed

    def _evict(self, keep: set[str], new: str) -> None:
        while len(self.parked) > self.max_cpu_loras:
            spare = (n for n in self.parked if not self.holders.get(n) and n not in keep)
            name = next((n for n in spare if n != new), None)
            if name is None:
                break
            del self.parked[name]
            self._forget_slot(name)

    def _identity_of(self, name: str) -> str | None:
        if name in self.reading:
            return self.reading[name][0]
        return self.parked[name][0] if name in self.parked else None

    def scope(self, name: str) -> str:
        """What prefix-cache chains of `name` are scoped by: its name and which weights (new
        weights under the same name never meet the old ones' cached pages)."""
        return f"{name}@{self._identity_of(name)}"

    def acquire(self, name: str) -> int | None:
        """The slot for a request of adapter `name`, loading it if needed; None: every slot
        is held by another adapter's running requests, or its weights are still being read
        (the request waits)."""
        if name in self.reading:
            return None
        slot = self.resident.get(name)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            start = time.perf_counter()
            self.slots.load(slot, self.parked[name][1])
            self.last_load_s = time.perf_counter() - start  # charged to the request's tenant
            self.loads += 1
            self.resident[name] = slot
        self.resident.move_to_end(name)
        self.holders[name] = self.holders.get(name, 0) + 1
        return slot

    def release(self, name: str) -> None:
        left = self.holders.get(name, 0) - 1
        if left > 0:
            self.holders[name] = left
        else:
            self.holders.pop(name, None)

    def _free_slot(self) -> int | None:
        used = set(self.resident.values())
        free = [s for s in range(self.slots.max_loras) if s not in used]
        if free:
            return free[0]
        for name, slot in self.resident.items():  # least recently used first
            if not self.holders.get(name):
                del self.resident[name]
                return slot
        return None

    def _forget_slot(self, name: str) -> None:
        slot = self.resident.pop(name, None)
        if slot is not None:
            self.slots.clear(slot)


def _identity(folder: Path) -> str:
    """Which weights a folder holds now: its resolved path and the weights file's change time
    and size (a file rewritten in place is another adapter)."""
    try:
        st = (folder / WEIGHTS).stat()
    except OSError:
        return str(folder)  # inspect_adapter says what is missing
    return f"{folder.resolve()}:{st.st_mtime_ns}:{st.st_size}"
