"""Grammar backends side by side over maskbench: cold time to first mask, and mask fills per step.

1. Cold time to first mask per backend (`xgrammar`, `llguidance`, `auto`): for each schema, in
   this process with no cache (xgrammar's compiler cache off), the time from the spec to the first
   filled bitmask row: compile (or, for llguidance, build the matcher) + a state + one fill.
   Schemas a backend refuses count apart. Target for `auto`: p99 <= 50 ms. "With admission" adds
   what admission does before a grammar is served: the static limits and the mask-time probe
   (services/compiler/probe.py; the compile workers' IPC and blob handling are left out, see
   benchmarks/grammar_cache.py); a probe over the 20 ms budget counts as refused there.
2. Mask-fill time per step at batch 32: 32 schemas both backends build, one state each; every
   step fills the 32 rows of one bitmask, then each state accepts a token its mask allows (the
   lowest allowed id: a deterministic walk), for `--steps` steps. Reported per step.

Also run by `benchmarks/grammar_cache.py --backends`. Writes
`benchmarks/results/grammar_backends.json`.

    .venv/bin/python benchmarks/grammar_backends.py [--limit N] [--steps 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.measure import pct  # noqa: E402
from grammar_registry.limits import GrammarLimits, check_limits  # noqa: E402
from services.compiler.probe import PROBE_STEPS, probe_masks  # noqa: E402
from services.grammar.backend import GrammarError  # noqa: E402
from services.grammar.backends import Backends  # noqa: E402
from services.grammar.canonical import to_spec  # noqa: E402
from services.grammar.structured import StructuredOutput  # noqa: E402
from services.grammar.xgrammar_backend import XGrammarBackend  # noqa: E402
from services.models import load_model  # noqa: E402

MASKBENCH = ROOT.parent / "shared" / "data" / "maskbench"
RESULTS = Path(__file__).resolve().parent / "results"


def make_backends(default: str) -> Backends:
    loaded = load_model()
    tok = loaded.tokenizer
    vocab = int(loaded.model.config.vocab_size)
    cold = XGrammarBackend(tok, vocab, [tok.eos_token_id], cache=False)  # every compile cold
    backends = Backends(tok, vocab, [tok.eos_token_id], default, xgrammar=cold)
    backends.llguidance  # its tokenizer scan is start-up, not the first grammar's  # noqa: B018
    return backends


def first_masks(
    backends: Backends, schemas: list[tuple[str, dict]], budget_ms: float = 20.0
) -> dict[str, Any]:
    times, admitted, refused, chosen = [], [], 0, {"xgrammar": 0, "llguidance": 0}
    mask = backends.allocate_bitmask(1)
    limits = GrammarLimits()
    for i, (_, schema) in enumerate(schemas):
        spec = StructuredOutput(json_schema=schema)
        start = time.perf_counter()
        try:
            compiled = backends.compile(spec)
            backends.new_state(compiled).fill_bitmask(mask, 0)
        except GrammarError:  # the backend refuses the schema
            refused += 1
            continue
        first = time.perf_counter() - start
        times.append(first)
        chosen[compiled.backend] += 1
        start = time.perf_counter()  # admission's part, measured apart: an upper bound
        try:
            check_limits(to_spec(spec), limits)
            backend = backends.get(compiled.backend)
            probe = probe_masks(backend, compiled, PROBE_STEPS, 0, 4 * budget_ms)
        except (GrammarError, ValueError):  # LimitExceeded is a ValueError
            continue  # built, but admission refuses it
        if probe.slow_path is None and probe.median_ms <= budget_ms:
            admitted.append(first + time.perf_counter() - start)
        if (i + 1) % 100 == 0:
            print(f"    {i + 1}/{len(schemas)}", flush=True)
    return {
        "built": len(times),
        "refused": refused,
        "chosen": chosen,
        **{f"p{q}_ms": pct(times, q / 100) * 1e3 for q in (50, 95, 99)},
        "max_ms": max(times, default=float("nan")) * 1e3,
        "admitted": len(admitted),
        **{f"admitted_p{q}_ms": pct(admitted, q / 100) * 1e3 for q in (50, 95, 99)},
    }


def fills_per_step(backends: Backends, name: str, schemas: list[dict], steps: int) -> float:
    states = [
        backends.new_state(backends.compile(StructuredOutput(json_schema=s, backend=name)))
        for s in schemas
    ]
    mask = backends.allocate_bitmask(len(states))
    bits = torch.arange(32, dtype=torch.int32)
    total = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        for row, state in enumerate(states):
            state.fill_bitmask(mask, row)
        total += time.perf_counter() - start
        allowed = ((mask[:, :, None] >> bits) & 1).reshape(len(states), -1)
        for row, state in enumerate(states):
            ids = allowed[row].nonzero()
            if len(ids) and not state.is_terminated():
                state.accept_token(int(ids[0]))
    return total / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--steps", type=int, default=32)
    args = p.parse_args()
    run(args.limit, args.steps)


def run(limit: int, steps: int) -> dict[str, Any]:
    files = sorted(MASKBENCH.glob("*.json"))[: limit or None]
    schemas = [(f.name, json.loads(f.read_text())["schema"]) for f in files]
    out: dict[str, Any] = {"schemas": len(schemas)}
    for name in ("xgrammar", "llguidance", "auto"):
        print(f"  cold time to first mask, {name}...", flush=True)
        out[name] = first_masks(make_backends(name), schemas)
    backends = make_backends("xgrammar")
    both = []
    for _, schema in schemas:
        try:
            for name in ("xgrammar", "llguidance"):
                backends.compile(StructuredOutput(json_schema=schema, backend=name))
        except GrammarError:
            continue
        both.append(schema)
        if len(both) == 32:
            break
    for name in ("xgrammar", "llguidance"):
        out[name]["fill_batch32_ms"] = fills_per_step(backends, name, both, steps) * 1e3
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "grammar_backends.json").write_text(json.dumps(out, indent=2) + "\n")
    report(out)
    return out


def report(out: dict[str, Any]) -> None:
    print(f"\n{out['schemas']} schemas; cold time to first mask (ms) without and with admission")
    print("(static limits + mask probe), mask fills per step at batch 32 (ms)")
    head = ("backend", "built", "refused", "p50", "p95", "p99", "admitted", "p50", "p95", "p99")
    print(f"{head[0]:11} {head[1]:>5} {head[2]:>7}" + "".join(f" {h:>8}" for h in head[3:]), end="")
    print(f" {'fill32':>7}")
    for name in ("xgrammar", "llguidance", "auto"):
        r = out[name]
        fill = r.get("fill_batch32_ms", float("nan"))
        cells = [r[f"p{q}_ms"] for q in (50, 95, 99)]
        admitted = [r[f"admitted_p{q}_ms"] for q in (50, 95, 99)]
        print(
            f"{name:11} {r['built']:5d} {r['refused']:7d}"
            + "".join(f" {c:8.2f}" for c in cells)
            + f" {r['admitted']:8d}"
            + "".join(f" {c:8.2f}" for c in admitted)
            + f" {fill:7.2f}  {r['chosen']}"
        )


if __name__ == "__main__":
    main()
