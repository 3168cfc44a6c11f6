"""Correctness over `../shared/data/maskbench/`: does every constrained output parse and validate?

For each schema: compile it (with fidelity `warn`), skip it from the count when it does not compile
or has keywords the grammar cannot enforce (both listed), decode greedily with the schema as the
constraint, and validate the text with `jsonschema`. Outputs that reach max_tokens are checked for
a loop (the text ends in a unit repeated at least 3 times, as a small model does inside an unbounded
string); those that do not loop are decoded again with `--retry-max-tokens`. Prints the counts and
every exception, writes `benchmarks/results/maskbench_eval[_BACKEND].json`.

`--backend xgrammar|llguidance|auto` picks the grammar backend (`grammar_backend`); with
`--compile-only` only the compile phase runs: per backend, which schemas compile, which have
keywords it cannot enforce, and under `auto` which backend each schema got.

    .venv/bin/python benchmarks/maskbench_eval.py [--backend auto] [--compile-only] [--limit N]
        [--max-tokens 256] [--batch 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services import LLM, SamplingParams, StructuredOutput
from services.engine.grammar import GrammarError
from services.models import load_model

ROOT = Path(__file__).resolve().parents[1]
MASKBENCH = ROOT.parent / "shared" / "data" / "maskbench"
RESULTS = Path(__file__).resolve().parent / "results"
ASK = "Produce a JSON value for this schema, nothing else: "


def ends_in_loop(text: str, min_repeats: int = 3, min_span: int = 32, max_unit: int = 64) -> bool:
    """True when the text ends with one unit (1..max_unit chars) repeated over its last
    min_span chars at least, and at least min_repeats times."""
    for unit in range(1, max_unit + 1):
        repeats = max(min_repeats, -(-min_span // unit))
        tail = text[-unit * repeats :]
        if len(tail) == unit * repeats and tail == tail[:unit] * repeats:
            return True
    return False


def decode(
    llm: LLM, runnable: list[tuple[str, Any]], max_tokens: int, batch: int, args: Any
) -> list[dict]:
    finish = {} if not args.plain else {"bound_numbers": False, "max_repeat_run": None}
    results: list[dict] = []
    start = time.perf_counter()
    for i in range(0, len(runnable), batch):
        chunk = runnable[i : i + batch]
        prompts = [
            llm.engine.apply_chat_template([{"role": "user", "content": ASK + json.dumps(s)[:600]}])
            for _, s in chunk
        ]
        sps = [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=0,
                repetition_penalty=args.repetition_penalty,
                structured=StructuredOutput(json_schema=s, **finish),
            )
            for _, s in chunk
        ]
        for (name, _), out in zip(chunk, llm.generate(prompts, sps), strict=True):
            results.append(
                {
                    "file": name,
                    "finish_reason": out.finish_reason,
                    "validated": out.validated,
                    "looping": out.finish_reason == "length" and ends_in_loop(out.text),
                    "ended_early": any("max_repeat_run" in w for w in out.warnings),
                    "tokens": len(out.token_ids),
                    "warnings": out.warnings,
                    "tail": out.text[-80:],
                }
            )
        print(
            f"  {len(results)}/{len(runnable)} decoded, {time.perf_counter() - start:.0f} s",
            flush=True,
        )
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--limit", type=int, default=0, help="first N files only (0: all)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--retry-max-tokens", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--jump-forward", action="store_true")
    p.add_argument(
        "--plain",
        action="store_true",
        help="no bounds on numbers, no repeat guard (services/engine/grammar/finish.py)",
    )
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--backend", default="xgrammar", choices=("xgrammar", "llguidance", "auto"))
    p.add_argument("--compile-only", action="store_true")
    args = p.parse_args()
    files = sorted(MASKBENCH.glob("*.json"))
    if args.limit:
        files = files[: args.limit]
    llm = LLM(
        loaded=load_model(),
        kv_cache_memory=1 << 30,
        jump_forward=args.jump_forward,
        grammar_backend=args.backend,
    )
    backend = llm.engine.grammars.backend
    not_compiled, loosened, runnable = [], [], []
    chosen: Counter[str] = Counter()
    for i, f in enumerate(files):
        schema = json.loads(f.read_text())["schema"]
        try:
            compiled = backend.compile(StructuredOutput(json_schema=schema))
        except GrammarError as exc:
            not_compiled.append({"file": f.name, "error": str(exc)})
            continue
        chosen[compiled.backend] += 1
        if compiled.warnings:
            loosened.append({"file": f.name, "keywords": compiled.warnings})
        else:
            runnable.append((f.name, schema))
        if (i + 1) % 100 == 0:
            print(f"  {i + 1}/{len(files)} compiled", flush=True)
    print(
        f"{args.backend}: {len(files)} schemas: {len(not_compiled)} do not compile, "
        f"{len(loosened)} with keywords not enforced, {len(runnable)} to decode; "
        f"backends chosen {dict(chosen)}",
        flush=True,
    )
    if args.compile_only:
        RESULTS.mkdir(exist_ok=True)
        out = {"backend": args.backend, "schemas": len(files), "chosen": dict(chosen)}
        out |= {"not_compiled": not_compiled, "loosened": loosened, "runnable": len(runnable)}
        (RESULTS / f"maskbench_compile_{args.backend}.json").write_text(json.dumps(out, indent=2))
        return
    results = decode(llm, runnable, args.max_tokens, args.batch, args)
    unfinished = {r["file"] for r in results if r["finish_reason"] == "length" and not r["looping"]}
    if unfinished and args.retry_max_tokens > args.max_tokens:
        print(f"{len(unfinished)} unfinished without a loop: again with {args.retry_max_tokens}")
        retry = [x for x in runnable if x[0] in unfinished]
        again = {r["file"]: r for r in decode(llm, retry, args.retry_max_tokens, args.batch, args)}
        results = [again.get(r["file"], r) for r in results]

    ok = [r for r in results if r["validated"]]
    bad = [r for r in results if not r["validated"]]
    looping = [r for r in bad if r["looping"]]
    early = [r for r in bad if r["ended_early"]]
    invalid = [r for r in bad if r["finish_reason"] != "length" and not r["ended_early"]]
    no_loop = len(bad) - len(looping) - len(invalid) - len(early)
    summary = {
        "schemas": len(files),
        "not_compiled": not_compiled,
        "loosened": loosened,
        "decoded": len(results),
        "validated": len(ok),
        "looping": len(looping),
        "length_without_loop": no_loop,
        "terminated_invalid": len(invalid),
        "ended_early_repeat": len(early),
        "tokens": sum(r["tokens"] for r in results),
        "plain": args.plain,
        "repetition_penalty": args.repetition_penalty,
        "backend": args.backend,
        "chosen": dict(chosen),
        "exceptions": bad,
        "max_tokens": args.max_tokens,
        "retry_max_tokens": args.retry_max_tokens,
    }
    RESULTS.mkdir(exist_ok=True)
    name = "maskbench_eval_plain" if args.plain else "maskbench_eval"
    name += "" if args.backend == "xgrammar" else f"_{args.backend}"
    name += ".json"
    (RESULTS / name).write_text(json.dumps(summary, indent=2))
    print(
        f"\nvalidated {len(ok)} of {len(results)} decoded outputs; {len(looping)} loop until "
        f"max_tokens, {no_loop} reach it without a loop, {len(invalid)} terminated invalid, "
        f"{len(early)} ended early by the repeat guard; "
        f"{sum(r['tokens'] for r in results)} tokens decoded"
    )
    for r in bad:
        kind = "loop" if r["looping"] else r["finish_reason"]
        print(f"  {r['file']}: {kind} after {r['tokens']} tokens, ends {r['tail'][-40:]!r}")
        if r["finish_reason"] != "length":
            print(f"    {r['warnings'][-1:]}")
    for r in not_compiled:
        print(f"  not compiled: {r['file']}: {r['error'][:160]}")


if __name__ == "__main__":
    main()
