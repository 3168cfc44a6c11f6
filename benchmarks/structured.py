"""Structured-output throughput: constrained vs unconstrained decoding, speculative decoding on vs
off, and vs HF + xgrammar.

Two workloads (`--workloads`, both by default), same model, in one run:
  schemas     chat requests asking for a JSON value of a real-world schema from
              `../shared/data/maskbench/` (no loosened keyword), `--max-tokens` each;
  extraction  a seeded synthetic document in the prompt (invoices, people records, product
              listings, orders: names, ids, emails, addresses, amounts, dates, line items) and a
              schema whose values come from it (`structured_workloads.py`), asked to be extracted
              as JSON, `--extraction-max-tokens` each.
At each batch size: max(batch, `--requests`) requests (rounded up to whole batches) sent in waves
of the batch size, greedy (temperature 0), after a warm-up, the best of 2 runs:
  (a) unconstrained, each request generating as many tokens as it did in (b) (EOS ignored);
  (b) constrained, masks overlapped with the forward pass (speculation off);
  (c) constrained, masks filled after the forward pass (the serial twin);
  (d) constrained with jump-forward over forced spans;
  (e) the peer: Hugging Face `generate` with xgrammar's `contrib.hf.LogitsProcessor`;
  (f) (b) with speculative decoding (`--speculative`: prompt-lookup n-gram drafts);
  (g) (f) with jump-forward (to decide jump-forward's default).
(a) and (c) measure the masks' overhead and run on the schemas workload only (time on 2 cores).
Prints per workload and batch size tokens/s and the ratios b/a, c/a, d/a, b/e, mask time per step
(p50, p99), forward passes per output token of d and how many outputs validated; then for
speculation tokens/s of b, f, g, d, e and the ratios f/b (on / off), f/e (on / peer), g/d, g/f,
forward passes per output token (output tokens less jump-forward's and accepted drafts, per output
token; the peer's is 1), the draft acceptance rate, how many requests' greedy tokens are identical
with speculation on and off (f = b, g = d), validity, and the targets: f/b >= 1.8 at batch 1 on
extraction, f/e >= 2 at batch 8. Writes `benchmarks/results/structured.json` and `.png`.

    .venv/bin/python benchmarks/structured.py [--workloads schemas,extraction]
        [--batch-sizes 1,8,32] [--requests 4] [--max-tokens 128] [--extraction-max-tokens 256]
        [--speculative '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4,
                         "prompt_lookup_min": 1, "draft_length": "adaptive"}'] [--seed 0]
        [--max-repeat-run N]  (the engine's repeat guard on constrained requests; default off)
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.structured_workloads import MASKBENCH, Workload, make_workloads
from benchmarks.structured_workloads import pick_schemas as pick_schemas  # vs_vllm.py imports it
from services import LLM, SamplingParams, StructuredOutput
from services.models import LoadedModel, load_model

RESULTS = Path(__file__).resolve().parent / "results"
SPECULATIVE = {  # the best of K 4/8/16, lookup min 1/2, fixed/adaptive at batch 1 and 8
    "method": "ngram",
    "num_speculative_tokens": 8,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 1,
    "draft_length": "adaptive",
}
# row key -> the engine of `make_engines` it runs on (constrained), or the peer / unconstrained
CONSTRAINED = {
    "b_overlap": "overlap",
    "c_serial": "serial",
    "d_jump_forward": "jump",
    "f_speculative": "spec",
    "g_spec_jump_forward": "spec_jump",
}
LABELS = {
    "a_unconstrained": "unconstrained",
    "b_overlap": "overlap (spec off)",
    "c_serial": "serial",
    "d_jump_forward": "jump-forward",
    "e_hf_xgrammar": "HF + xgrammar",
    "f_speculative": "speculative",
    "g_spec_jump_forward": "spec + jump-forward",
}
MASK_RUNS = ("a_unconstrained", "c_serial")  # the masks' overhead: on the schemas workload only
TARGET_SPEC_OVER_OFF = ("extraction", 1, 1.8)  # workload, batch, f/b
TARGET_SPEC_OVER_PEER = (8, 2.0)  # batch, f/e (every workload)


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def valid_count(texts: list[str], schemas: list[dict]) -> int:
    n = 0
    for text, schema in zip(texts, schemas, strict=True):
        try:
            jsonschema.validate(json.loads(text), schema)
            n += 1
        except (json.JSONDecodeError, jsonschema.ValidationError, jsonschema.SchemaError):
            pass
    return n


def _speculator_counts(llm: LLM) -> dict[str, int]:
    spec = llm.engine.speculator
    if spec is None:
        return {}
    return {"proposed": spec.proposed, "accepted": spec.accepted}  # each accepted: a pass saved


def run_engine(
    llm: LLM, prompts, params, repeats: int = 2, wave: int | None = None, keep_ids: bool = False
) -> dict:
    """Best of `repeats` runs (this machine is noisy; greedy decoding repeats the same tokens),
    the requests sent `wave` at a time (all at once by default)."""
    masks = llm.engine.grammars.masks
    masks.fill_seconds.clear()
    wave = wave or len(prompts)
    elapsed = float("inf")
    for _ in range(repeats):
        before = _speculator_counts(llm)
        start = time.perf_counter()
        outs = []
        for i in range(0, len(prompts), wave):
            outs += llm.generate(prompts[i : i + wave], params[i : i + wave])
        elapsed = min(elapsed, time.perf_counter() - start)
    tokens = sum(len(o.token_ids) for o in outs)
    forced = sum(o.metrics.num_forced_tokens for o in outs)
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_draft_tokens for o in outs)
    fills = list(masks.fill_seconds)
    out = {
        "seconds": elapsed,
        "output_tokens": tokens,
        "tokens_per_second": tokens / elapsed,
        "forced_tokens": forced,
        "draft_tokens": drafted,
        "accepted_draft_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "forward_passes_per_token": (tokens - forced - accepted) / max(tokens, 1),
        "mask_ms_p50": percentile(fills, 0.5) * 1e3,
        "mask_ms_p99": percentile(fills, 0.99) * 1e3,
        "lengths": [len(o.token_ids) for o in outs],
        "texts": [o.text for o in outs],
    }
    if before:  # the last run's engine counters, beside the outputs' metrics
        after = _speculator_counts(llm)
        out["speculator"] = {k: after[k] - before[k] for k in after}
    if keep_ids:
        out["token_ids"] = [list(o.token_ids) for o in outs]
    return out


def run_hf(loaded: LoadedModel, prompts, schemas, max_tokens: int, backend) -> dict:
    import xgrammar as xgr

    model, tok = loaded.model, loaded.tokenizer
    model.set_attn_implementation("sdpa")
    grammars = [backend.compile(StructuredOutput(json_schema=s)).handle for s in schemas]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = copy.deepcopy(model.generation_config)
    config.do_sample, config.max_new_tokens, config.pad_token_id = False, max_tokens, pad
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            generation_config=config,
            logits_processor=[xgr.contrib.hf.LogitsProcessor(grammars)],
        )
    elapsed = time.perf_counter() - start
    eos = set(
        config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    )
    texts, tokens = [], 0
    for row in out[:, width:].tolist():
        n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        tokens += n
        texts.append(tok.decode(row[:n], skip_special_tokens=True))
    return {
        "seconds": elapsed,
        "output_tokens": tokens,
        "tokens_per_second": tokens / elapsed,
        "texts": texts,
    }


def run_hf_waves(loaded, prompts, schemas, max_tokens: int, backend, wave: int) -> dict:
    """`run_hf` on `wave` requests at a time; each output token is one forward pass of its row."""
    parts = [
        run_hf(loaded, prompts[i : i + wave], schemas[i : i + wave], max_tokens, backend)
        for i in range(0, len(prompts), wave)
    ]
    seconds = sum(p["seconds"] for p in parts)
    tokens = sum(p["output_tokens"] for p in parts)
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "tokens_per_second": tokens / seconds,
        "forward_passes_per_token": 1.0,
        "texts": [t for p in parts for t in p["texts"]],
    }


def identical(x: dict, y: dict) -> int:
    """Requests whose greedy tokens are the same in both runs."""
    return sum(a == b for a, b in zip(x["token_ids"], y["token_ids"], strict=True))


def add_ratios(row: dict) -> None:
    tps = {k: v["tokens_per_second"] for k, v in row.items() if k in LABELS}
    row["ratios"] = {
        f"{x[0]}/{y[0]}": tps[x] / tps[y]
        for x, y in (
            ("b_overlap", "a_unconstrained"),
            ("c_serial", "a_unconstrained"),
            ("d_jump_forward", "a_unconstrained"),
            ("b_overlap", "e_hf_xgrammar"),
            ("f_speculative", "b_overlap"),
            ("f_speculative", "e_hf_xgrammar"),
            ("g_spec_jump_forward", "d_jump_forward"),
            ("g_spec_jump_forward", "f_speculative"),
            ("g_spec_jump_forward", "e_hf_xgrammar"),
        )
        if x in tps and y in tps
    }
    row["identical"] = {
        "f=b": identical(row["f_speculative"], row["b_overlap"]),
        "g=d": identical(row["g_spec_jump_forward"], row["d_jump_forward"]),
    }


def bench_batch(loaded, llms, work: Workload, b: int, args: argparse.Namespace) -> dict:
    n = -(-max(b, args.requests) // b) * b  # whole waves of b
    items = [work.items[i % len(work.items)] for i in range(n)]
    sch = [s for _, s in items]
    prompts = [llms["overlap"].engine.apply_chat_template(m) for m, _ in items]

    def constrained():
        return [
            SamplingParams(
                max_tokens=work.max_tokens,
                temperature=0,
                structured=StructuredOutput(json_schema=s, max_repeat_run=args.max_repeat_run),
            )
            for s in sch
        ]

    row: dict = {"workload": work.name, "batch_size": b, "requests": n}
    skip = () if work.name == "schemas" else MASK_RUNS
    for key, engine in CONSTRAINED.items():
        if key in skip:
            continue
        row[key] = run_engine(llms[engine], prompts, constrained(), wave=b, keep_ids=True)
        row[key]["valid"] = valid_count(row[key]["texts"], sch)
        if (
            key == "b_overlap" and "a_unconstrained" not in skip
        ):  # (a) generates as many tokens as (b) did
            lengths = row["b_overlap"]["lengths"]
            free = [SamplingParams(max_tokens=k, temperature=0, ignore_eos=True) for k in lengths]
            row["a_unconstrained"] = run_engine(llms["overlap"], prompts, free, wave=b)
    backend = llms["overlap"].engine.grammars.backend.xgrammar
    row["e_hf_xgrammar"] = run_hf_waves(loaded, prompts, sch, work.max_tokens, backend, b)
    row["e_hf_xgrammar"]["valid"] = valid_count(row["e_hf_xgrammar"]["texts"], sch)
    add_ratios(row)
    return row


def make_engines(loaded: LoadedModel, spec: dict) -> dict[str, LLM]:
    kw = {"loaded": loaded, "kv_cache_memory": 512 << 20}
    return {
        "overlap": LLM(**kw),
        "serial": LLM(**kw, overlap_masks=False),
        "jump": LLM(**kw, jump_forward=True),
        "spec": LLM(**kw, speculative=spec),
        "spec_jump": LLM(**kw, speculative=spec, jump_forward=True),
    }


def warm_up(loaded, llms: dict[str, LLM], works: list[Workload]) -> None:
    """One short request of each workload on every engine and on the peer (drafts included)."""
    backend = llms["overlap"].engine.grammars.backend.xgrammar
    for work in works:
        messages, schema = work.items[0]
        prompt = llms["overlap"].engine.apply_chat_template(messages)
        params = SamplingParams(
            max_tokens=16, temperature=0, structured=StructuredOutput(json_schema=schema)
        )
        for llm in llms.values():
            llm.generate([prompt], params)
        run_hf(loaded, [prompt], [schema], 4, backend)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(7 * len(names), 4.2), squeeze=False)
    width = 0.12
    for ax, name in zip(axes[0], names, strict=True):
        mine = [r for r in rows if r["workload"] == name]
        for k, (key, label) in enumerate(sorted(LABELS.items())):
            xs = [i + (k - 3) * width for i in range(len(mine))]
            tps = [r[key]["tokens_per_second"] if key in r else 0.0 for r in mine]
            ax.bar(xs, tps, width, label=label)
        ax.set_xticks(range(len(mine)), [f"batch {r['batch_size']}" for r in mine])
        ax.set_ylabel("output tokens / s")
        ax.set_title(f"{name} (SmolLM2-135M)")
        ax.legend(fontsize=7)
    fig.suptitle("Structured output throughput: speculative decoding on/off vs HF + xgrammar")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_row(row: dict) -> None:
    tps = {k: v["tokens_per_second"] for k, v in row.items() if k in LABELS}
    rate = row["f_speculative"]["acceptance_rate"]
    print(f"{row['workload']} batch {row['batch_size']} ({row['requests']} requests)", flush=True)
    print("  tok/s " + " ".join(f"{k[0]}={v:.1f}" for k, v in sorted(tps.items())), flush=True)
    print("  " + " ".join(f"{k}={v:.2f}" for k, v in row["ratios"].items()), flush=True)
    fpt = {k[0]: f"{row[k]['forward_passes_per_token']:.2f}" for k in CONSTRAINED if k in row}
    valid = {k[0]: row[k]["valid"] for k in (*CONSTRAINED, "e_hf_xgrammar") if k in row}
    print(f"  acceptance f={rate}  identical {row['identical']}", flush=True)
    print(f"  fwd/token {fpt}  valid {valid}", flush=True)


def table_constrained(rows: list[dict]) -> None:
    head = ["workload", "batch", "a tok/s", "b/a", "c/a", "d/a", "b/e", "mask ms p50/p99"]
    head += ["fwd/token d", "valid b,d,e"]
    mine = [r for r in rows if "a_unconstrained" in r]
    if not mine:
        return
    print("\n| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    for row in mine:
        r, b, d = row["ratios"], row["b_overlap"], row["d_jump_forward"]
        cells = [
            row["workload"],
            str(row["batch_size"]),
            f"{row['a_unconstrained']['tokens_per_second']:.1f}",
            *(f"{r[k]:.2f}" for k in ("b/a", "c/a", "d/a", "b/e")),
            f"{b['mask_ms_p50']:.3f}/{b['mask_ms_p99']:.3f}",
            f"{d['forward_passes_per_token']:.2f}",
            f"{b['valid']},{d['valid']},{row['e_hf_xgrammar']['valid']} of {row['requests']}",
        ]
        print("| " + " | ".join(cells) + " |")


def _rate(run: dict) -> str:
    rate = run["acceptance_rate"]
    return "-" if rate is None else f"{rate:.2f}"


def table_speculative(rows: list[dict]) -> None:
    head = ["workload", "batch", "tok/s b off", "f spec", "g spec+jf", "d jf", "e peer"]
    head += ["f/b", "f/e", "g/d", "g/f", "fwd/token b,f,g,e", "accept f,g", "identical f=b,g=d"]
    head += ["valid b,f,g,e"]
    print("\n| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    keys = ("b_overlap", "f_speculative", "g_spec_jump_forward", "d_jump_forward")
    for row in rows:
        r, n, same = row["ratios"], row["requests"], row["identical"]
        runs = [row[k] for k in (*keys, "e_hf_xgrammar")]
        fpt = [row[k]["forward_passes_per_token"] for k in (*keys[:3], "e_hf_xgrammar")]
        valid = [row[k]["valid"] for k in (*keys[:3], "e_hf_xgrammar")]
        cells = [
            row["workload"],
            str(row["batch_size"]),
            *(f"{x['tokens_per_second']:.1f}" for x in runs),
            *(f"{r[k]:.2f}" for k in ("f/b", "f/e", "g/d", "g/f")),
            ",".join(f"{x:.2f}" for x in fpt),
            f"{_rate(row['f_speculative'])},{_rate(row['g_spec_jump_forward'])}",
            f"{same['f=b']},{same['g=d']} of {n}",
            ",".join(map(str, valid)) + f" of {n}",
        ]
        print("| " + " | ".join(cells) + " |")


def targets(rows: list[dict]) -> dict:
    """The issue's targets, met or not (None where the run had no such row)."""
    work, batch, want = TARGET_SPEC_OVER_OFF
    at = {(r["workload"], r["batch_size"]): r["ratios"] for r in rows}
    got = at.get((work, batch), {}).get("f/b")
    out = {f"f/b >= {want} ({work}, batch {batch})": got}
    batch, want = TARGET_SPEC_OVER_PEER
    for name in dict.fromkeys(r["workload"] for r in rows):
        out[f"f/e >= {want} ({name}, batch {batch})"] = at.get((name, batch), {}).get("f/e")
    print()
    for label, value in out.items():
        want = float(label.split(">= ")[1].split(" ")[0])
        verdict = "not run" if value is None else ("met" if value >= want else "MISSED")
        print(f"target {label}: " + ("-" if value is None else f"{value:.2f}x") + f" {verdict}")
    jf = ", ".join(f"{r['workload']} b{r['batch_size']} {r['ratios']['g/f']:.2f}" for r in rows)
    print(f"jump-forward with speculation, g/f (tok/s spec+jf / spec): {jf}")
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workloads", default="schemas,extraction")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--requests", type=int, default=4, help="at least this many per batch size")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--extraction-max-tokens", type=int, default=None, help="2x --max-tokens")
    p.add_argument("--speculative", type=json.loads, default=SPECULATIVE, help="the config")
    p.add_argument("--seed", type=int, default=0)
    # The engine's guard ends a string repeating one unit for 128 tokens with an error; the peer
    # has none, and a request so ended while its draft is verified crashed the engine
    # (speculative.verify: `kept` unbound), so by default each request runs to EOS or max tokens.
    p.add_argument("--max-repeat-run", type=int, default=None, help="default: off")
    p.add_argument("--model", default=None)
    return p.parse_args()


