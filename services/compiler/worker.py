"""A compile worker process: compiles one grammar at a time, probes its masks, returns a verdict.

Run as `python -m services.compiler.worker FD PARENT_PID` by the pool (pool.py), FD being its end of
a socketpair. It receives the serialized tokenizer info as the first message, caps its own address
space, and answers jobs until the pool closes the socket or dies. The pool kills it when a compile
runs past its deadline; nothing here needs to be interruptible.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys
import time
import zlib
from multiprocessing.connection import Connection
from typing import Any

from services.compiler.probe import PROBE_STEPS, probe_masks

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def main(argv: list[str]) -> None:
    """The entry point the pool runs: `FD PARENT_PID`."""
    fd, parent = int(argv[0]), int(argv[1])
    _die_with_parent(parent)
    conn = Connection(fd)
    try:
        setup = conn.recv()
    except EOFError:  # the pool gave up on this start
        return
    worker_main(conn, setup["tokenizer_json"], setup["memory_bytes"])


def _die_with_parent(parent: int) -> None:
    """SIGKILL this worker when the pool's process dies, even mid-compile: EOF on the socket only
    reaches a worker between jobs, and a hostile compile can run for minutes."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl in this libc: EOF still ends the worker
        return
    if os.getppid() != parent:  # the pool died before prctl took effect: no signal will come
        os._exit(1)


def worker_main(conn: Connection, tokenizer_json: str, memory_bytes: int) -> None:
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import xgrammar as xgr

    from services.engine.grammar.xgrammar_backend import XGrammarBackend

    backend = XGrammarBackend(
        tokenizer_info=xgr.TokenizerInfo.deserialize_json(tokenizer_json), cache=False
    )
    backend_log = _capture_stderr()  # after start-up: the pool reports the errors before it
    conn.send({"ready": True, "pid": os.getpid()})
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        try:
            result = compile_job(backend, job)
        except MemoryError:
            result = {"ok": False, "reason": "memory", "error": "compile ran out of its memory cap"}
        except Exception as exc:  # any backend failure is this grammar's, not the worker's
            result = {"ok": False, "reason": "invalid", "error": f"compile failed: {exc!r}"[:300]}
        result["log"] = _read_new(backend_log)
        conn.send(result)


def _capture_stderr() -> Any:
    """xgrammar's C++ side prints its loosening warnings straight to fd 2: keep them in a file
    and hand each job's lines back, so the service logs them (once, at debug level) instead."""
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


def compile_job(backend: Any, job: dict[str, Any]) -> dict[str, Any]:
    """`job`: `spec` (GrammarSpec JSON), `mask_budget_ms`, `probe_steps`, `blob_min_compile_s`
    (a quicker compile ships no blob: the replica compiles it again faster than it would load)."""
    from grammar_registry.specs import GrammarSpec
    from services.compiler.specs import to_structured
    from services.engine.grammar.backend import GrammarError

    spec = GrammarSpec.model_validate_json(job["spec"])
    so = to_structured(spec)
    start = time.perf_counter()
    try:
        compiled = backend.compile(so)
    except GrammarError as exc:  # the service names the field itself (`raise_for`)
        error = str(exc).removeprefix(f"structured.{so.kind}: ")
        return {"ok": False, "reason": "invalid", "error": error}
    compile_s = time.perf_counter() - start
    steps = job.get("probe_steps", PROBE_STEPS)
    mask_ms = probe_masks(backend, compiled, steps, job["seed"], 4 * job["mask_budget_ms"])
    if mask_ms > job["mask_budget_ms"]:
        return {
            "ok": False,
            "reason": "slow_mask",
            "error": f"masks take {mask_ms:.1f} ms (budget {job['mask_budget_ms']} ms)",
            "compile_s": compile_s,
            "mask_ms": mask_ms,
        }
    verdict = {
        "ok": True,
        "warnings": compiled.warnings,
        "compile_s": compile_s,
        "mask_ms": mask_ms,
    }
    if compile_s < job.get("blob_min_compile_s", 0.0):
        return verdict
    blob_json = compiled.handle.serialize_json()
    blob = zlib.compress(blob_json.encode(), 1)
    start = time.perf_counter()
    backend.load(zlib.decompress(blob).decode())
    load_s = time.perf_counter() - start
    return {**verdict, "load_s": load_s, "blob": blob}


if __name__ == "__main__":
    main(sys.argv[1:])
