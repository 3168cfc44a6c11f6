"""The one thread every sandbox worker is forked from (pool.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class Spawner:
    """Forks every worker from one thread that lives as long as the process: a child's
    PR_SET_PDEATHSIG fires when the *thread* that forked it exits, and start threads do not last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._calls: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._wake = threading.Condition(self._lock)

    def call(self, fn: Callable[[], T]) -> T:
        fut: Future[T] = Future()
        with self._lock:
            # not alive after a fork too: the child process starts its own thread
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="sandbox-worker-spawner", daemon=True
                )
                self._thread.start()
            self._calls.append((fn, fut))
            self._wake.notify()
        return fut.result()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._calls:
                    self._wake.wait()
                fn, fut = self._calls.pop(0)
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the caller's thread
                fut.set_exception(exc)
