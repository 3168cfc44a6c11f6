"""Checked decoding's cost: none where there is nothing to check, and what the returns cost where
there is (services/engine/structured/checked.py).

1. Throughput on schemas whose every keyword the grammar enforces (the structured benchmark's
   schemas workload: 32 maskbench schemas, chat prompts, greedy, `--max-tokens`), engines with
   `check_retries=4` (the default) and `0` (the plain twin) alternated A B B A at each batch size:
   tokens/s and the ratio; the tokens must be identical.
2. The dev schemas whose grammar leaves a keyword to the check (`--checked N` of them, greedy,
   the same prompt), with and without checks: outputs that finish and validate, the outputs that
   went back, and the time the batch took (returns included).

Writes `benchmarks/results/checked_decoding.json`.

    .venv/bin/python benchmarks/checked_decoding.py [--batch-sizes 8,32] [--max-tokens 128]
        [--checked 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from structured_workloads import MASKBENCH, pick_schemas  # noqa: E402

from services import LLM, SamplingParams, StructuredOutput  # noqa: E402
from services.grammar.backend import GrammarError  # noqa: E402
from services.models import load_model  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
ASK = "Produce a JSON value for this schema, nothing else: "


def prompts_for(llm: LLM, schemas: list[dict]) -> list[list[int]]:
    return [
        llm.engine.apply_chat_template([{"role": "user", "content": ASK + json.dumps(s)[:600]}])
        for s in schemas
    ]


def params(schemas: list[dict], max_tokens: int) -> list[SamplingParams]:
    return [
        SamplingParams(
            max_tokens=max_tokens, temperature=0, structured=StructuredOutput(json_schema=s)
        )
        for s in schemas
    ]


def timed(llm: LLM, prompts: list, sps: list, wave: int) -> tuple[float, list]:
    outs, tokens, start = [], 0, time.perf_counter()
    for i in range(0, len(prompts), wave):
        got = llm.generate(prompts[i : i + wave], sps[i : i + wave])
        outs += got
        tokens += sum(len(o.token_ids) for o in got)
    return tokens / (time.perf_counter() - start), outs


def throughput(llms: dict[str, LLM], sizes: list[int], max_tokens: int) -> list[dict]:
    schemas = pick_schemas(32)
    prompts = prompts_for(llms["checked"], schemas)
    sps = params(schemas, max_tokens)
    for llm in llms.values():  # warm: grammars compiled, the same for both runs
        llm.generate(prompts, params(schemas, 4))
    rows = []
    for b in sizes:
        runs: dict[str, list[float]] = {"checked": [], "plain": []}
        tokens: dict[str, list] = {}
        for name in ("checked", "plain", "plain", "checked"):
            rate, outs = timed(llms[name], prompts, sps, b)
            runs[name].append(rate)
            tokens[name] = [o.token_ids for o in outs]
        best = {k: max(v) for k, v in runs.items()}
        row = {"batch": b, "runs": runs, "ratio": best["checked"] / best["plain"]}
        row["same_tokens"] = tokens["checked"] == tokens["plain"]
        print(
            f"batch {b}: checks on {runs['checked']} tok/s, off {runs['plain']}: ratio "
            f"{row['ratio']:.3f}, same tokens {row['same_tokens']}",
            flush=True,
        )
        rows.append(row)
    return rows


def checked_schemas(llm: LLM, n: int) -> list[dict]:
    backend = llm.engine.grammars.backend
    out = []
    for f in sorted(MASKBENCH.glob("*.json")):
        schema = json.loads(f.read_text())["schema"]
        try:
            compiled = backend.compile(StructuredOutput(json_schema=schema))
        except GrammarError:
            continue
        if compiled.warnings:
            out.append(schema)
        if len(out) == n:
            break
    return out


def returns(llms: dict[str, LLM], n: int, max_tokens: int) -> dict[str, Any]:
    schemas = checked_schemas(llms["checked"], n)
    prompts = prompts_for(llms["checked"], schemas)
    out: dict[str, Any] = {"schemas": len(schemas)}
    for name, llm in llms.items():
        start = time.perf_counter()
        outs = llm.generate(prompts, params(schemas, max_tokens))
        finished = [o for o in outs if o.finish_reason in ("stop", "error")]
        went_back = [o for o in outs if any(w.startswith("checked decoding:") for w in o.warnings)]
        out[name] = {
            "finished": len(finished),
            "validated": sum(bool(o.validated) for o in finished),
            "went_back": len(went_back),
            "seconds": round(time.perf_counter() - start, 1),
            "output_tokens": sum(len(o.token_ids) for o in outs),
        }
        print(f"{name}: {out[name]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--checked", type=int, default=32, help="checked dev schemas (0: skip)")
    args = ap.parse_args()
    loaded = load_model()
    kw: dict[str, Any] = {"loaded": loaded, "kv_cache_memory": 512 << 20}
    llms = {"checked": LLM(**kw), "plain": LLM(**kw, check_retries=0)}
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    result: dict[str, Any] = {"args": vars(args)}
    result["throughput"] = throughput(llms, sizes, args.max_tokens)
    if args.checked:
        result["returns"] = returns(llms, args.checked, args.max_tokens)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "checked_decoding.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
