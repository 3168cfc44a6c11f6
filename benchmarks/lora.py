"""Multi-LoRA in the engine: what rows on adapters cost, and what a parked adapter costs its
first token.

1. Decode step time of a batch of 16 rows over 4 adapters (rank 16 on q/k/v/o and the MLP
   projections, 4 rows each, all 4 resident) against the same 16 rows on the base model, in one
   engine with LoRA on; and the base rows in an engine with LoRA off (what turning it on costs
   rows that use none). Target: adapters / base <= 1.3 on CPU.
2. Time to first token of one request whose adapter is resident in a slot, one whose adapter is
   parked in host memory (loaded into the slot at admission), and one whose adapter is read from
   disk (checked, its weights read on the engine's reader thread).

SmolLM2-135M (fp32), greedy, prompts of ~40 tokens. Writes `benchmarks/results/lora.json`.

    .venv/bin/python benchmarks/lora.py [--rows 16] [--adapters 4] [--steps 24] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = "Extract the vendor, the total and the currency from this invoice: " * 3


def decode_step_ms(engine, loras, steps: int) -> float:
    """Median decode step with every row running (after their prefills)."""
    from services import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    ids = [engine.add_request(PROMPT, params, lora=lo).request_id for lo in loras]
    while any(
        engine.requests[i].num_computed_tokens < engine.requests[i].num_prompt_tokens for i in ids
    ):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1000)
    for i in ids:
        engine.abort(i)
    while engine.has_unfinished():
        engine.step()
    for i in ids:
        engine.release(i)
    return statistics.median(times)


def ttft_ms(engine, lora) -> float:
    from services import SamplingParams

    start = time.perf_counter()
    req = engine.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0), lora=lora)
    while not req.finished:
        engine.step()
    engine.release(req.request_id)
    return (time.perf_counter() - start) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    from transformers import AutoConfig

    from services import LoRARequest
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.models.loader import resolve_model_dir
    from tests.lora_adapters import write_peft

    config = AutoConfig.from_pretrained(resolve_model_dir(None)[1])
    store = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    n = args.adapters
    loras = [
        LoRARequest(f"a{i}", str(write_peft(store / f"a{i}", config, args.rank, TARGETS, seed=i)))
        for i in range(n + 2)
    ]
    common = dict(kv_cache_memory=512 << 20, max_num_seqs=max(32, args.rows), grammar_workers=0)
    lora_on = LLMEngine(EngineConfig(
        enable_lora=True, max_loras=n, max_lora_rank=args.rank, max_cpu_loras=n + 2, **common
    ))  # fmt: skip
    lora_off = LLMEngine(EngineConfig(**common))
    mixed = [loras[i % n] for i in range(args.rows)]
    base = [None] * args.rows
    print(f"{args.rows} rows, {n} adapters of rank {args.rank} on {len(TARGETS)} projections")
    decode_step_ms(lora_on, mixed, 4)  # warm: every adapter read, parked and resident
    rows: dict[str, list[float]] = {"adapters": [], "base (LoRA on)": [], "base (LoRA off)": []}
    for r in range(args.repeats):  # interleaved: the machine's drift falls on all three
        rows["adapters"].append(decode_step_ms(lora_on, mixed, args.steps))
        rows["base (LoRA on)"].append(decode_step_ms(lora_on, base, args.steps))
        rows["base (LoRA off)"].append(decode_step_ms(lora_off, base, args.steps))
        print(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} ms" for k, v in rows.items()))
    step = {k: statistics.median(v) for k, v in rows.items()}
    ratio = step["adapters"] / step["base (LoRA off)"]
    print(f"decode step, median: {step}; adapters / base (LoRA off) = {ratio:.2f} (target <= 1.3)")

    # 2: one slot, two parked: resident, parked, and read from disk
    del lora_on, lora_off
    one = LLMEngine(EngineConfig(
        enable_lora=True, max_loras=1, max_lora_rank=args.rank, max_cpu_loras=2, **common
    ))  # fmt: skip
    ttft: dict[str, list[float]] = {"base": [], "resident": [], "parked": [], "from disk": []}
    ttft_ms(one, None)
    for r in range(args.repeats):
        x, y = loras[(2 * r) % len(loras)], loras[(2 * r + 1) % len(loras)]
        fresh = LoRARequest(f"fresh{r}", x.path)  # never seen: read from disk
        ttft["from disk"].append(ttft_ms(one, fresh))
        ttft_ms(one, y)  # parks y (and puts it in the slot)
        ttft["resident"].append(ttft_ms(one, y))
        ttft_ms(one, LoRARequest(f"other{r}", x.path))  # takes the slot: y stays parked
        ttft["parked"].append(ttft_ms(one, y))
        ttft["base"].append(ttft_ms(one, None))
    first = {k: statistics.median(v) for k, v in ttft.items()}
    print("time to first token, median ms: " + ", ".join(f"{k} {v:.1f}" for k, v in first.items()))
    RESULTS.mkdir(exist_ok=True)
    out = {"args": vars(args), "step_ms": rows, "ttft_ms": ttft, "ratio": ratio}
    (RESULTS / "lora.json").write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS / 'lora.json'}")


if __name__ == "__main__":
    main()
