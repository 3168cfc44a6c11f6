"""Containment: a victim's inter-token latency beside each hostile request, over its latency alone.

Every case of the hostile corpus (`tests/hostile.py`) that has an engine form runs batched beside
a victim (greedy, 64 tokens), and so does a grammar whose masks are slow at decode time (past a
lenient compile probe, so the runtime mask budget has to catch it: the first repeat meets it
while decoding, later ones are refused at admission once it is downgraded). The victim's
inter-token latencies (token arrival gaps, the first token excluded) are measured per step. Each
case runs as alone / beside the hostile request / beside a benign neighbour (an ordinary greedy
request of the same length: the price of sharing a batch at all) / alone, `--repeats` times, so
a noisy machine slows them alike. Reports per case the p50 and p99 ratio beside/alone (target:
p50 <= 1.3) and the p50 ratio beside the hostile request / beside the benign one.

    .venv/bin/python benchmarks/containment.py [--tokens 64] [--repeats 2] [--cases a,b]

Writes `benchmarks/results/containment.json` and `containment.png`. With `--http`, the trust
boundary's classes (template, validation, body) over the real server instead, a victim tenant
streaming beside a hostile one (benchmarks/containment_http.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from hostile import CASES, SLOW_ONCE_REGEX, Case, engine_request  # noqa: E402

from services import LLM, SamplingParams  # noqa: E402
from services.compiler import CompilerConfig, build_provider  # noqa: E402
from services.engine.engine import LLMEngine  # noqa: E402
from services.models import load_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VICTIM = "The history of the printing press begins"


def victim_gaps(engine: LLMEngine, tokens: int, hostile: tuple[Any, SamplingParams] | None):
    """The victim's inter-token gaps (s) with `hostile` in the same batch (None: alone)."""
    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    victim = engine.add_request(VICTIM, sp)
    other = engine.add_request(*hostile) if hostile is not None else None
    arrivals, seen = [], 0
    while not victim.finished:
        engine.step()
        if victim.num_output_tokens > seen:
            seen = victim.num_output_tokens
            arrivals.append(time.perf_counter())
    while engine.has_unfinished():
        engine.step()
    outcome = None
    if other is not None:
        out = engine.make_output(other)
        outcome = {"finish_reason": out.finish_reason, "warnings": out.warnings[-1:]}
        engine.release(other.request_id)
    engine.release(victim.request_id)
    return [b - a for a, b in itertools.pairwise(arrivals[1:])], outcome  # the first excluded


BENIGN = Case("benign_neighbour", "baseline", None, {}, prompt=VICTIM)


def extra_cases() -> list[Case]:
    return [
        Case("slow_masks_at_decode_time", "mask", "mask", structured={"regex": SLOW_ONCE_REGEX}),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--http", action="store_true", help="the HTTP classes (containment_http.py)")
    ap.add_argument("--senders", type=int, default=2, help="--http: hostile connections")
    ap.add_argument("--rate", type=float, default=5.0, help="--http: requests/s per connection")
    args = ap.parse_args()
    if args.http:
        import containment_http

        wanted = set(filter(None, args.cases.split(",")))
        containment_http.run(args.tokens, args.repeats, args.senders, args.rate, wanted)
        return
    RESULTS.mkdir(exist_ok=True)
    loaded = load_model()
    served = LLM(loaded=loaded, kv_cache_memory=128 << 20)  # the compile service, as served
    # a probe that lets anything through: only the decode-time mask budget stands in the way
    lenient = CompilerConfig(mask_budget_ms=60_000)
    backend = served.engine.grammars.backend
    runtime = LLM(
        loaded=loaded,
        kv_cache_memory=128 << 20,
        grammar_provider=build_provider(backend, 1, config=lenient),
    )
    wanted = set(filter(None, args.cases.split(",")))
    cases = [c for c in [*extra_cases(), *CASES] if not wanted or c.name in wanted]
    defaults = {"max_tokens": args.tokens, "ignore_eos": True}
    victim_gaps(served.engine, 8, None)  # warm-up
    rows = []
    for case in cases:
        llm = runtime if case.name == "slow_masks_at_decode_time" else served
        engine = llm.engine
        alone: list[float] = []
        beside: list[float] = []
        benign: list[float] = []
        outcome = None
        for _ in range(args.repeats):
            alone += victim_gaps(engine, args.tokens, None)[0]
            try:
                hostile = engine_request(case, engine, **defaults)
            except ValueError as exc:  # refused while building its parameters
                outcome = {"finish_reason": "refused", "warnings": [str(exc)[:200]]}
                hostile = None
            gaps, seen = victim_gaps(engine, args.tokens, hostile)
            beside += gaps
            outcome = seen or outcome
            benign += victim_gaps(engine, args.tokens, engine_request(BENIGN, engine, **defaults))[
                0
            ]
            alone += victim_gaps(engine, args.tokens, None)[0]
        row = {
            "case": case.name,
            "group": case.group,
            "p50_ratio": statistics.median(beside) / statistics.median(alone),
            "p99_ratio": _p99(beside) / _p99(alone),
            "vs_benign_p50_ratio": statistics.median(beside) / statistics.median(benign),
            "benign_p50_ms": 1000 * statistics.median(benign),
            "alone_p50_ms": 1000 * statistics.median(alone),
            "beside_p50_ms": 1000 * statistics.median(beside),
            "hostile": outcome,
        }
        rows.append(row)
        print(
            f"{case.name:34s} p50 {row['p50_ratio']:.2f}x  p99 {row['p99_ratio']:.2f}x  "
            f"vs benign {row['vs_benign_p50_ratio']:.2f}x  ({row['beside_p50_ms']:.1f} ms; "
            f"alone {row['alone_p50_ms']:.1f}, benign {row['benign_p50_ms']:.1f})  "
            f"hostile: {outcome['finish_reason'] if outcome else '-'}",
            flush=True,
        )
    worst = max(rows, key=lambda r: r["p50_ratio"])
    print(f"worst p50 ratio: {worst['p50_ratio']:.2f} ({worst['case']}); target <= 1.3")
    worst = max(rows, key=lambda r: r["vs_benign_p50_ratio"])
    print(f"worst p50 ratio vs a benign neighbour: {worst['vs_benign_p50_ratio']:.2f}")
    (RESULTS / "containment.json").write_text(
        json.dumps({"args": vars(args), "rows": rows}, indent=2)
    )
    plot(rows)
    print(f"wrote {RESULTS / 'containment.json'}")


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def plot(rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 0.28 * len(rows) + 1.5))
    names = [r["case"] for r in rows]
    ax.barh(names, [r["p50_ratio"] for r in rows], color="tab:blue", label="p50")
    ax.scatter(
        [r["p99_ratio"] for r in rows], names, color="tab:orange", s=12, label="p99", zorder=3
    )
    benign = [r["benign_p50_ms"] / r["alone_p50_ms"] for r in rows]
    ax.scatter(benign, names, color="grey", marker="|", s=60, label="benign neighbour p50")
    ax.axvline(1.3, color="tab:red", ls="--", lw=0.8, label="target p50 1.3x")
    ax.axvline(1.0, color="grey", lw=0.6)
    ax.invert_yaxis()
    ax.set_xlabel("victim inter-token latency beside the request / alone")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Containment: a victim's latency beside each hostile request")
    fig.tight_layout()
    fig.savefig(RESULTS / "containment.png", dpi=120)


if __name__ == "__main__":
    main()
