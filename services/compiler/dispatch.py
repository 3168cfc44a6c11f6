"""`FairDispatcher`: a few threads shared by every tenant's grammar loads, in turns.

A grammar load blocks its thread while the compile service answers (a worker compile can take the
whole deadline), so the threads are what tenants compete for. Tenants with ready tasks take turns
(round robin); a tenant runs at most `per_tenant` tasks at once, and one that already runs a task
does not take the last free thread: that one is kept for a tenant with nothing running, so a
tenant with many slow grammars never makes another tenant's grammar wait behind them.

A task that cannot go on yet (the service said busy) returns how long to wait; it is parked in a
heap of due times, holding no thread, and queued again once due or when `wake` says capacity came
free. Idle threads watch the heap: no thread sleeps on behalf of a task. A queued or parked task
can be dropped (`cancel`) until it runs again.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from typing import Protocol

log = logging.getLogger(__name__)


class Task(Protocol):
    tenant: str

    def run(self) -> float | None:
        """Does the work: None once done, else the seconds to wait before running it again."""
        ...

    def fail(self, exc: BaseException) -> None:
        """It will never run (the dispatcher closed): answer whoever waits for it with `exc`."""
        ...


class FairDispatcher:
    def __init__(self, threads: int, per_tenant: int, name: str = "grammar-resolve") -> None:
        if threads < 1 or per_tenant < 1:
            raise ValueError(f"threads ({threads}) and per_tenant ({per_tenant}) must be >= 1")
        self.threads = threads
        self.per_tenant = per_tenant
        self._name = name
        self._cond = threading.Condition()
        # tenant -> its ready tasks; the dict's order is the turn order (a served tenant moves
        # to the back)
        self._ready: dict[str, deque[Task]] = {}
        self._running: dict[str, int] = {}
        self._parked: list[tuple[float, int, Task]] = []  # (due, tie-break, task): a heap
        self._parked_tasks: set[Task] = set()  # what the heap still holds; the rest is dropped
        self._seq = itertools.count()
        self._started = False
        self._closed = False
        self._gone: BaseException = RuntimeError("the dispatcher is closed")

    def submit(self, task: Task) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the dispatcher is closed")
            if not self._started:  # on first use: an engine without grammars has no threads
                self._started = True
                for i in range(self.threads):
                    name = f"{self._name}-{i}"
                    threading.Thread(target=self._loop, name=name, daemon=True).start()
            self._ready.setdefault(task.tenant, deque()).append(task)
            self._cond.notify_all()

    def cancel(self, task: Task) -> bool:
        """Drops a queued or parked task; False when it is running (or already gone)."""
        with self._cond:
            queue = self._ready.get(task.tenant)
            if queue is not None and task in queue:
                queue.remove(task)
                if not queue:
                    del self._ready[task.tenant]
                return True
            if task in self._parked_tasks:
                self._parked_tasks.discard(task)  # its heap entry is skipped when due
                return True
            return False

    def wake(self) -> None:
        """Capacity came free (a compile ended): each tenant's earliest parked task is queued
        now rather than at its due time. One per tenant: a freed worker fits one compile."""
        with self._cond:
            woken: set[str] = set()
            kept = []
            for entry in sorted(self._parked):
                task = entry[2]
                if task not in self._parked_tasks:
                    continue
                if task.tenant in woken:
                    kept.append(entry)
                    continue
                woken.add(task.tenant)
                self._unpark(task)
            self._parked = kept  # a sorted list is a heap
            if woken:
                self._cond.notify_all()

    def snapshot(self) -> dict[str, int]:
        """How many tasks run, wait for a thread, and are parked (telemetry and tests)."""
        with self._cond:
            return {
                "running": sum(self._running.values()),
                "ready": sum(len(q) for q in self._ready.values()),
                "parked": len(self._parked_tasks),
            }

    def close(self, gone: BaseException) -> None:
        """Stops taking tasks: those that will never run fail with `gone` now, a running one
        that would run again fails with it when it returns."""
        with self._cond:
            self._closed, self._gone = True, gone
            dropped = [t for q in self._ready.values() for t in q] + list(self._parked_tasks)
            self._ready.clear()
            self._parked.clear()
            self._parked_tasks.clear()
            self._cond.notify_all()
        for task in dropped:
            task.fail(gone)

    # -- the threads --------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                task = self._next()
                if task is None:
                    return
                self._running[task.tenant] = self._running.get(task.tenant, 0) + 1
            try:
                retry = task.run()
            except Exception:  # a task answers its own waiters; this is a bug in one
                log.exception("grammar dispatcher: a task raised")
                retry = None
            with self._cond:
                self._running[task.tenant] -= 1
                if not self._running[task.tenant]:
                    del self._running[task.tenant]
                orphan = retry is not None and self._closed  # closed while it ran
                if retry is not None and not self._closed:
                    due = time.monotonic() + max(0.0, retry)
                    heapq.heappush(self._parked, (due, next(self._seq), task))
                    self._parked_tasks.add(task)
                self._cond.notify_all()  # a thread and maybe a tenant's turn came free
            if orphan:
                task.fail(self._gone)

    def _next(self) -> Task | None:
        """The next task to run on this thread (called with the lock held); None once closed."""
        while not self._closed:
            now = time.monotonic()
            while self._parked and self._parked[0][0] <= now:
                task = heapq.heappop(self._parked)[2]
                if task in self._parked_tasks:
                    self._unpark(task)
            picked = self._pick()
            if picked is not None:
                return picked
            timeout = self._parked[0][0] - now if self._parked else None
            self._cond.wait(timeout)
        return None

    def _unpark(self, task: Task) -> None:
        self._parked_tasks.discard(task)
        # ahead of the tenant's newer tasks: it has waited longest
        self._ready.setdefault(task.tenant, deque()).appendleft(task)

    def _pick(self) -> Task | None:
        free = self.threads - sum(self._running.values())  # this thread among them
        for tenant in list(self._ready):
            running = self._running.get(tenant, 0)
            if running >= self.per_tenant or (running and free <= 1):  # the reserve
                continue
            queue = self._ready.pop(tenant)
            task = queue.popleft()
            if queue:
                self._ready[tenant] = queue  # back of the line: the next turn is another's
            return task
        return None
