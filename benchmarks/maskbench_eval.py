"""Correctness over `../shared/data/maskbench/`: does every constrained output parse and validate?

For each schema: compile it (with fidelity `warn`), skip it from the count when it does not compile
or has keywords the grammar cannot enforce (both listed), decode greedily with the schema as the
constraint, and validate the text with `jsonschema`. Prints the counts and every exception, writes
`benchmarks/results/maskbench_eval.json`.

    .venv/bin/python benchmarks/maskbench_eval.py [--limit N] [--max-tokens 512] [--batch 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services import LLM, SamplingParams, StructuredOutput
from services.engine.grammar import GrammarError
from services.models import load_model

ROOT = Path(__file__).resolve().parents[1]
MASKBENCH = ROOT.parent / "shared" / "data" / "maskbench"
RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--limit", type=int, default=0, help="first N files only (0: all)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--jump-forward", action="store_true")
    args = p.parse_args()
    files = sorted(MASKBENCH.glob("*.json"))
    if args.limit:
        files = files[: args.limit]
    llm = LLM(loaded=load_model(), kv_cache_memory=1 << 30, jump_forward=args.jump_forward)
    backend = llm.engine.grammars.backend
    not_compiled, loosened, runnable = [], [], []
    for f in files:
        schema = json.loads(f.read_text())["schema"]
        try:
            compiled = backend.compile(StructuredOutput(json_schema=schema))
        except GrammarError as exc:
            not_compiled.append({"file": f.name, "error": str(exc)})
            continue
        if compiled.warnings:
            loosened.append({"file": f.name, "keywords": compiled.warnings})
        else:
            runnable.append((f.name, schema))
    print(
        f"{len(files)} schemas: {len(not_compiled)} do not compile, {len(loosened)} loosened, "
        f"{len(runnable)} to decode",
        flush=True,
    )
    ask = "Produce a JSON value for this schema, nothing else: "
    results, start = [], time.perf_counter()
    for i in range(0, len(runnable), args.batch):
        chunk = runnable[i : i + args.batch]
        prompts = [
            llm.engine.apply_chat_template([{"role": "user", "content": ask + json.dumps(s)[:600]}])
            for _, s in chunk
        ]
        sps = [
            SamplingParams(
                max_tokens=args.max_tokens,
                temperature=0,
                structured=StructuredOutput(json_schema=s),
            )
            for _, s in chunk
        ]
        for (name, _), out in zip(chunk, llm.generate(prompts, sps), strict=True):
            results.append(
                {
                    "file": name,
                    "finish_reason": out.finish_reason,
                    "validated": out.validated,
                    "tokens": len(out.token_ids),
                    "warnings": out.warnings,
                }
            )
        done = len(results)
        print(f"  {done}/{len(runnable)} decoded, {time.perf_counter() - start:.0f} s", flush=True)
    ok = [r for r in results if r["validated"]]
    bad = [r for r in results if not r["validated"]]
    summary = {
        "schemas": len(files),
        "not_compiled": not_compiled,
        "loosened": loosened,
        "decoded": len(results),
        "validated": len(ok),
        "exceptions": bad,
        "max_tokens": args.max_tokens,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "maskbench_eval.json").write_text(json.dumps(summary, indent=2))
    print(f"\nvalidated {len(ok)} of {len(results)} decoded outputs")
    for r in bad:
        print(
            f"  {r['file']}: {r['finish_reason']} after {r['tokens']} tokens; {r['warnings'][-1:]}"
        )
    for r in not_compiled:
        print(f"  not compiled: {r['file']}: {r['error'][:160]}")


if __name__ == "__main__":
    main()