def write_results(args: argparse.Namespace, rows: list[dict], met: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    for row in rows:
        for v in row.values():
            if isinstance(v, dict):
                for key in ("texts", "lengths", "token_ids"):
                    v.pop(key, None)
    (RESULTS / "structured.json").write_text(
        json.dumps({"args": vars(args), "targets": met, "rows": rows}, indent=2)
    )
    plot(rows, RESULTS / "structured.png")
    print(f"wrote {RESULTS / 'structured.json'} and .png")


def main() -> None:
    args = parse_args()
    if not MASKBENCH.is_dir():
        sys.exit(f"needs {MASKBENCH} (the shared data folder beside the checkout)")
    torch.manual_seed(args.seed)
    loaded = load_model(args.model)
    llms = make_engines(loaded, args.speculative)
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    most = max(-(-max(b, args.requests) // b) * b for b in batch_sizes)
    extraction_tokens = args.extraction_max_tokens or 2 * args.max_tokens
    works = make_workloads(
        args.workloads.split(","), most, args.max_tokens, extraction_tokens, args.seed
    )
    warm_up(loaded, llms, works)
    rows = []
    for work in works:
        for b in batch_sizes:
            print(f"{work.name} batch {b}: running ...", flush=True)
            rows.append(bench_batch(loaded, llms, work, b, args))
            print_row(rows[-1])
    table_constrained(rows)
    share = statistics.mean(r["b_overlap"]["valid"] / r["requests"] for r in rows)
    print(f"mean valid share (b): {share:.2f}")
    table_speculative(rows)
    met = targets(rows)
    for llm in llms.values():
        llm.engine.grammars.shutdown()
    write_results(args, rows, met)


if __name__ == "__main__":
    main()
