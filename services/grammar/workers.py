"""Threads that run grammar work (the engine's mask fills and forced text, the compile probe's
fills), each job waited for no longer than its deadline.

Both backends compute in native code that releases the GIL, so a fill runs beside the forward
and beside the other fills. A job the engine stops waiting for is a straggler: its worker leaves
the pool (a fresh one takes its place, so a slow grammar never holds the threads every other
fill needs) and exits once the job returns; the job cannot be stopped, since neither
backend can cancel a fill. A straggler whose CPU time passes the mask budget is demoted to the
kernel's idle class (`SCHED_IDLE`; nice 19 where that is refused): it finishes on cores nothing
else wants, so one grammar's seconds of CPU come out of idle time, not out of the forward's.

A job's time is its thread's CPU time, read live while it runs (`pthread_getcpuclockid`), so
the engine can judge a fill that has not returned yet, and a busy host does not make a cheap
grammar look slow.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class Job:
    """One piece of grammar work: `fn()` on a worker, its result or exception, its CPU time."""

    __slots__ = ("_cpu0", "_worker", "done", "ended", "error", "fn", "result", "seconds", "tenant")

    def __init__(self, fn: Callable[[], Any], tenant: str) -> None:
        self.fn, self.tenant = fn, tenant
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.seconds = 0.0  # CPU time, once done
        self.ended = 0.0  # time.perf_counter() when it returned
        self._worker: _Worker | None = None
        self._cpu0 = 0.0

    def cpu_seconds(self) -> float:
        """CPU time so far: final once done, 0 while queued, read from its thread meanwhile."""
        worker = self._worker
        if self.done or worker is None:
            return self.seconds
        try:
            return time.clock_gettime(worker.clock) - self._cpu0
        except OSError:  # the thread ended between the two reads: the job is done now
            return self.seconds


class _Worker:
    def __init__(self, pool: GrammarWorkers, name: str) -> None:
        self.pool = pool
        self.retired = False  # a straggler's thread: exits after its job
        self.demoted = False
        self.native_id = 0
        self.clock = 0
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.native_id = threading.get_native_id()
        self.clock = time.pthread_getcpuclockid(threading.get_ident())
        pool = self.pool
        while True:
            with pool._lock:
                while not pool._queue and not pool._closed and not self.retired:
                    pool._work.wait()
                if pool._closed or self.retired:
                    return
                job = pool._queue.popleft()
                job._worker = self
                job._cpu0 = time.thread_time()
            try:
                job.result = job.fn()
            except BaseException as exc:  # the job's own failure: its request fails, not this
                job.error = exc
            job.seconds = time.thread_time() - job._cpu0
            job.ended = time.perf_counter()
            with pool._lock:
                job.done = True
                if self.retired:
                    pool._stragglers[job.tenant] -= 1
                pool._done.notify_all()
                if self.retired:
                    return

    def demote(self) -> None:
        if self.demoted:
            return
        self.demoted = True
        try:
            os.sched_setscheduler(self.native_id, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):  # not Linux, or refused: the lowest nice instead
            try:
                os.setpriority(os.PRIO_PROCESS, self.native_id, 19)
            except OSError:
                log.debug("grammar worker: could not lower a straggler's priority")


class GrammarWorkers:
    def __init__(self, workers: int = 2, name: str = "grammar-mask") -> None:
        if workers < 1:
            raise ValueError("mask_workers: must be >= 1")
        self._name = name
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # workers wait here for jobs
        self._done = threading.Condition(self._lock)  # the engine waits here for results
        self._queue: deque[Job] = deque()
        self._closed = False
        self._stragglers: Counter[str] = Counter()  # tenant -> its straggling jobs still running
        self._spawned = 0
        self._workers = [self._spawn() for _ in range(workers)]

    def _spawn(self) -> _Worker:
        self._spawned += 1
        return _Worker(self, f"{self._name}-{self._spawned}")

    def submit(self, fns: list[tuple[Callable[[], Any], str]]) -> list[Job]:
        """Queues `(fn, tenant)` pairs; the jobs run in order on whichever worker is free."""
        jobs = [Job(fn, tenant) for fn, tenant in fns]
        with self._lock:
            if self._closed:
                raise RuntimeError("grammar workers: shut down")
            self._queue.extend(jobs)
            self._work.notify(len(jobs))
        return jobs

    def wait(self, jobs: list[Job], timeout: float | None) -> bool:
        """Waits until every job is done (True) or `timeout` seconds passed (None: no limit)."""
        with self._lock:
            return self._done.wait_for(lambda: all(j.done for j in jobs), timeout)

    def wait_any(self, jobs: list[Job], timeout: float) -> None:
        """Waits until one of `jobs` is done, or any job at all when `jobs` is empty (a held
        fill waits for a straggler to return), for `timeout` seconds at most."""
        with self._lock:
            if jobs:
                self._done.wait_for(lambda: any(j.done for j in jobs), timeout)
            else:
                self._done.wait(timeout)

    def straggle(self, job: Job) -> None:
        """The engine stops waiting for `job`: a running one's worker is replaced and leaves once
        the job returns; a queued one stays queued (it runs in turn, nothing is stuck)."""
        with self._lock:
            if job.done:
                return
            worker = job._worker
            if worker is None or worker.retired:
                return
            worker.retired = True
            self._stragglers[job.tenant] += 1
            self._workers.remove(worker)
            self._workers.append(self._spawn())

    def demote(self, job: Job) -> None:
        """Moves a straggler's thread to the idle class (its grammar has cost a budget)."""
        worker = job._worker
        if worker is not None and worker.retired and not job.done:
            worker.demote()

    def stragglers(self, tenant: str) -> int:
        """The tenant's jobs still running on retired workers."""
        with self._lock:
            return self._stragglers[tenant]

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._work.notify_all()
