"""The KV host tier: Quest with every page resident vs Quest parking cold pages in host memory.

Same model, same prompts, in one run. The resident engine has a pool large enough for every
context; each tiered engine's device pool holds only `--device-pages` pages (fewer than any
context here), the rest of each request living in the host tier. One tiered engine per hot-set
size (0, 1x and 2x the Quest budget); the decode steps of all four engines are interleaved, so a
noisy machine slows them alike. Per context and hot-set size: decode step time relative to
all-resident Quest, bytes and cells (one layer and KV head of a page) moved per step, the
selection hit rate, the most device pages the request held, and whether the tokens equal the
all-resident ones (greedy). On CPU the "device" pool is host memory too, so the ratio is the
tier's bookkeeping overhead; `--device cuda` runs the same on a GPU (pinned arena, staged copies
on a side stream).

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


class Decode:
    """One request alone in its engine: prefilled, then decoded one timed step at a time."""

    def __init__(self, engine: LLMEngine, prompt: list[int], kv: KVPolicy, steps: int) -> None:
        self.engine, self.tier = engine, engine.kv_tier
        sp = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True, kv=kv)
        self.req = engine.add_request(prompt, sp)
        if self.req.finished:
            raise SystemExit(f"refused: {self.req.warnings}")
        while self.req.num_output_tokens < 2:  # prefill and the first decode step
            engine.step()
        self.times: list[float] = []
        self.moved = [0.0] * 5  # bytes to device, bytes to host, cells read, hits, misses
        self.most_device = 0

    @property
    def done(self) -> bool:
        return self.req.finished

    def step(self) -> None:
        before = _tier_counters(self.tier)
        t0 = time.perf_counter()
        self.engine.step()
        self.times.append(time.perf_counter() - t0)
        after = _tier_counters(self.tier)
        self.moved = [m + a - b for m, a, b in zip(self.moved, after, before, strict=True)]
        offload = self.engine.offload
        if offload is not None:
            self.most_device = max(self.most_device, offload.device_pages(self.req))

    def result(self) -> dict[str, Any]:
        tokens = self.req.output_token_ids
        self.engine.release(self.req.request_id)
        n, tier = len(self.times), self.tier
        return {
            "step_ms": 1000 * statistics.median(self.times),
            "bytes_per_step": (self.moved[0] + self.moved[1]) / n,
            "cells_per_step": self.moved[2] / n,
            "hits": self.moved[3],
            "misses": self.moved[4],
            "device_pages": self.most_device,
            "tokens": tokens,
            "read_p50_ms": tier.read_latency_ms(50) if tier else None,
            "read_p99_ms": tier.read_latency_ms(99) if tier else None,
        }


def offloaded(budget: int, hot_pages: int) -> KVPolicy:
    return KVPolicy(kind="quest", budget_tokens=budget, offload=True, hot_pages=hot_pages)


def interleaved(decodes: list[Decode]) -> None:
    """Steps the decodes in turn, so every configuration sees the same (noisy) machine."""
    while not all(d.done for d in decodes):
        for d in decodes:
            if not d.done:
                d.step()


def _tier_counters(tier: Any) -> list[float]:
    if tier is None:
        return [0.0] * 5
    return [
        tier.bytes_to_device,
        tier.bytes_to_host,
        tier.cells_recalled,
        tier.hits,
        tier.misses,
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="2048,4096")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--device-pages", type=int, default=None, help="default: sinks, recent, 2x budget, slack"
    )
    args = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    contexts = [int(c) for c in args.contexts.split(",")]

    loaded = load_model()
    resident = LLM(loaded=loaded, device=args.device, kv_cache_memory=1 << 30, grammar_workers=0)
    layout = resident.engine.runner.kv.layout
    ps = layout.page_size
    host_pages = max(contexts) // ps + 64
    device_pages = args.device_pages or 1 + RECENT_PAGES + 2 * max(contexts) // 8 // ps + 4
    assert device_pages * ps < min(contexts), "the device pool alone must not hold a context"
    mults = (0, 1, 2)
    tiered = [  # one engine per hot-set size, each with its own device pool and host tier
        LLM(
            loaded=loaded,
            device=args.device,
            kv_cache_memory=device_pages * layout.bytes_per_page,
            kv_tier_pages=host_pages,
            kv_tier_tenant_pages=host_pages,  # one tenant here: the whole tier is its
            grammar_workers=0,
        )
        for _ in mults
    ]
    essay = resident.tokenizer.encode(essays_text(), add_special_tokens=False)
    rows: list[dict[str, Any]] = []
    for ctx in contexts:
        budget = ctx // 8
        prompt = essay[:ctx]
        print(f"ctx {ctx}, budget {budget}: prefilling 4 engines", flush=True)
        base = Decode(
            resident.engine, prompt, KVPolicy(kind="quest", budget_tokens=budget), args.steps
        )
        runs = [
            Decode(
                llm.engine,
                prompt,
                KVPolicy(
                    kind="quest", budget_tokens=budget, offload=True, hot_pages=m * budget // ps
                ),
                args.steps,
            )
            for llm, m in zip(tiered, mults, strict=True)
        ]
        interleaved([base, *runs])
        ref = base.result()
        print(f"  all-resident step {ref['step_ms']:.1f} ms", flush=True)
        for mult, decode in zip(mults, runs, strict=True):
            hot = mult * budget // ps
            run = decode.result()
            hits, misses = run["hits"], run["misses"]
            row = {
                "context": ctx,
                "budget": budget,
                "hot_pages": hot,
                "hot_x_budget": mult,
                "step_ms": run["step_ms"],
                "resident_step_ms": ref["step_ms"],
                "step_ratio": run["step_ms"] / ref["step_ms"],
                "mib_per_step": run["bytes_per_step"] / 2**20,
                "cells_per_step": run["cells_per_step"],
                "hit_rate": hits / max(1, hits + misses),
                "device_pages": run["device_pages"],
                "device_bound": 1 + RECENT_PAGES + hot + 1,
                "context_pages": -(-ctx // ps),
                "same_tokens": run["tokens"] == ref["tokens"],
                "read_p50_ms": run["read_p50_ms"],
                "read_p99_ms": run["read_p99_ms"],
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
    """Per context, one bar per hot-set size: step ratio, selection hit rate, MiB moved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in rows})
    panels = (
        ("step_ratio", "step time / all-resident"),
        ("hit_rate", "selections served on device"),
        ("mib_per_step", "MiB moved per step"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 3.5))
    width = 0.8 / 3
    for ax, (key, label) in zip(axes, panels, strict=True):
        for j, mult in enumerate((0, 1, 2)):
            values = [
                r[key]
                for c in contexts
                for r in rows
                if (r["context"], r["hot_x_budget"]) == (c, mult)
            ]
            ax.bar([i + j * width for i in range(len(values))], values, width, label=f"hot {mult}x")
        ax.set_xticks([i + width for i in range(len(contexts))], [str(c) for c in contexts])
        ax.set_xlabel("context (tokens)")
        ax.set_title(label, fontsize=10)
    axes[0].axhline(1.2, color="tab:red", ls="--", lw=0.8, label="target 1.2x")
    axes[0].legend(fontsize=8)
    fig.suptitle("Quest with the KV host tier (budget 1/8 of the context)")
    fig.tight_layout()
    fig.savefig(RESULTS / "kv_tier.png", dpi=120)


if __name__ == "__main__":
    main()
