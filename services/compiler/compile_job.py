"""The compile role of a sandbox worker (services/sandbox/worker.py): compiles one grammar at a
time, probes its masks, returns a verdict.

Its setup carries the serialized tokenizer info; the pool kills the worker when a compile runs
past its deadline, so nothing here needs to be interruptible.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import xgrammar as xgr

from services.compiler.probe import PROBE_STEPS, probe_masks
from services.grammar.workers import GrammarWorkers
from services.grammar.xgrammar_backend import XGrammarBackend

# A blob worth keeping loads in under `blob_gain` (0.8) of its compile; writing it is about twice
# loading, so one not written and read back within this many compiles is not worth keeping.
BLOB_WORK = 4.0
# Probe fills left behind (still running, on idle cores) past which the worker asks to be
# replaced: each holds its grammar's memory until it returns.
MAX_LEFT_BEHIND = 4


def handler(setup: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    info = xgr.TokenizerInfo.deserialize_json(setup["tokenizer_json"])
    backend = XGrammarBackend(tokenizer_info=info, cache=False)
    fills = GrammarWorkers(1, "probe")

    def handle(job: dict[str, Any]) -> dict[str, Any]:
        try:
            out = compile_job(backend, job, fills)
            if fills.stragglers("probe") >= MAX_LEFT_BEHIND:
                out["recycle"] = True  # the pool replaces this process (charged to the tenant)
            return out
        except MemoryError:
            return {"ok": False, "reason": "memory", "error": "compile ran out of its memory cap"}
        except Exception as exc:  # any backend failure is this grammar's, not the worker's
            return {"ok": False, "reason": "invalid", "error": f"compile failed: {exc!r}"[:300]}

    return handle


def compile_job(
    backend: Any, job: dict[str, Any], fills: GrammarWorkers | None = None
) -> dict[str, Any]:
    """`job`: `spec` (GrammarSpec JSON), `mask_budget_ms`, `probe_steps`, `hints` (text to probe
    along first), `blob_min_compile_s` (a quicker compile ships no blob: the replica compiles
    it again faster than it would load)."""
    from grammar_registry.specs import GrammarSpec
    from services.grammar.backend import GrammarError
    from services.grammar.canonical import to_structured

    spec = GrammarSpec.model_validate_json(job["spec"])
    so = to_structured(spec)
    start = time.perf_counter()
    try:
        compiled = backend.compile(so)
    except GrammarError as exc:  # the service names the field itself (`raise_for`)
        error = str(exc).removeprefix(f"structured.{so.kind}: ")
        return {"ok": False, "reason": "invalid", "error": error}
    compile_s = time.perf_counter() - start
    steps, budget = job.get("probe_steps", PROBE_STEPS), job["mask_budget_ms"]
    hints = job.get("hints", ())  # where the grammar's family was slow (grammar_registry/family.py)
    probe = probe_masks(backend, compiled, steps, job["seed"], 4 * budget, hints, workers=fills)
    mask_ms = probe.median_ms
    if probe.slow_path is not None or mask_ms > budget:
        shown = probe.worst_ms if probe.slow_path is not None else mask_ms
        what = "a mask takes" if probe.slow_path is not None else "masks take"
        return {
            "ok": False,
            "reason": "slow_mask",
            "error": f"{what} {shown:.1f} ms (budget {budget} ms)",
            "compile_s": compile_s,
            "mask_ms": shown,
            "slow_path": probe.slow_path,
        }
    verdict = {
        "ok": True,
        "warnings": compiled.warnings,
        "compile_s": compile_s,
        "mask_ms": mask_ms,
    }
    if compile_s < job.get("blob_min_compile_s", 0.0):
        return verdict
    return _with_blob(verdict, backend, compiled.handle, max(BLOB_WORK * compile_s, 1.0))


def _with_blob(verdict: dict[str, Any], backend: Any, handle: Any, budget_s: float) -> dict:
    """The verdict with the compressed blob and its load time, when writing and reading it back
    takes under `budget_s`. Writing costs more than compiling on big grammars (a 0.2 s compile:
    7 s to write 200 MB of JSON, 3 s to load it back), so it runs on a thread (xgrammar releases
    the GIL) that is left behind past the budget: such a blob would load slower than its grammar
    compiles, and its seconds never count against the grammar's deadline. The worker then asks
    to be replaced, which stops the thread."""
    out: dict[str, Any] = {}

    def write() -> None:
        blob = zlib.compress(handle.serialize_json().encode(), 1)
        start = time.perf_counter()
        backend.load(zlib.decompress(blob).decode())
        out.update(blob=blob, load_s=time.perf_counter() - start)

    thread = threading.Thread(target=write, name="blob", daemon=True)
    thread.start()
    thread.join(budget_s)
    if thread.is_alive():
        return {**verdict, "recycle": True}
    return {**verdict, **out}  # none when writing failed (memory): the grammar compiles anyway
