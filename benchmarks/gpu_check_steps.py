"""Steps 2-4 of `benchmarks/gpu_check.py`: our engine against Hugging Face `generate` on
random-weight models (`gpu_check_models.py`), and Quest with the KV host tier.

The engine drivers are the existing benchmarks' own (`structured.run_engine`,
`engine_throughput.make_workload` / `run_hf`, `kv_tier.Decode`).
"""

from __future__ import annotations

import argparse
import copy
import math
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_throughput import make_workload, run_hf
from benchmarks.gpu_check_models import (
    DTYPES,
    PAGE,
    PEAKED_INIT,
    SCHEMAS,
    SKIPPED,
    SMOLLM2_135M,
    Clock,
    describe,
    drop,
    pool_bytes,
    random_llama,
)
from benchmarks.gpu_check_report import tier_line
from benchmarks.kv_tier import Decode, interleaved
from benchmarks.structured import run_engine as timed_generate
from benchmarks.structured import valid_count
from services import LLM, KVPolicy, SamplingParams, StructuredOutput
from services.engine.kv_offload import RECENT_PAGES
from services.models import LoadedModel

# -- step 2: greedy equality ---------------------------------------------------------------------


def equality_prompts(tokenizer: Any) -> list[list[int]]:
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
    )
    texts = [
        "def quicksort(arr):",
        "The history of the Roman Empire spans many centuries. " * 4,
        "1, 2, 3, 4, 5,",
        "In a hole in the ground there lived a hobbit. " * 2,
    ]
    chat_ids = list(chat["input_ids"]) if hasattr(chat, "keys") else list(chat)
    return [chat_ids, *(tokenizer.encode(t, add_special_tokens=False) for t in texts)]


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF `generate`, one prompt, EOS ignored: the tokens and each step's logits `[n, V]`."""
    model.set_attn_implementation("sdpa")
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.do_sample, config.max_new_tokens = [], False, n
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        generation_config=config,
        return_dict_in_generate=True,
        output_logits=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), torch.stack(out.logits)[:, 0].float().cpu()


