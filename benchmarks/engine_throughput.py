"""Engine throughput vs Hugging Face `generate` in static batches, same model, same run.

Workload (seeded): 32 requests, prompt lengths uniform in [50, 800], output lengths uniform in
[16, 256], greedy, EOS ignored. Our engine gets all requests at once and batches continuously; the
peer runs `model.generate` on static batches in arrival order, each batch padded to its longest
prompt and run to its longest output (tokens past a request's own length are waste, not counted).

Prints tokens/s of each and the ratio, peak KV memory of each, KV bytes per token held, and writes
`benchmarks/results/engine_throughput.json` and `.png`.

    .venv/bin/python benchmarks/engine_throughput.py [--requests 32] [--hf-batch-size 8]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services import LLM, SamplingParams
from services.models import LoadedModel, load_model

RESULTS = Path(__file__).resolve().parent / "results"


def make_workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    work = []
    for _ in range(args.requests):
        n_prompt = rng.randint(args.min_prompt, args.max_prompt)
        n_out = rng.randint(args.min_output, args.max_output)
        work.append(([rng.randrange(100, vocab) for _ in range(n_prompt)], n_out))
    return work


def run_engine(loaded: LoadedModel, work: list[tuple[list[int], int]], args) -> dict:
    llm = LLM(loaded=loaded, max_num_batched_tokens=args.max_num_batched_tokens)
    engine = llm.engine
    # warm-up on tokens no request starts with (a prefix-cache hit would flatter the engine)
    llm.generate([[99] * 32], SamplingParams(max_tokens=4, temperature=0))
    kv = engine.runner.kv
    start = time.perf_counter()
    reqs = [
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        for p, n in work
    ]
    peak_pages, steps, held_samples = 0, 0, []
    while engine.has_unfinished():
        engine.step()
        steps += 1
        used = kv.allocator.num_used
        if used:
            held = sum(r.num_computed_tokens for r in engine.scheduler.running)
            held_samples.append((used * kv.layout.bytes_per_page, held))
        peak_pages = max(peak_pages, used)
        if steps % 50 == 0:
            done = sum(r.finished for r in reqs)
            print(f"  engine: step {steps}, {done}/{len(reqs)} done", flush=True)
    elapsed = time.perf_counter() - start
    tokens = sum(r.num_output_tokens for r in reqs)
    assert all(r.num_output_tokens == n for r, (_, n) in zip(reqs, work, strict=True))
    bytes_held = sum(b for b, _ in held_samples)
    tokens_held = sum(t for _, t in held_samples)
    return {
        "seconds": elapsed,
        "output_tokens": tokens,
        "tokens_per_second": tokens / elapsed,
        "steps": steps,
        "preemptions": engine.scheduler.num_preemptions,
        "peak_kv_bytes": peak_pages * kv.layout.bytes_per_page,
        "kv_bytes_per_token_held": bytes_held / max(tokens_held, 1),
        "kv_bytes_per_token_ideal": kv.layout.bytes_per_token,
    }


def run_hf(loaded: LoadedModel, work: list[tuple[list[int], int]], batch_size: int) -> dict:
    model, tok = loaded.model, loaded.tokenizer
    model.set_attn_implementation("sdpa")
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = []  # ignore EOS, as the engine does
    config.do_sample = False
    config.pad_token_id = pad

    def generate(batch: list[tuple[list[int], int]]):
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        config.max_new_tokens = max(n for _, n in batch)
        return model.generate(
            ids, attention_mask=mask, generation_config=config, return_dict_in_generate=True
        )

    with torch.inference_mode():
        generate([(work[0][0][:32], 4)])  # warm-up
        start = time.perf_counter()
        peak_kv, peak_useful = 0, 1
        for i in range(0, len(work), batch_size):
            batch = work[i : i + batch_size]
            out = generate(batch)
            cache = out.past_key_values
            layers = getattr(cache, "layers", [])
            kv_bytes = sum(x.keys.nbytes + x.values.nbytes for x in layers)
            if kv_bytes > peak_kv:  # padding included; useful = each request's own tokens
                peak_kv, peak_useful = kv_bytes, sum(len(p) + n for p, n in batch)
            print(f"  hf generate: batch {i // batch_size + 1} done", flush=True)
        elapsed = time.perf_counter() - start
    tokens = sum(n for _, n in work)
    return {
        "batch_size": batch_size,
        "seconds": elapsed,
        "output_tokens": tokens,
        "tokens_per_second": tokens / elapsed,
        "peak_kv_bytes": peak_kv,
        "kv_bytes_per_token_held": peak_kv / peak_useful,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours, hf = result["engine"], result["hf_generate"]
    names = ["structserve engine", f"HF generate (static batch {hf['batch_size']})"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar(names, [ours["tokens_per_second"], hf["tokens_per_second"]], color=["C0", "C7"])
    axes[0].set_ylabel("output tokens / s")
    axes[0].set_title(f"throughput (ratio {result['ratio']:.2f}x)")
    axes[1].bar(
        names, [ours["peak_kv_bytes"] / 2**20, hf["peak_kv_bytes"] / 2**20], color=["C0", "C7"]
    )
    axes[1].set_ylabel("peak KV MiB")
    axes[1].set_title("peak KV memory")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(result["workload"]["description"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--min-prompt", type=int, default=50)
    p.add_argument("--max-prompt", type=int, default=800)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    args = p.parse_args()
    torch.manual_seed(args.seed)

    loaded = load_model(args.model)
    work = make_workload(args, int(loaded.config.vocab_size))
    desc = (
        f"{args.requests} requests, prompts {args.min_prompt}-{args.max_prompt}, outputs "
        f"{args.min_output}-{args.max_output} tokens, greedy, EOS ignored, {loaded.name}, "
        f"{torch.get_num_threads()} threads"
    )
    print(desc, flush=True)
    print("structserve engine:", flush=True)
    ours = run_engine(loaded, work, args)
    print(f"  {ours['tokens_per_second']:.1f} tok/s in {ours['seconds']:.1f} s", flush=True)
    print(f"HF generate, static batches of {args.hf_batch_size}:", flush=True)
    hf = run_hf(loaded, work, args.hf_batch_size)
    print(f"  {hf['tokens_per_second']:.1f} tok/s in {hf['seconds']:.1f} s", flush=True)

    result = {
        "workload": {"description": desc, **vars(args)},
        "engine": ours,
        "hf_generate": hf,
        "ratio": ours["tokens_per_second"] / hf["tokens_per_second"],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "engine_throughput.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "engine_throughput.png")
    print("\n| | tokens/s | seconds | peak KV MiB | KV bytes per token held |")
    print("|---|---|---|---|---|")
    for name, r in (("engine", ours), (f"HF generate (batch {hf['batch_size']})", hf)):
        print(
            f"| {name} | {r['tokens_per_second']:.1f} | {r['seconds']:.1f} "
            f"| {r['peak_kv_bytes'] / 2**20:.1f} | {r['kv_bytes_per_token_held']:.0f} |"
        )
    print(f"\nratio engine / HF generate: {result['ratio']:.2f}x")
    print(
        f"KV bytes per token held: {ours['kv_bytes_per_token_held']:.0f} "
        f"(ideal {ours['kv_bytes_per_token_ideal']}, page rounding included); "
        f"preemptions: {ours['preemptions']}"
    )
    print(f"wrote {RESULTS / 'engine_throughput.json'} and .png")


if __name__ == "__main__":
    main()
