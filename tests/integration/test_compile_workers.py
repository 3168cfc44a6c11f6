"""Compile worker processes: how they start, how a pool that cannot start them answers, how they
die with their parent, and the mask-time probe past forced text.

The workers run our own entry point (`python -m services.sandbox.worker`), so they must work for
any caller: a script without a main guard, a script read from stdin.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import xgrammar as xgr

from grammar_registry import GrammarSpec
from grammar_registry.limits import GrammarLimits, check_limits
from services.compiler import CompilerConfig, CompileService
from services.compiler.compile_job import compile_job
from services.grammar.xgrammar_backend import XGrammarBackend
from services.sandbox import WorkerPool

ROOT = Path(__file__).resolve().parents[2]
YEAR = "(19|20)[0-9]{2}"
# 61 characters the grammar forces (the old probe spent all 8 steps in them), then the choices.
PREFIX = '"' + "abcdefghij" * 6
# (.{0,8}){0,8}: 64 repetitions of `.`, under max_repeat, compiles in ~0.04 s, and then costs
# ~450 ms for its first mask (2-core CPU, SmolLM2's 49k vocabulary; seconds for the next ones).
SLOW = PREFIX + "(.{0,8}){0,8}"

NO_GUARD = f"""
import json
from services import LLM, SamplingParams, StructuredOutput

