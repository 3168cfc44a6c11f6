"""A sandbox worker process (pool.py keeps a pool of them), and the one thread every worker is
forked from."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, Any, TypeVar

from services import settings

log = logging.getLogger(__name__)
T = TypeVar("T")

ERROR_CHARS = 300  # of a failed start's stderr, in the refusal
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


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


SPAWNER = Spawner()


def child_env() -> dict[str, str]:
    import grammar_registry
    import services

    # The child imports the same code as this process, whatever its working directory.
    pkgs = (services, grammar_registry)
    roots = sorted({str(Path(str(pkg.__file__)).resolve().parents[1]) for pkg in pkgs})
    return settings.worker_env(roots)


# -P (3.11+): the working directory is not put on the child's sys.path, so a stray `xgrammar.py`
# next to the caller's script cannot shadow the real one.
PYTHON_FLAGS = ["-P"] if sys.version_info >= (3, 11) else []


class WorkerProcess:
    """One worker process and its end of a socketpair, pickled messages both ways."""

    def __init__(self, role: str, setup: dict[str, Any], memory_bytes: int) -> None:
        self.role = role
        self._setup = {**setup, "role": role, "memory_bytes": memory_bytes}
        # Start-up errors (an import failing, the memory cap) land here; after its `ready` the
        # worker points fd 2 at a capture file of its own.
        self.stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (closed once started)
        mine, theirs = socket.socketpair()
        argv = [sys.executable, *PYTHON_FLAGS, "-m", "services.sandbox.worker"]
        argv += [str(theirs.fileno()), str(os.getpid())]
        try:
            self.proc = SPAWNER.call(
                lambda: subprocess.Popen(
                    argv,
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,  # a pipe the caller reads must not stay open
                    stderr=self.stderr,
                    env=child_env(),
                )
            )
        except BaseException:
            mine.close()
            self.stderr.close()
            raise
        finally:
            theirs.close()
        self.conn = Connection(mine.detach())

    def start(self, timeout: float) -> str:
        """'' once the worker is ready, else why it is not (its stderr tail, or how it ended)."""
        # A big setup (a compile worker's tokenizer info: megabytes) blocks the send until the
        # child reads it: one timer bounds the send and the handshake together.
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        began = time.monotonic()
        try:
            self.conn.send(self._setup)
            ready = bool(self.conn.recv().get("ready"))
        except Exception:  # EOF, a broken pipe, a garbled reply: the start failed
            ready = False
        finally:
            timer.cancel()
        if ready:
            self.stderr.close()
            return ""
        try:  # it is usually exiting already: let it, so its own exit status is the one reported
            self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            log.debug("%s worker %d still running after a failed start", self.role, self.proc.pid)
        self.kill()
        code = self.proc.returncode
        ended = f"exit status {code}" if code is None or code >= 0 else f"killed by signal {-code}"
        if code == -9 and time.monotonic() - began >= timeout:
            ended += f": no answer within {timeout:g} s"
        return _tail(self.stderr, ended)

    def cpu_seconds(self) -> float | None:
        """The CPU time (user + system) of the process's main thread, where jobs run (threads a
        job left behind run on idle cores and are not its cost), or None where /proc cannot
        tell it."""
        pid = self.proc.pid
        try:
            with open(f"/proc/{pid}/task/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
        except (OSError, IndexError, ValueError):
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # unkillable (D state): leave it, never hang here
            log.warning("%s worker %d did not exit after SIGKILL", self.role, self.proc.pid)
        self.conn.close()


def _tail(stderr: IO[bytes], ended: str) -> str:
    try:
        stderr.seek(0)
        lines = [ln.strip() for ln in stderr.read().decode(errors="replace").splitlines()]
    except (OSError, ValueError):
        lines = []
    finally:
        stderr.close()
    # A traceback's last lines name the failing call and the exception: keep the tail, less
    # 3.11's `^^^^` markers.
    tail = " | ".join([ln for ln in lines if ln.strip("^~ ")][-3:])
    text = f"{tail} ({ended})" if tail else ended
    return text if len(text) <= ERROR_CHARS else "..." + text[-ERROR_CHARS:]
