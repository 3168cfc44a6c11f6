"""Fair shares inside one engine: a steady tenant beside a flooding one, fair vs arrival order.

Tenant A floods the engine (`--flood` requests of `--tokens` tokens each, like n=16 streams), and
tenant B sends one short request every `--every` steps. Per scheduler (`fair_scheduling` on and
off, the same engine otherwise) this reports B's time to first token (p50, p99) against B alone,
with B weighted `--weight-b`. In-process and greedy; both runs see the same arrivals at the same
steps. (How tokens follow the weights while both tenants are backlogged is shown step by step in
tests/unit/test_fair_scheduler.py.) Writes `benchmarks/results/fair_shares.json`.

    .venv/bin/python benchmarks/fair_shares.py [--flood 32] [--tokens 48] [--weight-b 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.measure import pct
from services import LLM, SamplingParams
from services.models import load_model

RESULTS = Path(__file__).resolve().parent / "results"


def run(llm: LLM, args: argparse.Namespace, flood: bool) -> dict:
    """B's TTFTs (s) and every tenant's tokens, with or without A's flood."""
    engine = llm.engine
    long = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    if flood:
        for i in range(args.flood):
            engine.add_request(f"Tell me a long story, number {i}.", long, f"a{i}", tenant="a")
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    tokens: Counter = Counter()
    step = 0
    while engine.has_unfinished() or len(sent) < args.b_requests:
        if step % args.every == 0 and len(sent) < args.b_requests:
            rid = f"b{len(sent)}"
            engine.add_request(f"Name a colour, {rid}.", short, rid, tenant="b")
            sent[rid] = time.perf_counter()
        step += 1
        for req in engine.step():
            tokens[req.tenant] += 1
            if req.tenant == "b" and req.request_id not in first:
                first[req.request_id] = time.perf_counter()
            if req.finish_reason is not None:
                engine.release(req.request_id)
    ttft = [first[r] - sent[r] for r in sent]
    return {"ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99), "tokens": dict(tokens)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--flood", type=int, default=32)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--every", type=int, default=6, help="steps between B's requests")
    p.add_argument("--b-requests", type=int, default=8)
    p.add_argument("--weight-b", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=16)
    args = p.parse_args()
    loaded = load_model()
    rows = {}
    for fair in (True, False):
        llm = LLM(
            loaded=loaded,
            kv_cache_memory=256 << 20,
            max_num_seqs=args.max_num_seqs,
            fair_scheduling=fair,
            tenant_weights={"a": 1.0, "b": args.weight_b},
        )
        alone = run(llm, args, flood=False)
        loaded_run = run(llm, args, flood=True)
        name = "fair" if fair else "arrival order"
        rows[name] = {
            "alone": alone,
            "flood": loaded_run,
            "p50_over_alone": loaded_run["ttft_p50_s"] / alone["ttft_p50_s"],
            "p99_over_alone": loaded_run["ttft_p99_s"] / alone["ttft_p99_s"],
        }
        print(f"{name}: {json.dumps(rows[name])}", flush=True)
    print("\n| scheduler | B TTFT p50 / alone | B TTFT p99 / alone |")
    print("|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['p50_over_alone']:.2f} | {r['p99_over_alone']:.2f} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fair_shares.json").write_text(json.dumps({"args": vars(args), **rows}, indent=2))


if __name__ == "__main__":
    main()