llm = LLM(kv_cache_memory=64 << 20)  # grammar_workers defaults to 1: the compile service
params = SamplingParams(max_tokens=6, temperature=0, structured=StructuredOutput(regex={YEAR!r}))
out = llm.generate("A year:", params)[0]
provider = llm.engine.grammars.provider
pool = provider.service.pool
print("RESULT " + json.dumps({{
    "text": out.text, "finish": out.finish_reason, "warnings": out.warnings,
    "provider": type(provider).__name__, "jobs": pool.jobs,
    "pids": [w.proc.pid for w in pool._all],
}}))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _alive(pid: int) -> bool:
    try:  # a zombie nobody reaps (PID 1 in a container may not) counts as dead
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _gone(pids: list[int], within_s: float) -> bool:
    end = time.monotonic() + within_s
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_scripts_without_a_main_guard_compile_in_workers(how, tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(NO_GUARD)
    argv, stdin = (
        ([sys.executable, str(script)], None)
        if how == "file"
        else ([sys.executable, "-"], NO_GUARD)
    )
    run = subprocess.run(
        argv, input=stdin, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240
    )
    found = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and found, run.stderr[-3000:]
    out = json.loads(found[-1].removeprefix("RESULT "))
    assert out["provider"] == "ServiceGrammarProvider" and out["jobs"] >= 1
    assert re.fullmatch(YEAR, out["text"]), out
    assert out["finish"] == "stop" and out["warnings"] == []
    assert out["pids"] and _gone(out["pids"], 5.0)  # the workers ended with their parent


@pytest.fixture(scope="module")
def info(tokenizer) -> str:
    return xgr.TokenizerInfo.from_huggingface(tokenizer).serialize_json()


def _job(spec: GrammarSpec | str, budget_ms: float = 20.0, steps: int = 8) -> dict:
    spec = GrammarSpec(kind="regex", source=spec) if isinstance(spec, str) else spec
    return {
        "spec": spec.model_dump_json(),
        "mask_budget_ms": budget_ms,
        "probe_steps": steps,
        "seed": 0,
    }


def test_workers_die_with_their_parent_even_mid_compile(info, tmp_path):
    (tmp_path / "info.json").write_text(info)
    # A budget so large the probe walks all 100 steps, each mask taking seconds: minutes in all.
    (tmp_path / "job.json").write_text(json.dumps(_job("(.?){0,1000}", budget_ms=1e9, steps=100)))
    # The parent SIGKILLs itself while its worker is inside those masks: no EOF reaches the worker
    # then, only the parent-death signal.
    script = textwrap.dedent(f"""
        import json, os, signal, threading, time
        from pathlib import Path
        from services.sandbox import WorkerPool
        here = Path({str(tmp_path)!r})
        pool = WorkerPool("compile", {{"tokenizer_json": (here / "info.json").read_text()}}, 1)
        assert pool.wait_ready(120)
        job = json.loads((here / "job.json").read_text())
        threading.Thread(target=pool.run, args=(job, 600.0, 1.0), daemon=True).start()
        time.sleep(1.0)
        assert pool.jobs == 1
        print("PIDS", *[w.proc.pid for w in pool._all], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    # Files, not pipes: a surviving worker would hold a pipe open and make run() wait for it.
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("w") as stdout, err.open("w") as stderr:
        code = subprocess.run(
            [sys.executable, "-c", script],
            cwd=ROOT,
            env=_env(),
            stdout=stdout,
            stderr=stderr,
            timeout=240,
        ).returncode
    assert code == -signal.SIGKILL, err.read_text()[-3000:]
    pids = [
        int(p)
        for ln in out.read_text().splitlines()
        if ln.startswith("PIDS")
        for p in ln.split()[1:]
    ]
    try:
        assert pids and _gone(pids, 3.0)
    finally:
        for pid in filter(_alive, pids):  # a survivor would burn a core for a minute
            os.kill(pid, signal.SIGKILL)


def test_a_pool_that_cannot_start_workers_says_why_at_once(info):
    # 64 MiB of address space: the worker cannot even build the backend (torch alone maps more).
    pool = WorkerPool("compile", {"tokenizer_json": info}, 1, memory_bytes=64 << 20)
    try:
        start = time.monotonic()
        first = pool.run(_job("[a-z]+"), deadline_s=10, wait_s=120)
        waited = time.monotonic() - start
        assert first["reason"] == "unavailable", first
        assert waited < 60  # answered when the start failed, not after wait_s
        start = time.monotonic()
        again = pool.run(_job("[a-z]+"), deadline_s=10, wait_s=120)
        assert again["reason"] == "unavailable" and time.monotonic() - start < 2.0
        assert again["error"].startswith("compile workers cannot start: ")
        assert re.search("MemoryError|bad_alloc", again["error"]), again  # the cause, named
        assert len(again["error"]) < 400
        assert pool.jobs == 0
    finally:
        pool.close()


def test_a_missing_interpreter_is_named(info, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/nonexistent/python3")
    pool = WorkerPool("compile", {"tokenizer_json": info}, 1)
    try:
        out = pool.run(_job("[a-z]+"), deadline_s=10, wait_s=30)
        assert out["reason"] == "unavailable", out
        assert "/nonexistent/python3" in out["error"], out
    finally:
        pool.close()


@pytest.fixture(scope="module")
def backend(info) -> XGrammarBackend:
    return XGrammarBackend(tokenizer_info=xgr.TokenizerInfo.deserialize_json(info), cache=False)


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
PROBED = [
    ("slow after a forced prefix", GrammarSpec(kind="regex", source=SLOW), "slow_mask"),
    (
        "slow alternation after a forced prefix",
        GrammarSpec(kind="regex", source=PREFIX + "(.|..|...){0,300}"),
        "slow_mask",
    ),
    ("regex after a forced prefix", GrammarSpec(kind="regex", source=PREFIX + "[a-z]{1,20}"), None),
    # compact: `{"name":"` is forced
    ("schema", GrammarSpec(kind="json_schema", source=PERSON, options={"compact": True}), None),
    ("all forced", GrammarSpec(kind="choice", source=["only-answer"]), None),
]


@pytest.mark.parametrize(("name", "spec", "reason"), PROBED, ids=[p[0] for p in PROBED])
def test_the_probe_times_masks_past_forced_text(name, spec, reason, backend):
    check_limits(spec, GrammarLimits())  # what a tenant may send
    out = compile_job(backend, _job(spec))
    if reason is None:
        assert out["ok"], out
        assert out["mask_ms"] < 20.0
    else:
        assert not out["ok"] and out["reason"] == reason, out
        assert out["mask_ms"] > 20.0 and out["compile_s"] < 2.0


def test_the_service_refuses_the_slow_grammar_behind_a_forced_prefix(info):
    svc = CompileService(
        xgr.TokenizerInfo.deserialize_json(info), CompilerConfig(workers=1, deadline_s=20)
    )
    try:
        slow = svc.verdict(GrammarSpec(kind="regex", source=SLOW))
        assert not slow.ok and slow.reason == "slow_mask", slow
        fine = svc.verdict(GrammarSpec(kind="regex", source=PREFIX + "[0-9]{4}"))
        assert fine.ok, fine
        assert svc.pool.kills == 0
    finally:
        svc.close()
