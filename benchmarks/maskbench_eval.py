"""Correctness over `../shared/data/maskbench/`: does every constrained output parse and validate?

For each schema: compile it (with fidelity `warn`), skip it from the count when it does not compile
(listed), decode greedily with the schema as the constraint, and validate the text with
`jsonschema-rs` (the engine's check). A schema with keywords the grammar cannot enforce is decoded
too when checked decoding is on (`--check-retries`, the engine's default 4: the check enforces
them, services/engine/structured/checked.py), and skipped (listed) with `--check-retries 0`.
Outputs that reach max_tokens are checked for a loop (the text ends in a unit repeated at least 3
times, as a small model does inside an unbounded string); those that do not loop are decoded again
with `--retry-max-tokens`. Prints the counts and every exception, writes
`benchmarks/results/maskbench_eval[_BACKEND].json`.

An output finishes when the grammar ended it and the check gave a verdict (`stop`, or `error`
when it failed); one a guard cut (the repeat guard inside a string, parser limits) or that
reached `max_tokens` did not, and is counted apart.

Invalid and unflagged: an output the grammar ended (it terminated: `stop`, turned into `error`
when its validation failed) that does not validate, for a schema with no keyword reported as not
enforced. It must stay 0: the grammar claimed the whole schema. A checked schema's output that
still fails after its returns ends `error` with the keyword and path: counted apart ("check
spent"), flagged by construction.

`--backend xgrammar|llguidance|auto` picks the grammar backend (`grammar_backend`, default
`auto` as the engine's); with
`--compile-only` only the compile phase runs: per backend, which schemas compile, which have
keywords it cannot enforce, and under `auto` which backend each schema got.

A full decode takes the better part of an hour on 2 cores: `--max-minutes M` stops after the
batch that passes M minutes, every decoded row kept in `maskbench_eval[...].rows.jsonl`, and
`--resume` goes on from there (the summary is written once every schema is decoded).

    .venv/bin/python benchmarks/maskbench_eval.py [--backend auto] [--compile-only] [--limit N]
        [--max-tokens 256] [--batch 32] [--check-retries 4] [--max-minutes 20 [--resume]]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services import LLM, SamplingParams, StructuredOutput
from services.grammar import GrammarError
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
) -> Iterator[list[dict]]:
    """Decodes `runnable` in batches; yields each batch's rows."""
    finish = {} if not args.plain else {"bound_numbers": False, "max_repeat_run": None}
    decoded = 0
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
        rows = []
        for (name, _), out in zip(chunk, llm.generate(prompts, sps), strict=True):
            returns = [w for w in out.warnings if w.startswith("checked decoding:")]
            rows.append(
                {
                    "file": name,
                    "checked": any("enforced by the check" in w for w in out.warnings),
                    "returns": returns,
                    "finish_reason": out.finish_reason,
                    "validated": out.validated,
                    "looping": out.finish_reason == "length" and ends_in_loop(out.text),
                    "ended_early": any("max_repeat_run" in w for w in out.warnings),
                    "tokens": len(out.token_ids),
                    "warnings": out.warnings,
                    "tail": out.text[-80:],
                    "max_tokens": max_tokens,
                }
            )
        decoded += len(rows)
        print(
            f"  {decoded}/{len(runnable)} decoded, {time.perf_counter() - start:.0f} s",
            flush=True,
        )
        yield rows


