"""The KV host tier: Quest with every page resident vs Quest parking cold pages in host memory.

Same model, same prompts, in one run. The resident engine has a pool large enough for every
context; the tiered engine's device pool holds only `--device-pages` pages (fewer than any
context here), the rest of each request living in the host tier. For each context and hot-set
size (0, 1x and 2x the Quest budget): decode step time relative to all-resident Quest, pages and
bytes moved per step, the selection hit rate, the most device pages the request held, and whether
the tokens equal the all-resident ones (greedy). On CPU the "device" pool is host memory too, so
the ratio is the tier's bookkeeping overhead; `--device cuda` runs the same on a GPU (pinned
arena, side-stream recalls).

    .venv/bin/python benchmarks/kv_tier.py [--contexts 2048,4096] [--steps 32] [--device cpu|cuda]

Writes `benchmarks/results/kv_tier.json` and `kv_tier.png`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.long_context import essays_text
from services import LLM, KVPolicy, SamplingParams
from services.engine.engine import LLMEngine
from services.engine.kv_offload import RECENT_PAGES
from services.models import load_model

RESULTS = Path(__file__).resolve().parent / "results"


def decode_run(engine: LLMEngine, prompt: list[int], kv: KVPolicy, steps: int) -> dict[str, Any]:
    """Prefills, then times `steps` decode steps of one request alone."""
    tier = engine.kv_tier
    num_pages = engine.runner.kv.num_pages
    sp = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True, kv=kv)
    req = engine.add_request(prompt, sp)
    if req.finished:
        raise SystemExit(f"refused: {req.warnings}")
    while req.num_output_tokens < 2:  # prefill and the first decode step
        engine.step()
    times: list[float] = []
    moved = [0.0] * 5  # bytes to device, bytes to host, layer-pages read, hits, misses
    most_device = 0
    while not req.finished:
        before = _tier_counters(tier)
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        moved = [m + a - b for m, a, b in zip(moved, _tier_counters(tier), before, strict=True)]
        most_device = max(most_device, sum(1 for p in req.pages if p < num_pages))
    tokens = req.output_token_ids
    engine.release(req.request_id)
    n = len(times)
    return {
        "step_ms": 1000 * statistics.median(times),
        "bytes_per_step": (moved[0] + moved[1]) / n,
        "layer_pages_per_step": moved[2] / n,
        "hits": moved[3],
        "misses": moved[4],
        "device_pages": most_device,
        "tokens": tokens,
        "recall_p50_ms": tier.recall_latency_ms(50) if tier else None,
        "recall_p99_ms": tier.recall_latency_ms(99) if tier else None,
    }


def _tier_counters(tier: Any) -> list[float]:
    if tier is None:
        return [0.0] * 5
    return [
        tier.bytes_to_device,
        tier.bytes_to_host,
        tier.layer_pages_recalled,
        tier.hits,
        tier.misses,
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="2048,4096")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--device-pages", type=int, default=64)
    args = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    contexts = [int(c) for c in args.contexts.split(",")]

    loaded = load_model()
    resident = LLM(loaded=loaded, device=args.device, kv_cache_memory=1 << 30, grammar_workers=0)
    layout = resident.engine.runner.kv.layout
    host_pages = max(contexts) // layout.page_size + 64
    tiered = LLM(
        loaded=loaded,
        device=args.device,
        kv_cache_memory=args.device_pages * layout.bytes_per_page,
        kv_tier_pages=host_pages,
        grammar_workers=0,
    )
    essay = resident.engine.tokenize(essays_text())
    ps = layout.page_size
    rows: list[dict[str, Any]] = []
    for ctx in contexts:
        budget = ctx // 8
        prompt = essay[:ctx]
        quest = KVPolicy(kind="quest", budget_tokens=budget)
        base = decode_run(resident.engine, prompt, quest, args.steps)
        print(f"ctx {ctx}, budget {budget}: all-resident step {base['step_ms']:.1f} ms", flush=True)
        for mult in (0, 1, 2):
            hot = mult * budget // ps
            kv = KVPolicy(kind="quest", budget_tokens=budget, offload=True, hot_pages=hot)
            run = decode_run(tiered.engine, prompt, kv, args.steps)
            hits, misses = run["hits"], run["misses"]
            row = {
                "context": ctx,
                "budget": budget,
                "hot_pages": hot,
                "hot_x_budget": mult,
                "step_ms": run["step_ms"],
                "resident_step_ms": base["step_ms"],
                "step_ratio": run["step_ms"] / base["step_ms"],
                "mib_per_step": run["bytes_per_step"] / 2**20,
                "layer_pages_per_step": run["layer_pages_per_step"],
                "hit_rate": hits / max(1, hits + misses),
                "device_pages": run["device_pages"],
                "device_bound": 1 + RECENT_PAGES + hot + 1,
                "context_pages": -(-ctx // ps),
                "same_tokens": run["tokens"] == base["tokens"],
                "recall_p50_ms": run["recall_p50_ms"],
                "recall_p99_ms": run["recall_p99_ms"],
            }
            rows.append(row)
            print(
                f"  hot {mult}x ({hot} pages): step {row['step_ms']:.1f} ms = "
                f"{row['step_ratio']:.2f}x, {row['mib_per_step']:.2f} MiB/step, "
                f"hit {row['hit_rate']:.2f}, device pages {row['device_pages']} "
                f"(bound {row['device_bound']}, context {row['context_pages']}), "
                f"same tokens {row['same_tokens']}",
                flush=True,
            )
    (RESULTS / "kv_tier.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    plot(rows)
    print(f"wrote {RESULTS / 'kv_tier.json'}")


def plot(rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['context']}\nhot {r['hot_x_budget']}x" for r in rows]
    ax.bar(range(len(rows)), [r["step_ratio"] for r in rows], color="tab:blue")
    ax.axhline(1.2, color="tab:red", ls="--", lw=0.8, label="target 1.2x")
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("decode step time / all-resident")
    ax.set_title("Quest with the KV host tier")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "kv_tier.png", dpi=120)


if __name__ == "__main__":
    main()
