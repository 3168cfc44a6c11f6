"""Grammar backends side by side over maskbench: cold time to first mask, and mask fills per step.

1. Cold time to first mask per backend (`xgrammar`, `llguidance`, `auto`): for each schema, in
   this process with no cache (xgrammar's compiler cache off), the time from the spec to the first
   filled bitmask row: compile (or, for llguidance, build the matcher) + a state + one fill.
   Schemas a backend refuses count apart. Target for `auto`: p99 <= 50 ms.
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

from services.engine.grammar.backend import GrammarError  # noqa: E402
from services.engine.grammar.backends import Backends  # noqa: E402
from services.engine.grammar.xgrammar_backend import XGrammarBackend  # noqa: E402
from services.engine.params import StructuredOutput  # noqa: E402
from services.models import load_model  # noqa: E402

MASKBENCH = ROOT.parent / "shared" / "data" / "maskbench"
RESULTS = Path(__file__).resolve().parent / "results"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def make_backends(default: str) -> Backends:
    loaded = load_model()
    tok = loaded.tokenizer
    vocab = int(loaded.model.config.vocab_size)
    cold = XGrammarBackend(tok, vocab, [tok.eos_token_id], cache=False)  # every compile cold
    return Backends(tok, vocab, [tok.eos_token_id], default, xgrammar=cold)


def first_masks(backends: Backends, schemas: list[tuple[str, dict]]) -> dict[str, Any]:
    times, refused, chosen = [], 0, {"xgrammar": 0, "llguidance": 0}
    mask = backends.allocate_bitmask(1)
    for i, (_, schema) in enumerate(schemas):
        start = time.perf_counter()
        try:
            compiled = backends.compile(StructuredOutput(json_schema=schema))
            backends.new_state(compiled).fill_bitmask(mask, 0)
        except GrammarError:
            refused += 1
            continue
        times.append(time.perf_counter() - start)
        chosen[compiled.backend] += 1
        if (i + 1) % 100 == 0:
            print(f"    {i + 1}/{len(schemas)}", flush=True)
    return {
        "built": len(times),
        "refused": refused,
        "chosen": chosen,
        **{f"p{q}_ms": pct(times, q / 100) * 1e3 for q in (50, 95, 99)},
        "max_ms": max(times, default=float("nan")) * 1e3,
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
    print(f"\n{len(schemas)} schemas; cold time to first mask (ms), fills per step at batch 32")
    print(
        f"{'backend':11} {'built':>5} {'refused':>7} {'p50':>7} {'p95':>7} {'p99':>7} {'fill32':>7}"
    )
    for name in ("xgrammar", "llguidance", "auto"):
        r = out[name]
        fill = r.get("fill_batch32_ms", float("nan"))
        print(
            f"{name:11} {r['built']:7d} {r['refused']:7d} {r['p50_ms']:7.2f} {r['p95_ms']:7.2f} "
            f"{r['p99_ms']:7.2f} {fill:7.2f}  {r['chosen']}"
        )
    return out


if __name__ == "__main__":
    main()