class Rows:
    """Decoded rows on disk, one JSON line each: first passes, then retries (`retry`)."""

    def __init__(self, path: Path, resume: bool, max_minutes: float, settings: dict) -> None:
        self.path = path
        if not resume or not path.exists():
            path.parent.mkdir(exist_ok=True)
            path.write_text(json.dumps({"settings": settings}) + "\n")
        lines = path.read_text().splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
        if not rows or rows[0].get("settings") != settings:  # rows of another run's settings
            sys.exit(f"--resume: {path.name} was written with other settings; rerun without it")
        rows = rows[1:]
        self.first = {r["file"]: r for r in rows if not r.get("retry")}
        self.retried = {r["file"]: r for r in rows if r.get("retry")}
        self.deadline = time.monotonic() + max_minutes * 60 if max_minutes else float("inf")

    def run(self, batches: Iterator[list[dict]], retry: bool = False) -> bool:
        """Keeps each batch's rows; False once past the time budget (rerun with --resume)."""
        for rows in batches:
            with self.path.open("a") as f:
                for row in rows:
                    f.write(json.dumps({**row, "retry": retry}) + "\n")
                    (self.retried if retry else self.first)[row["file"]] = row
            if time.monotonic() > self.deadline:
                print(f"stopped at the time budget; rerun with --resume ({self.path.name})")
                return False
        return True


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--limit", type=int, default=0, help="first N files only (0: all)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--retry-max-tokens", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--jump-forward", action="store_true")
    p.add_argument(
        "--plain",
        action="store_true",
        help="no bounds on numbers, no repeat guard (services/grammar/finish.py)",
    )
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--backend", default="auto", choices=("xgrammar", "llguidance", "auto"))
    p.add_argument("--check-retries", type=int, default=4, help="0: checked decoding off")
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--max-minutes", type=float, default=0, help="stop after this (0: never)")
    p.add_argument("--resume", action="store_true", help="go on from the rows kept so far")
    return p.parse_args()


def compile_all(
    llm: LLM, files: list[Path], checked: bool
) -> tuple[list, list, list, Counter[str]]:
    """Per schema: does not compile, compiles with keywords the grammar leaves (decoded too when
    `checked`: the check enforces them), or to decode."""
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
        if checked or not compiled.warnings:
            runnable.append((f.name, schema))
        if (i + 1) % 100 == 0:
            print(f"  {i + 1}/{len(files)} compiled", flush=True)
    return not_compiled, loosened, runnable, chosen


def main() -> None:
    args = parse_args()
    files = sorted(MASKBENCH.glob("*.json"))
    if args.limit:
        files = files[: args.limit]
    llm = LLM(
        loaded=load_model(),
        kv_cache_memory=1 << 30,
        jump_forward=args.jump_forward,
        grammar_backend=args.backend,
        check_retries=args.check_retries,
    )
    checked = args.check_retries > 0
    not_compiled, loosened, runnable, chosen = compile_all(llm, files, checked)
    print(
        f"{args.backend}: {len(files)} schemas: {len(not_compiled)} do not compile, "
        f"{len(loosened)} with keywords the {'check' if checked else 'grammar does not'} "
        f"enforce{'s' if checked else ''}, {len(runnable)} to decode; "
        f"backends chosen {dict(chosen)}",
        flush=True,
    )
    RESULTS.mkdir(exist_ok=True)
    if args.compile_only:
        out = {"backend": args.backend, "schemas": len(files), "chosen": dict(chosen)}
        out |= {
            "not_compiled": not_compiled,
            "loosened": loosened,
            "runnable": len(runnable),
        }
        (RESULTS / f"maskbench_compile_{args.backend}.json").write_text(json.dumps(out, indent=2))
        return
    name = "maskbench_eval_plain" if args.plain else "maskbench_eval"
    name += "" if args.backend == "xgrammar" else f"_{args.backend}"
    settings = {
        k: getattr(args, k)
        for k in (
            "max_tokens",
            "plain",
            "jump_forward",
            "repetition_penalty",
            "backend",
            "check_retries",
        )
    }
    rows = Rows(RESULTS / f"{name}.rows.jsonl", args.resume, args.max_minutes, settings)
    todo = [x for x in runnable if x[0] not in rows.first]
    if not rows.run(decode(llm, todo, args.max_tokens, args.batch, args)):
        return
    unfinished = {
        f for f, r in rows.first.items() if r["finish_reason"] == "length" and not r["looping"]
    }
    retry = [x for x in runnable if x[0] in unfinished and x[0] not in rows.retried]
    if unfinished and args.retry_max_tokens > args.max_tokens:
        print(f"{len(unfinished)} unfinished without a loop: again with {args.retry_max_tokens}")
        batches = decode(llm, retry, args.retry_max_tokens, args.batch, args)
        if not rows.run(batches, retry=True):
            return
    results = [rows.retried.get(f, rows.first[f]) for f, _ in runnable if f in rows.first]
    summary = summarize(results, args) | {
        "schemas": len(files),
        "not_compiled": not_compiled,
        "loosened": loosened,
        "chosen": dict(chosen),
    }
    (RESULTS / f"{name}.json").write_text(json.dumps(summary, indent=2))
    report(summary, len(loosened), checked)