def ulp(x: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype` values near `x`: a logit gap of one ulp is a tie in that dtype."""
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(x), 1e-30)))


def compare(ours: list[int], ref: list[int], logits: torch.Tensor, dtype: torch.dtype) -> dict:
    """Where our tokens first leave HF's, and by how much HF's own logits preferred its token."""
    top2 = logits.topk(2, dim=-1).values
    margins = top2[:, 0] - top2[:, 1]
    row: dict[str, Any] = {"equal": ours == ref, "min_top2_margin": float(margins.min())}
    d = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), None)
    if d is not None:
        row.update(
            first_divergence=d,
            hf_token=ref[d],
            our_token=ours[d],
            logit_gap=float(logits[d, ref[d]] - logits[d, ours[d]]),
            top2_margin=float(margins[d]),
            ulp_there=ulp(float(top2[d, 0]), dtype),
        )
    return row


@torch.inference_mode()
def forced_gap(model: Any, prompt: list[int], ours: list[int]) -> float:
    """HF's forward over the prompt and our tokens: the largest gap, over our tokens, between
    HF's top logit and its logit of our token (0 when every token is HF's argmax too). After a
    divergence greedy runs part ways; this still says whether each of our choices was a tie."""
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([prompt + ours[:-1]], device=model.device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 :].float()
    picked = logits.gather(1, torch.tensor(ours, device=logits.device)[:, None])[:, 0]
    return float((logits.max(dim=-1).values - picked).max())


def _none_last(x: float | None) -> float:
    return math.inf if x is None else x


def greedy_equality(
    tokenizer: Any, folder: Path, device: torch.device, layers: int, new_tokens: int
) -> dict[str, Any]:
    shape = {**SMOLLM2_135M, "num_hidden_layers": layers}
    prompts = equality_prompts(tokenizer)
    out: dict[str, Any] = {"new_tokens": new_tokens}
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    longest = max(len(p) for p in prompts) + new_tokens
    for name, dtype in DTYPES.items():
        # the same float32 weights each time, in a fresh model object: an engine prepares the
        # model it is given for its dtype (CPU weight packing), so none is reused across dtypes
        loaded = random_llama(shape, tokenizer, folder, device, torch.float32, PEAKED_INIT)
        loaded.model.to(dtype)
        out["model"] = describe(loaded)
        refs = [hf_greedy(loaded.model, p, new_tokens) for p in prompts]
        llm = LLM(
            loaded=loaded,
            device=str(device),
            dtype=name,
            kv_cache_memory=pool_bytes(loaded, len(prompts) * longest, dtype),
            grammar_workers=0,
        )
        outs = llm.generate(prompts, greedy)
        ours = [o.token_ids for o in outs]
        rows = [compare(o, r, lg, dtype) for o, (r, lg) in zip(ours, refs, strict=True)]
        for row, p, o, (r, _), done in zip(rows, prompts, ours, refs, outs, strict=True):
            row["finish_reason"] = done.finish_reason  # "error": the engine failed it
            row["forced_gap"] = forced_gap(loaded.model, p, o) if o else None
            # the noise floor: HF's own incremental tokens under its own full forward
            row["hf_forced_gap"] = forced_gap(loaded.model, p, r)
        out[name] = {
            "equal": sum(r["equal"] for r in rows),
            "prompts": len(rows),
            "worst_forced_gap": max((r["forced_gap"] for r in rows), key=_none_last),
            "worst_hf_forced_gap": max(r["hf_forced_gap"] for r in rows),
            "rows": rows,
        }
        del loaded
        drop(llm)
    return out


# -- step 3: throughput -------------------------------------------------------------------------


def workload(
    requests: int, prompts: tuple[int, int], outputs: tuple[int, int], vocab: int, seed: int
):
    ns = argparse.Namespace(
        seed=seed,
        requests=requests,
        min_prompt=prompts[0],
        max_prompt=prompts[1],
        min_output=outputs[0],
        max_output=outputs[1],
    )
    return make_workload(ns, vocab)


def _timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, Any]:
    r = timed_generate(llm, prompts, params, repeats=1)
    r.pop("texts")
    return r


def throughput(
    loaded: LoadedModel,
    device: torch.device,
    batch_sizes: tuple[int, ...],
    prompts: tuple[int, int],
    outputs: tuple[int, int],
    clock: Clock,
    seed: int = 0,
) -> dict[str, Any]:
    """Per batch size, one mixed workload (all requests at once, greedy): the engine unconstrained,
    HF `generate` on the same batch, the engine with a JSON schema per request (masks overlapped
    with the forward, then filled after it), and unconstrained again at the constrained lengths."""
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    biggest = max(batch_sizes)
    common: dict[str, Any] = dict(
        loaded=loaded,
        device=str(device),
        dtype=dtype,
        kv_cache_memory=pool_bytes(loaded, biggest * (prompts[1] + outputs[1]), DTYPES[dtype]),
        max_num_seqs=biggest,
        grammar_workers=0,  # compiles happen at warm-up; the check times decoding
        enable_prefix_caching=False,  # every run sends the same prompts: no hit from the last run
    )
    llms = {"overlap": LLM(**common), "serial": LLM(**common, overlap_masks=False)}
    for llm in llms.values():  # warm-up: kernels, the tokenizer scan, every grammar compiled
        warm = [
            SamplingParams(max_tokens=4, temperature=0, structured=StructuredOutput(json_schema=s))
            for s in SCHEMAS
        ]
        llm.generate([[99] * 16] * len(SCHEMAS), warm)
    out: dict[str, Any] = {"model": describe(loaded), "dtype": dtype, "batches": {}}
    for b in batch_sizes:
        work = workload(b, prompts, outputs, int(loaded.config.vocab_size), seed)
        ids = [p for p, _ in work]
        schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(b)]
        free = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in work]
        cons = [
            SamplingParams(max_tokens=n, temperature=0, structured=StructuredOutput(json_schema=s))
            for (_, n), s in zip(work, schemas, strict=True)
        ]
        row: dict[str, Any] = {}
        row["engine"] = _run(clock, _timed, llms["overlap"], ids, free)
        row["hf_generate"] = _run(clock, _hf, loaded, work, device)
        row["constrained_overlap"] = _run(clock, _constrained, llms["overlap"], ids, cons, schemas)
        row["constrained_serial"] = _run(clock, _constrained, llms["serial"], ids, cons, schemas)
        lengths = row["constrained_overlap"].get("lengths")
        if lengths is not None:
            free = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
            row["unconstrained_same_lengths"] = _run(clock, _timed, llms["overlap"], ids, free)
        for key, r in row.items():
            print(f"  batch {b} {key}: {_tps(r)}", flush=True)
            r.pop("lengths", None)
        row["ratios"] = _ratios(row)
        out["batches"][str(b)] = row
    drop(*llms.values())
    return out


def _hf(loaded: LoadedModel, work: list[tuple[list[int], int]], device: torch.device) -> dict:
    # run_hf builds its inputs with torch.tensor: the device context puts them beside the model
    with torch.device(device):
        r = run_hf(loaded, work, len(work))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return r


def _constrained(llm: LLM, ids: list[list[int]], params: list[SamplingParams], schemas) -> dict:
    r = timed_generate(llm, ids, params, repeats=1)
    r["valid"] = valid_count(r.pop("texts"), schemas)
    return r


def _run(clock: Clock, fn: Any, *args: Any) -> dict[str, Any]:
    """One timed run, or why it did not happen: one failing run must not lose the others."""
    if clock.left() <= 0:
        return dict(SKIPPED)
    try:
        return fn(*args)
    except Exception as exc:
        traceback.print_exc()
        return {
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-2000:],
        }


def _tps(r: dict[str, Any]) -> str:
    if "tokens_per_second" not in r:
        return str(r.get("error") or r.get("skipped"))
    return f"{r['tokens_per_second']:.1f} tok/s"


def _ratios(row: dict[str, Any]) -> dict[str, float | None]:
    def ratio(a: str, b: str) -> float | None:
        x, y = row.get(a, {}), row.get(b, {})
        if "tokens_per_second" not in x or "tokens_per_second" not in y:
            return None
        return x["tokens_per_second"] / y["tokens_per_second"]

    return {
        "engine/hf_generate": ratio("engine", "hf_generate"),
        "constrained/unconstrained": ratio("constrained_overlap", "unconstrained_same_lengths"),
        "overlap/serial": ratio("constrained_overlap", "constrained_serial"),
    }


# -- step 4: the KV host tier ---------------------------------------------------------------------


def kv_tier(
    loaded: LoadedModel, device: torch.device, contexts: tuple[int, ...], steps: int, clock: Clock
) -> dict[str, Any]:
    """Quest all-resident vs Quest with the host tier (hot set of 0 and of the budget's pages),
    one request per engine, decode steps interleaved (benchmarks/kv_tier.py's method). Prompts
    are random tokens; the budget is 1/8 of the context."""
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    common: dict[str, Any] = dict(loaded=loaded, device=str(device), dtype=dtype, grammar_workers=0)
    resident = LLM(**common, kv_cache_memory=pool_bytes(loaded, max(contexts), DTYPES[dtype]))
    layout = resident.engine.runner.kv.layout
    device_pages = 1 + RECENT_PAGES + max(contexts) // 8 // PAGE + 4
    assert device_pages * PAGE < min(contexts), "the device pool alone must not hold a context"
    mults = (0, 1)
    tiered = [
        LLM(
            **common,
            kv_cache_memory=device_pages * layout.bytes_per_page,
            kv_tier_pages=max(contexts) // PAGE + 64,
            kv_tier_tenant_pages=max(contexts) // PAGE + 64,  # one tenant: the whole tier
        )
        for _ in mults
    ]
    gen = torch.Generator().manual_seed(1)
    vocab = int(loaded.config.vocab_size)
    out: dict[str, Any] = {"model": describe(loaded), "dtype": dtype, "contexts": {}}
    for ctx in contexts:
        if clock.left() <= 0:
            out["contexts"][str(ctx)] = dict(SKIPPED)
            continue
        budget = ctx // 8
        prompt = torch.randint(100, vocab, (ctx,), generator=gen).tolist()
        print(f"  context {ctx}: prefilling 3 engines", flush=True)
        base = Decode(resident.engine, prompt, KVPolicy(kind="quest", budget_tokens=budget), steps)
        runs = [
            Decode(
                llm.engine,
                prompt,
                KVPolicy(
                    kind="quest", budget_tokens=budget, offload=True, hot_pages=m * budget // PAGE
                ),
                steps,
            )
            for llm, m in zip(tiered, mults, strict=True)
        ]
        interleaved([base, *runs])
        ref = base.result()
        row: dict[str, Any] = {"budget": budget, "resident_step_ms": ref["step_ms"]}
        for m, run in zip(mults, runs, strict=True):
            r = run.result()
            step_s, extra_s = r["step_ms"] / 1e3, (r["step_ms"] - ref["step_ms"]) / 1e3
            row[f"hot_{m}x"] = {
                "hot_pages": m * budget // PAGE,
                "step_ms": r["step_ms"],
                "step_ratio": r["step_ms"] / ref["step_ms"],
                "mib_per_step": r["bytes_per_step"] / 2**20,
                "hit_rate": r["hits"] / max(1, r["hits"] + r["misses"]),
                # the rate the copies reach if they take the whole step / only the extra time
                "gb_per_s_over_step": r["bytes_per_step"] / step_s / 1e9,
                "gb_per_s_over_extra": r["bytes_per_step"] / extra_s / 1e9 if extra_s > 0 else None,
                "same_tokens": r["tokens"] == ref["tokens"],
                "read_p50_ms": r["read_p50_ms"],
            }
        out["contexts"][str(ctx)] = row
        print(f"  context {ctx}: {tier_line(row)}", flush=True)
    drop(resident, *tiered)
    return out
