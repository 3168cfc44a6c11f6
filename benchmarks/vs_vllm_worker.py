"""One engine of benchmarks/vs_vllm.py in its own process: structserve or vLLM's CPU build.

    <python of the engine> benchmarks/vs_vllm_worker.py ENGINE JOB.json OUT.json

Loads the engine, warms it up (a short request and a schema of its own, so no workload grammar
compiles before timing), runs each workload of the job and writes its outputs and timings. It
imports nothing outside the standard library at module level, so the peer's interpreter can run it.
"""

from __future__ import annotations

import json
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Warm-up grammar, kept out of the workload so no workload grammar is compiled before timing.
WARM_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def structserve_engine(job: dict) -> tuple[Any, Any, dict]:
    sys.path.insert(0, str(ROOT))
    import torch

    from services import LLM, SamplingParams, StructuredOutput

    settings = {
        "model": job["model"],
        "device": "cpu",
        "dtype": job.get("dtype", "float32"),
        "num_threads": job["threads"],
        "kv_cache_memory": job["kv_gib"] << 30,
        "max_num_seqs": job["max_num_seqs"],
        "max_num_batched_tokens": job["max_num_batched_tokens"],
        "seed": job["seed"],
    }
    llm = LLM(**{**settings, **job.get("structserve_args", {})})  # --structserve-args win

    def params(r: dict) -> SamplingParams:
        structured = StructuredOutput(json_schema=r["schema"]) if "schema" in r else None
        return SamplingParams(
            max_tokens=r["max_tokens"],
            temperature=0.0,
            ignore_eos=r.get("ignore_eos", False),
            structured=structured,
        )

    def generate(reqs: list[dict]) -> list[tuple[list[int], str, str | None]]:
        outs = llm.generate([r["prompt"] for r in reqs], [params(r) for r in reqs])
        return [(list(o.token_ids), o.text, o.finish_reason) for o in outs]

    versions = {"xgrammar": version("xgrammar"), "torch": torch.__version__}
    return generate, lambda: None, {**versions, "threads": torch.get_num_threads()}


def vllm_engine(job: dict) -> tuple[Any, Any, dict]:
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(
        model=job["model"],
        tokenizer=job["model"],
        dtype=job.get("dtype", "float32"),
        seed=job["seed"],
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        enforce_eager=job["vllm_enforce_eager"],
        generation_config="vllm",  # vLLM's neutral defaults, not the folder's generation_config
        structured_outputs_config={"backend": "xgrammar"},
    )

    def params(r: dict) -> SamplingParams:
        structured = StructuredOutputsParams(json=r["schema"]) if "schema" in r else None
        return SamplingParams(
            max_tokens=r["max_tokens"],
            temperature=0.0,
            ignore_eos=r.get("ignore_eos", False),
            structured_outputs=structured,
        )

    def generate(reqs: list[dict]) -> list[tuple[list[int], str, str | None]]:
        prompts = [{"prompt_token_ids": r["prompt"]} for r in reqs]
        outs = llm.generate(prompts, [params(r) for r in reqs], use_tqdm=False)
        return [
            (list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason)
            for o in outs
        ]

    versions = {
        "vllm": vllm.__version__,
        "xgrammar": version("xgrammar"),
        "torch": torch.__version__,
    }
    # an explicit shutdown: left to interpreter exit, the engine core process is reaped noisily
    return generate, llm.llm_engine.engine_core.shutdown, versions


def worker(engine: str, job_path: Path, out_path: Path) -> None:
    job = json.loads(job_path.read_text())
    start = time.perf_counter()
    build = structserve_engine if engine == "structserve" else vllm_engine
    generate, close, versions = build(job)
    warm = job["warm_prompt"]
    generate([{"prompt": warm, "max_tokens": 4, "ignore_eos": True}])
    generate([{"prompt": warm, "max_tokens": 8, "schema": WARM_SCHEMA}])
    result: dict = {"startup_s": time.perf_counter() - start, "versions": versions}
    log(f"  [{engine}] loaded and warmed up in {result['startup_s']:.1f} s")
    for name, reqs in job["workloads"].items():
        log(f"  [{engine}] {name}: {len(reqs)} requests ...")
        start = time.perf_counter()
        outs = generate(reqs)
        seconds = time.perf_counter() - start
        tokens = sum(len(ids) for ids, _, _ in outs)
        result[name] = {
            "seconds": seconds,
            "output_tokens": tokens,
            "tokens_per_second": tokens / seconds,
            "seconds_per_token": seconds / max(tokens, 1),
            "outputs": [{"token_ids": i, "text": t, "finish_reason": f} for i, t, f in outs],
        }
        log(f"  [{engine}] {name}: {tokens} tokens in {seconds:.2f} s")
    close()
    out_path.write_text(json.dumps(result))


if __name__ == "__main__":
    worker(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