def summarize(results: list[dict], args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in results if r["validated"]]
    bad = [r for r in results if not r["validated"]]
    looping = [r for r in bad if r["looping"]]
    early = [r for r in bad if r["ended_early"]]
    # ended by the grammar (a failed validation turns its `stop` into `error`), yet invalid
    failed = [r for r in bad if r["finish_reason"] == "error" and r["validated"] is False]
    unflagged = [r for r in failed if not r.get("checked")]
    spent = [r for r in failed if r.get("checked")]  # flagged: the keyword and path named
    # the grammar ended the output and the check gave its verdict (`stop`, or `error` when it
    # failed); one a guard cut (a loop inside a string, ...) has none, one at `length` no end
    finished = [
        r for r in results if r["finish_reason"] in ("stop", "error") and r["validated"] is not None
    ]
    # ended by a guard (whitespace run, parser limits, mask budget): nothing to validate
    guarded = [r for r in bad if r["validated"] is None and not r["ended_early"]]
    no_loop = [r for r in bad if r["finish_reason"] == "length" and not r["looping"]]
    return {
        "decoded": len(results),
        "validated": len(ok),
        "looping": len(looping),
        "length_without_loop": len(no_loop),
        "invalid_unflagged": len(unflagged),
        "check_spent": len(spent),
        "checked": sum(bool(r.get("checked")) for r in results),
        "returned": sum(bool(r.get("returns")) for r in results),
        "finished": len(finished),
        "finished_validated": sum(bool(r["validated"]) for r in finished),
        "check_retries": args.check_retries,
        "ended_early_repeat": len(early),
        "ended_by_other_guards": len(guarded),
        "tokens": sum(r["tokens"] for r in results),
        "plain": args.plain,
        "repetition_penalty": args.repetition_penalty,
        "backend": args.backend,
        "exceptions": bad,
        "max_tokens": args.max_tokens,
        "retry_max_tokens": args.retry_max_tokens,
    }


def report(summary: dict[str, Any], loosened: int, checked: bool) -> None:
    s = summary
    share = 100 * s["finished_validated"] / max(1, s["finished"])
    print(
        f"\n{s['backend']}: {s['schemas']} schemas, {s['schemas'] - len(s['not_compiled'])} "
        f"compile, {loosened} with keywords {'the check' if checked else 'not'} enforce"
        f"{'s' if checked else 'd'}, {s['decoded']} decoded: "
        f"{s['validated']} finish and validate ({share:.1f}% of the {s['finished']} that "
        f"finish), {s['invalid_unflagged']} invalid and unflagged, {s['check_spent']} checked "
        f"outputs that spent their returns ({s['returned']} went back at least once); "
        f"{s['looping']} loop until max_tokens, {s['length_without_loop']} reach it without a "
        f"loop, {s['ended_early_repeat']} ended early by the repeat guard, "
        f"{s['ended_by_other_guards']} by other guards; {s['tokens']} tokens decoded"
    )
    for r in s["exceptions"]:
        kind = "loop" if r["looping"] else r["finish_reason"]
        print(f"  {r['file']}: {kind} after {r['tokens']} tokens, ends {r['tail'][-40:]!r}")
        if r["finish_reason"] != "length":
            print(f"    {r['warnings'][-1:]}")
    for r in s["not_compiled"]:
        print(f"  not compiled: {r['file']}: {r['error'][:160]}")


if __name__ == "__main__":
    main()
