"""A bounded pool of long-lived worker processes of one role, each killed and replaced on a
deadline.

Neither xgrammar's compiles, nor jsonschema-rs' validation, nor a Jinja render can be cancelled
(the last two hold the GIL), so the only safe deadline is a process boundary: the caller waits on
the worker's socket until the job has used its deadline of the worker's CPU time (or, on a host
too loaded to give it that, `LOAD_GRACE` times it of wall time: the load is not the job's
verdict), then SIGKILLs it and a replacement starts in the background. A restart is charged to
the tenant whose job caused it: until the replacement is up, it counts as one of that tenant's
jobs in flight. With two workers or more, the last idle one is
kept for a tenant with nothing in flight, so one tenant's slow jobs never make another tenant's
wait for a worker.

Workers run `python -m services.sandbox.worker`, our own entry point: multiprocessing's spawn
would re-import the caller's `__main__` (a script without a main guard, or `python -`, kills every
worker at start), and fork would copy the parent's threads and torch state.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

from services.sandbox.process import WorkerProcess as _Worker

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # a cold compile worker imports xgrammar and torch
RETRY_S = (1.0, 2.0, 5.0, 10.0, 30.0)  # backoff between failed starts; the last one repeats
STALL_GRACE_S = 10.0  # a job this long past its deadline means the pool is stuck
# A job's deadline is CPU time; on a host so loaded that it has had less, it may run this many
# times its deadline of wall time.
LOAD_GRACE = 3.0

ACTIVITY = {"compile": "compiling"}  # what "nothing ..." says of a tenant with no job running


class WorkerPool:
    """`role`: what the workers do (worker.ROLES); `setup`: what each worker is started with."""

    def __init__(
        self,
        role: str,
        setup: dict[str, Any] | None = None,
        workers: int = 2,
        memory_bytes: int = 4 << 30,
    ) -> None:
        self.role = role
        self._setup = setup or {}
        self._memory = memory_bytes
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()  # starting, idle or busy: close() kills them all
        self._busy = 0
        self._due: dict[_Worker, float] = {}  # busy worker -> when its job's deadline passes
        self._running: dict[str, int] = {}  # tenant -> workers busy with its jobs
        self._restarting: dict[str, int] = {}  # tenant -> replacements its jobs caused
        self.charged_s: dict[str, float] = {}  # tenant -> worker restart seconds charged to it
        self._start_error = ""  # why the last start failed; '' after one succeeded
        self._closed = False
        self.size = workers
        self.kills = 0
        self.jobs = 0
        for _ in range(workers):
            self._start_one()

    def in_flight(self, tenant: str) -> int:
        """The tenant's jobs on a worker, plus the restarts its jobs caused."""
        with self._cond:
            return self._running.get(tenant, 0) + self._restarting.get(tenant, 0)

    def restarting(self, tenant: str) -> int:
        """Workers starting again after the tenant's job ran out of time or crashed."""
        with self._cond:
            return self._restarting.get(tenant, 0)

    def _start_one(self, charged: str | None = None) -> None:
        name = f"{self.role}-worker-start"
        start = threading.Thread(target=self._keep_starting, args=(charged,), name=name)
        start.daemon = True
        start.start()

    def _keep_starting(self, charged: str | None = None) -> None:
        attempt, logged, began = 0, "", time.monotonic()
        while not self._closed:
            worker, error = self._try_start()
            with self._cond:
                if charged is not None:
                    # Charged up to its first start only: workers that cannot start at all
                    # are no tenant's doing.
                    _count(self._restarting, charged, -1)
                    seconds = time.monotonic() - began
                    self.charged_s[charged] = self.charged_s.get(charged, 0.0) + seconds
                    charged = None
                    self._cond.notify_all()
                if worker is not None and (error or self._closed):
                    self._all.discard(worker)
                if self._closed:  # closed while it started: nobody else will kill it
                    if worker is not None:
                        worker.kill()
                    return
                if not error and worker is not None:
                    self._start_error = ""
                    self._idle.append(worker)
                    self._cond.notify_all()
                    return
                self._start_error = error
                self._cond.notify_all()  # callers waiting for a worker are answered now
            if error != logged:  # once per distinct failure, not once per retry
                log.error("%s worker failed to start, retrying: %s", self.role, error)
                logged = error
            self._sleep(RETRY_S[min(attempt, len(RETRY_S) - 1)])
            attempt += 1

    def _try_start(self) -> tuple[_Worker | None, str]:
        try:
            worker = _Worker(self.role, self._setup, self._memory)
        except OSError as exc:  # no interpreter, no fds, no memory to fork
            return None, f"could not run {sys.executable}: {exc}"
        with self._cond:
            self._all.add(worker)  # from now on close() kills it
        return worker, worker.start(START_TIMEOUT_S)

    def _sleep(self, seconds: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._closed, seconds)

    def _take(self, wait_s: float, tenant: str) -> _Worker | dict[str, Any]:
        """An idle worker the tenant may use, or the refusal to answer with."""
        end = time.monotonic() + wait_s
        with self._cond:
            while not self._free_for(tenant):
                # No worker can free up: answer now rather than after `wait_s`.
                if not self._idle and self._start_error and self._busy == 0:
                    error = f"{self.role} workers cannot start: {self._start_error}"
                    return {"ok": False, "reason": "unavailable", "error": error}
                left = end - time.monotonic()
                if self._closed or left <= 0:
                    error = (
                        f"the last free {self.role} worker is kept for tenants with nothing "
                        f"{ACTIVITY.get(self.role, 'in flight')}"
                        if self._idle
                        else f"no {self.role} worker free"
                    )
                    return {"ok": False, "reason": "busy", "error": f"{error}; try later"}
                self._cond.wait(left)
            self._busy += 1
            _count(self._running, tenant, 1)
            return self._idle.pop()

    def _free_for(self, tenant: str) -> bool:
        if not self._idle:
            return False
        in_flight = self._running.get(tenant, 0) + self._restarting.get(tenant, 0)
        # with one idle worker left, a tenant with nothing in flight only: the reserve
        return len(self._idle) > 1 or not in_flight

    def run(
        self, job: dict[str, Any], deadline_s: float, wait_s: float, tenant: str = "default"
    ) -> dict[str, Any]:
        """The worker's answer, or a refusal: `busy` when no worker frees up for `tenant` within
        `wait_s`, `unavailable` at once when workers cannot start, `timeout` when the job
        runs past `deadline_s`, `crash` when the worker dies (its restart charged to `tenant`)."""
        worker = self._take(wait_s, tenant)
        if isinstance(worker, dict):
            return worker
        self.jobs += 1
        with self._cond:
            self._due[worker] = time.monotonic() + LOAD_GRACE * deadline_s
        try:
            worker.conn.send(job)
            if self._answered(worker, deadline_s):
                result: dict[str, Any] = worker.conn.recv()
                for line in result.pop("log", []):  # what the worker's libraries printed
                    log.debug("%s worker: %s", self.role, line)
                if not result.pop("recycle", False):
                    self._give_back(worker, tenant, keep=True)
                    return result
                # the worker asked to be replaced (work it left running): like a kill, the
                # restart is charged to the tenant whose job it was
                self._replace(worker, tenant)
                return result
            reason, error = "timeout", f"{self.role} exceeded its {deadline_s:g} s deadline"
        except Exception:  # EOF, a broken pipe, an unreadable reply: the worker is not trusted
            reason, error = "crash", f"the {self.role} worker died (memory cap or a backend fault)"
        self._replace(worker, tenant)
        return {"ok": False, "reason": reason, "error": error}

    @staticmethod
    def _answered(worker: _Worker, deadline_s: float) -> bool:
        """Waits for the job's answer until it has used `deadline_s` of the worker's CPU time
        (the job's own cost), or `LOAD_GRACE` times that of wall time: a job that waited for a
        core on a loaded host is not judged for the load (where the CPU time cannot be read,
        the wall clock decides)."""
        start, cpu0 = time.monotonic(), worker.cpu_seconds()
        wait = deadline_s
        while not worker.conn.poll(wait):
            used, waited = worker.cpu_seconds(), time.monotonic() - start
            if used is None or cpu0 is None or used - cpu0 >= deadline_s:
                return False
            wait = min(deadline_s - (used - cpu0), LOAD_GRACE * deadline_s - waited)
            if wait <= 0:
                return False
        return True

    def _replace(self, worker: _Worker, tenant: str) -> None:
        self.kills += 1
        self._give_back(worker, tenant, keep=False)
        worker.kill()
        self._start_one(charged=tenant)

    def _give_back(self, worker: _Worker, tenant: str, keep: bool) -> None:
        with self._cond:
            self._due.pop(worker, None)
            self._busy -= 1
            _count(self._running, tenant, -1)
            if not keep:  # in the same breath: the tenant's count never dips before its charge
                _count(self._restarting, tenant, 1)
            if keep and not self._closed:
                self._idle.append(worker)
                # all: a waiter kept off the last worker would swallow a single notify
                self._cond.notify_all()
            else:
                self._all.discard(worker)

    def stalled(self, grace_s: float = STALL_GRACE_S) -> str:
        """Why no job can make progress now ('' when one can): workers that cannot start, or a
        job `grace_s` past its deadline and still not killed (for health checks)."""
        with self._cond:
            now = time.monotonic()
            late = [due for due in self._due.values() if now > due + grace_s]
            if late:
                return f"a {self.role} job is {now - min(late):.0f} s past its deadline"
            if self._start_error and not self._idle and not self._busy:
                return f"{self.role} workers cannot start: {self._start_error}"
            return ""

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> bool:
        """True once every worker is up (for tests and start-up checks)."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._idle) >= self.size, timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            workers = list(self._all)
            self._all.clear()
            self._idle.clear()
            self._cond.notify_all()
        for worker in workers:
            worker.kill()


class LazyPool:
    """A `WorkerPool` started on its first job (most engines never validate or render), closed
    with its owner."""

    def __init__(self, role: str, setup: dict[str, Any], workers: int, memory_bytes: int) -> None:
        self._args = (role, setup, workers, memory_bytes)
        self._pool: WorkerPool | None = None
        self._lock = threading.Lock()

    def run(self, job: dict[str, Any], deadline_s: float, wait_s: float, tenant: str) -> dict:
        with self._lock:
            if self._pool is None:
                self._pool = WorkerPool(*self._args)
            pool = self._pool
        return pool.run(job, deadline_s, wait_s, tenant)

    def stalled(self) -> str:
        pool = self._pool
        return pool.stalled() if pool is not None else ""

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def __del__(self) -> None:  # an owner dropped without closing: its workers go with it
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.close()


def _count(counts: dict[str, int], tenant: str, delta: int) -> None:
    n = counts.get(tenant, 0) + delta
    if n:
        counts[tenant] = n
    else:
        counts.pop(tenant, None)
