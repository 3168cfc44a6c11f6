"""Where an engine step's time goes: per phase (scheduling, batch metadata, the model forward,
attention, masks, sampling, detokenization and the rest) and, inside the forward, by op family.

Runs a workload through `services.LLM` with every phase's function wrapped in a timer (the engine
itself is unchanged), then the same workload again under `torch.profiler` for the op families:
  mixed  engine_throughput.py's requests (seeded random prompts 50-800 tokens, outputs 16-256,
         greedy, EOS ignored);
  json   vs_vllm.py's JSON-schema requests (structured.py's schemas, a chat prompt asking for a
         value of each, 128 tokens at most; xgrammar; the grammars compiled before timing).
Writes `benchmarks/results/profile_engine[_json].json`.

    .venv/bin/python benchmarks/profile_engine.py [--workload mixed|json] [--requests N]
        [--threads 2] [--no-ops] [--engine-args '{"key": value}']
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from services import LLM, SamplingParams, StructuredOutput

RESULTS = Path(__file__).resolve().parent / "results"
WARM_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


class Phases:
    """Seconds spent in each wrapped function; nested phases are subtracted from their parent."""

    def __init__(self) -> None:
        self.own: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[float]] = []

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        fn: Callable[..., Any] = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append([time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                start, inner = self._stack.pop()
                spent = time.perf_counter() - start
                self.own[name] += spent - inner
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1][1] += spent

        setattr(owner, attr, timed)


Work = list[tuple[list[int], SamplingParams]]


def mixed_workload(requests: int, vocab: int, seed: int) -> Work:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(100, vocab) for _ in range(rng.randint(50, 800))],
            SamplingParams(max_tokens=rng.randint(16, 256), temperature=0, ignore_eos=True),
        )
        for _ in range(requests)
    ]


def json_workload(llm: LLM, requests: int) -> Work:
    from structured_workloads import pick_schemas

    schemas = pick_schemas(requests)
    ask = "Produce a JSON value for this schema, nothing else: "  # vs_vllm.py's prompt
    out = []
    for i in range(requests):
        s = schemas[i % len(schemas)]
        prompt = llm.engine.apply_chat_template([{"role": "user", "content": ask + json.dumps(s)}])
        params = SamplingParams(
            max_tokens=128, temperature=0, structured=StructuredOutput(json_schema=s)
        )
        out.append((prompt, params))
    return out


def run(llm: LLM, work: Work) -> tuple[float, int, int]:
    engine = llm.engine
    reqs = [engine.add_request(p, params) for p, params in work]
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return time.perf_counter() - start, steps, sum(r.num_output_tokens for r in reqs)


def instrument(llm: LLM) -> Phases:
    from transformers import AttentionInterface

    import kvcache.attention as attention
    import services.engine.failures as failures
    import services.engine.model_runner as model_runner

    engine, phases = llm.engine, Phases()
    phases.wrap(engine, "_step", "step (engine bookkeeping)")
    phases.wrap(engine.scheduler, "schedule", "scheduling")
    phases.wrap(model_runner, "build_paged_batch", "batch metadata")
    forward = "fused" if engine.runner.fused is not None else "_transformers_forward"
    phases.wrap(engine.runner, forward, "model forward (rest)")
    phases.wrap(attention, "paged_attention_forward", "attention")  # registered again, wrapped
    AttentionInterface.register(attention.ATTN_IMPLEMENTATION, attention.paged_attention_forward)
    phases.wrap(failures, "sample", "sampling")
    phases.wrap(engine, "_update", "token update and detokenization")
    phases.wrap(engine.grammars, "start_masks", "masks")
    phases.wrap(engine.grammars, "apply_masks", "masks")
    return phases


def op_families(llm: LLM, work: Work) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(llm, work)
    rows = [(e.key, e.self_cpu_time_total / 1e6) for e in prof.key_averages()]
    return sorted(rows, key=lambda r: -r[1])[:25]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", choices=("mixed", "json"), default="mixed")
    p.add_argument("--requests", type=int, default=None, help="default: mixed 16, json 22")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-ops", action="store_true", help="skip the torch.profiler pass")
    p.add_argument("--engine-args", default="{}", help="JSON: more EngineConfig keys")
    args = p.parse_args()
    llm = LLM(num_threads=args.threads, **json.loads(args.engine_args))
    if args.workload == "json":
        work = json_workload(llm, args.requests or 22)
        # as vs_vllm_worker.py: warmed up on a schema of its own, so the workload's grammars
        # compile (and its prompts fill the prefix cache) inside the timed run
        warm = StructuredOutput(json_schema=WARM_SCHEMA)
        run(llm, [(work[0][0][:8], SamplingParams(max_tokens=8, structured=warm))])
    else:
        work = mixed_workload(args.requests or 16, llm.engine.runner.vocab_size, args.seed)
        run(llm, work[:2])  # warm-up
    phases = instrument(llm)
    wall, steps, tokens = run(llm, work)
    print(
        f"{len(work)} requests, {tokens} tokens in {wall:.1f} s ({tokens / wall:.1f} tok/s), "
        f"{steps} steps ({wall / steps * 1e3:.1f} ms a step)"
    )
    table = sorted(phases.own.items(), key=lambda kv: -kv[1])
    for name, seconds in table:
        print(f"  {name:34} {seconds:7.2f} s  {seconds / wall:6.1%}")
    out: dict[str, Any] = {"wall_s": wall, "steps": steps, "tokens": tokens, "phases": table}
    if not args.no_ops:
        ops = op_families(llm, work)
        print("ops (self CPU time, under the profiler):")
        for name, seconds in ops[:15]:
            print(f"  {name:40} {seconds:7.2f} s")
        out["ops"] = ops
    RESULTS.mkdir(exist_ok=True)
    suffix = "" if args.workload == "mixed" else f"_{args.workload}"
    (RESULTS / f"profile_engine{suffix}.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
