"""A bounded pool of long-lived compile worker processes, each killed and replaced on a deadline.

xgrammar cannot be cancelled, so the only safe deadline is a process boundary: the caller waits on
the worker's pipe for at most the deadline, then SIGKILLs it and a replacement starts in the
background. Workers are spawned (not forked: the parent holds threads and torch state).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
import time
from multiprocessing.process import BaseProcess
from typing import Any

from services.compiler.worker import worker_main

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # a cold start imports xgrammar and torch


class _Worker:
    def __init__(self, ctx: Any, tokenizer_json: str, memory_bytes: int) -> None:
        self.conn, child = ctx.Pipe()
        self.proc: BaseProcess = ctx.Process(
            target=worker_main, args=(child, tokenizer_json, memory_bytes), daemon=True
        )
        self.proc.start()
        child.close()

    def wait_ready(self, timeout: float) -> bool:
        try:
            return bool(self.conn.poll(timeout) and self.conn.recv().get("ready"))
        except (EOFError, OSError):
            return False

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class WorkerPool:
    def __init__(self, tokenizer_json: str, workers: int = 2, memory_bytes: int = 4 << 30) -> None:
        self._ctx = mp.get_context("spawn")
        self._tokenizer_json = tokenizer_json
        self._memory = memory_bytes
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: set[_Worker] = set()  # idle or busy: close() kills them all
        self._closed = False
        self.size = workers
        self.kills = 0
        self.jobs = 0
        for _ in range(workers):
            self._start_one()

    def _start_one(self) -> None:
        def start() -> None:
            while not self._closed:
                worker = _Worker(self._ctx, self._tokenizer_json, self._memory)
                self._all.add(worker)
                if worker.wait_ready(START_TIMEOUT_S) and not self._closed:
                    self._idle.put(worker)
                    return
                if self._closed:  # closed while it started: nobody else will kill it
                    self._all.discard(worker)
                    worker.kill()
                    return
                log.error("compile worker failed to start; retrying")
                self._all.discard(worker)
                worker.kill()
                time.sleep(1.0)

        threading.Thread(target=start, name="compile-worker-start", daemon=True).start()

    def run(self, job: dict[str, Any], deadline_s: float, wait_s: float) -> dict[str, Any]:
        """The worker's answer, or a refusal: `busy` when no worker frees up within `wait_s`,
        `timeout` when the compile runs past `deadline_s`, `crash` when the worker dies."""
        try:
            worker = self._idle.get(timeout=wait_s)
        except queue.Empty:
            return {"ok": False, "reason": "busy", "error": "no compile worker free; try later"}
        self.jobs += 1
        try:
            worker.conn.send(job)
            if worker.conn.poll(deadline_s):
                result: dict[str, Any] = worker.conn.recv()
                self._idle.put(worker)
                for line in result.pop("log", []):
                    log.debug("xgrammar: %s", line)
                return result
            reason, error = "timeout", f"compile exceeded its {deadline_s:g} s deadline"
        except Exception:  # EOF, a broken pipe, an unreadable reply: the worker is not trusted
            reason, error = "crash", "the compile worker died (memory cap or a backend fault)"
        self.kills += 1
        self._all.discard(worker)
        worker.kill()
        self._start_one()
        return {"ok": False, "reason": reason, "error": error}

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> bool:
        """True once every worker is up (for tests and start-up checks)."""
        end = time.monotonic() + timeout
        while self._idle.qsize() < self.size and time.monotonic() < end:
            time.sleep(0.05)
        return self._idle.qsize() >= self.size

    def close(self) -> None:
        self._closed = True
        for worker in list(self._all):
            worker.kill()
        self._all.clear()
