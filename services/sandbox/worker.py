"""A worker process: answers one job at a time for its role until the pool closes the socket.

Run as `python -m services.sandbox.worker FD PARENT_PID` by the pool (pool.py), FD being its end
of a socketpair. The first message is its setup (`role`, `memory_bytes`, and what the role needs);
it caps its own address space, builds the role's handler, says it is ready, then answers jobs. The
pool kills it when a job runs past its deadline; nothing here needs to be interruptible.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import resource
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# role -> "module:function": the function takes the setup and returns the job handler. Imported
# in the worker only, so a validation worker never imports xgrammar or torch.
ROLES = {
    "compile": "services.compiler.compile_job:handler",
    "validate": "services.sandbox.validate:handler",
    "render": "services.sandbox.render:handler",
}

Handler = Callable[[dict[str, Any]], dict[str, Any]]


def main(argv: list[str]) -> None:
    """The entry point the pool runs: `FD PARENT_PID`."""
    fd, parent = int(argv[0]), int(argv[1])
    die_with_parent(parent)
    conn = Connection(fd)
    try:
        setup = conn.recv()
    except EOFError:  # the pool gave up on this start
        return
    worker_main(conn, setup)


def die_with_parent(parent: int) -> None:
    """SIGKILL this worker when the pool's process dies, even mid-job: EOF on the socket only
    reaches a worker between jobs, and a hostile job can run for minutes."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl in this libc: EOF still ends the worker
        return
    if os.getppid() != parent:  # the pool died before prctl took effect: no signal will come
        os._exit(1)


def worker_main(conn: Connection, setup: dict[str, Any]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    module, _, function = ROLES[setup["role"]].partition(":")
    # The role's imports map their libraries before the cap (torch's alone map gigabytes of
    # address space on a CUDA build); what the handler builds and every job live under it.
    factory = getattr(importlib.import_module(module), function)
    memory_bytes = int(setup.get("memory_bytes") or 0)
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    handle: Handler = factory(setup)
    printed = _capture_stderr()  # after start-up: the pool reports the errors before it
    conn.send({"ready": True, "pid": os.getpid()})
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        try:
            result = handle(job)
        except MemoryError:
            result = {"ok": False, "reason": "memory", "error": "the job ran out of its memory cap"}
        except Exception as exc:  # the job's input is at fault, not the worker
            result = {"ok": False, "reason": "invalid", "error": f"{exc!r}"[:300]}
        result["log"] = _read_new(printed)
        conn.send(result)


def _capture_stderr() -> Any:
    """Native libraries (xgrammar's loosening warnings) print straight to fd 2: keep them in a
    file and hand each job's lines back, so the service logs them (once, at debug level)."""
    import tempfile

    log = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the process)
    os.dup2(log.fileno(), 2)
    return log


def _read_new(log: Any, max_lines: int = 20) -> list[str]:
    log.seek(0)
    lines = log.read().decode(errors="replace").splitlines()[-max_lines:]
    log.seek(0)
    log.truncate()
    return lines


if __name__ == "__main__":
    main(sys.argv[1:])
