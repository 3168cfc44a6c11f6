"""Step 5 of `benchmarks/gpu_check.py`: the attention kernel that reads pages in place
(`kvcache/triton_attention.py`) against the gather path it replaces, on random pages at the
engine's shapes: the largest difference of their outputs and the time of one layer's attention
call, for decode batches at a context length (SmolLM2-135M's heads: 9 query heads, 3 KV heads,
head size 64; pages of 16). On a CPU the kernel runs under Triton's interpreter: its times say
nothing there, its outputs do."""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import torch

from kvcache.attention import paged_attention_forward
from kvcache.batch import SeqSlice, build_paged_batch
from kvcache.pages import KVLayout, PagedKVCache

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16


class _Layer(torch.nn.Module):
    layer_idx = 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Any) -> torch.Tensor:
    return paged_attention_forward(_Layer(), q, k, v, None, paged_batch=batch)[0]


def _timed(fn: Any, device: torch.device, repeats: int) -> tuple[torch.Tensor, float]:
    out = fn()  # warm-up (the kernel compiles on its first call)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    _sync(device)
    return out, (time.perf_counter() - start) / repeats


def attention_kernel(
    device: torch.device, dtype: torch.dtype, batches: tuple[int, ...], context: int, repeats: int
) -> dict[str, Any]:
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return {"skipped": "a CPU runs Triton only under TRITON_INTERPRET=1 (set without CUDA)"}
    from kvcache.triton_attention import TritonPagedKernel

    out: dict[str, Any] = {"context": context, "dtype": str(dtype).removeprefix("torch.")}
    for rows in batches:
        pages_each = -(-(context + 1) // PAGE)
        layout = KVLayout(1, KV_HEADS, HEAD_DIM, PAGE, dtype)
        kv = PagedKVCache(layout, rows * pages_each + 1, device)
        seqs = []
        for _ in range(rows):
            pages = kv.allocator.allocate(pages_each)
            pages.reverse()  # out of order, as a long-running pool hands them out
            seqs.append(SeqSlice(pages, context, 1))
        kv.keys.normal_()
        kv.values.normal_()
        q = torch.randn(1, HEADS, rows, HEAD_DIM, device=device, dtype=dtype)
        k = torch.randn(1, KV_HEADS, rows, HEAD_DIM, device=device, dtype=dtype)
        v = torch.randn_like(k)
        batch, _ = build_paged_batch(kv, seqs)
        call = functools.partial(_attend, q, k, v, batch)
        kv.kernel = None
        gathered, t_gather = _timed(call, device, repeats)
        kv.kernel = TritonPagedKernel()
        in_place, t_kernel = _timed(call, device, repeats)
        out[f"batch_{rows}"] = {
            "max_abs_diff": float((in_place.float() - gathered.float()).abs().max()),
            "gather_ms": 1e3 * t_gather,
            "kernel_ms": 1e3 * t_kernel,
            "kernel_over_gather": t_kernel / t_gather,
        }
        del kv, batch
    return out


def decode_graphs(
    loaded: Any, device: torch.device, batches: tuple[int, ...], new_tokens: int
) -> dict[str, Any]:
    """Decode steps replayed as CUDA graphs against eager steps on the step-3 model (greedy,
    16-token prompts): the same tokens, and the time of a decode step at each batch size (a
    run of 1 + `new_tokens` tokens minus a run of 1, over `new_tokens`). On a CPU the graphs'
    padded forward runs uncaptured: same tokens, times of no interest."""
    from benchmarks.gpu_check_models import pool_bytes
    from services import LLM, SamplingParams

    if isinstance(loaded, dict):  # building the model failed: what it raised
        return loaded
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    graphs = "auto" if device.type == "cuda" else "uncaptured"
    biggest = max(batches)
    common: dict[str, Any] = dict(
        loaded=loaded,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        kv_cache_memory=pool_bytes(loaded, biggest * (16 + new_tokens + 1), dtype),
        max_num_seqs=biggest,
        grammar_workers=0,
        enable_prefix_caching=False,
        speculative=None,  # one token a row a step: a drafted step is not a graph's
    )
    llms = {mode: LLM(**common, decode_graphs=mode) for mode in ("off", graphs)}
    gen = torch.Generator().manual_seed(2)
    vocab = int(loaded.config.vocab_size)
    out: dict[str, Any] = {"graphs": graphs}
    for rows in batches:
        prompts = torch.randint(100, vocab, (rows, 16), generator=gen).tolist()
        row: dict[str, Any] = {}
        tokens = {}
        for mode, llm in llms.items():
            times = []
            for n in (1, 1 + new_tokens, 1, 1 + new_tokens):  # the first pair warms up
                params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                _sync(device)
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                _sync(device)
                times.append(time.perf_counter() - start)
            tokens[mode] = [o.token_ids for o in outs]
            row[f"{mode}_step_ms"] = 1e3 * (times[3] - times[2]) / new_tokens
        row["same_tokens"] = tokens["off"] == tokens[graphs]
        row["graphs_over_eager"] = row[f"{graphs}_step_ms"] / row["off_step_ms"]
        out[f"batch_{rows}"] = row
    runner = llms[graphs].engine.runner.graphs
    out["steps"] = {"replayed": runner.replayed, "uncaptured": runner.uncaptured} if runner else {}
    return out
