"""Step 7 of `benchmarks/gpu_check.py`: the PNG and the short table, read off the result JSON.

Every reader tolerates a step that was skipped or failed (its entry then holds `skipped` or
`error`): a partial run still gets its table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

RUNS = ("engine", "hf_generate", "constrained_overlap", "constrained_serial")


def _ok(entry: Any) -> bool:
    # a count of skipped tests is an int; a step or run that did not happen says why in a string
    return (
        isinstance(entry, dict)
        and bool(entry)
        and not any(isinstance(entry.get(k), str) for k in ("skipped", "error"))
    )


def _why(entry: Any) -> str:
    if not isinstance(entry, dict):
        return "?"
    return str(entry.get("error") or entry.get("skipped", "?")).splitlines()[0][:90]


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def cuda_line(r: dict[str, Any]) -> str:
    if not _ok(r):
        return _why(r)
    line = (
        f"{r['passed']} passed, {r['failed']} failed, {r['errors']} errors, {r['skipped']} skipped"
    )
    return line + (f" ({r['note']})" if "note" in r else "")


def equality_lines(r: dict[str, Any]) -> list[tuple[str, str]]:
    if not _ok(r):
        return [("2 greedy equality", _why(r))]
    out = []
    for dtype in ("float32", "bfloat16"):
        d: dict[str, Any] = r.get(dtype) or {}
        if not _ok(d):
            out.append((f"2 greedy {dtype}", _why(d)))
            continue
        text = f"{d['equal']}/{d['prompts']} prompts equal over {r['new_tokens']} tokens"
        diverged = [(i, row) for i, row in enumerate(d["rows"]) if not row["equal"]]
        if diverged:
            i, row = diverged[0]
            text += (
                f"; first: prompt {i} at token {row['first_divergence']}, logit gap "
                f"{row['logit_gap']:.4g} ({row['logit_gap'] / row['ulp_there']:.1f} ulp)"
            )
        text += (
            f"; worst forced gap {_f(d['worst_forced_gap'], '.4g')} "
            f"(HF's own tokens: {_f(d['worst_hf_forced_gap'], '.4g')})"
        )
        out.append((f"2 greedy {dtype}", text))
    return out


def throughput_lines(r: dict[str, Any]) -> list[tuple[str, str]]:
    if not _ok(r):
        return [("3 throughput", _why(r))]
    out = []
    for model, m in r.items():
        if not _ok(m):
            out.append((f"3 {model}", _why(m)))
            continue
        for b, row in m["batches"].items():
            q = row["ratios"]
            tps = {k: row[k].get("tokens_per_second") for k in RUNS if k in row}
            engine, hf = _f(tps.get("engine"), ".0f"), _f(tps.get("hf_generate"), ".0f")
            text = (
                f"engine {engine} tok/s, HF {hf} -> {_f(q['engine/hf_generate'])}x; "
                "constrained/unconstrained "
                f"{_f(q['constrained/unconstrained'])}; overlap/serial {_f(q['overlap/serial'])}"
            )
            out.append((f"3 {model} batch {b}", text))
    return out


def tier_lines(r: dict[str, Any]) -> list[tuple[str, str]]:
    if not _ok(r):
        return [("4 kv tier", _why(r))]
    out = []
    for ctx, row in r["contexts"].items():
        if not _ok(row):
            out.append((f"4 kv tier {ctx}", _why(row)))
            continue
        out.append((f"4 kv tier {ctx}", tier_line(row)))
    return out


def kernel_lines(r: dict[str, Any]) -> list[tuple[str, str]]:
    if not _ok(r):
        return [("5 attention kernel", _why(r))]
    out = []
    for key, row in r.items():
        if not key.startswith("batch_"):
            continue
        text = (
            f"max abs diff {row['max_abs_diff']:.3g} ({r['dtype']}); kernel {row['kernel_ms']:.3f} "
            f"ms vs gather {row['gather_ms']:.3f} ms -> {row['kernel_over_gather']:.2f}"
        )
        out.append((f"5 kernel {key.replace('_', ' ')} at {r['context']}", text))
    return out


def graph_lines(r: dict[str, Any]) -> list[tuple[str, str]]:
    if not _ok(r):
        return [("6 decode graphs", _why(r))]
    mode = r["graphs"]
    out = []
    for key, row in r.items():
        if key.startswith("batch_"):
            text = (
                f"same tokens {row['same_tokens']}; step {row[f'{mode}_step_ms']:.2f} ms "
                f"({mode}) vs {row['off_step_ms']:.2f} ms eager -> {row['graphs_over_eager']:.2f}"
            )
            out.append((f"6 graphs {key.replace('_', ' ')}", text))
    return out


def table(result: dict[str, Any]) -> str:
    env = result.get("environment", {})
    rows = [("device", ", ".join(f"{k} {v}" for k, v in env.items()))]
    rows.append(("1 cuda tests", cuda_line(result.get("1_cuda_tests", {}))))
    rows += equality_lines(result.get("2_greedy_equality", {}))
    rows += throughput_lines(result.get("3_throughput", {}))
    rows += tier_lines(result.get("4_kv_tier", {}))
    rows += kernel_lines(result.get("5_attention_kernel", {}))
    rows += graph_lines(result.get("6_decode_graphs", {}))
    out = result.get("7_outputs", {})
    rows.append(
        ("7 outputs", f"{out.get('json')}, {out.get('png')}, wall {out.get('wall_s', 0):.0f} s")
    )
    lines = ["| step | result |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Tokens/s per model and batch (log scale); offloaded / resident Quest per context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [2, 1]})
    groups = [
        (f"{model}\nbatch {b}", row)
        for model, m in (result.get("3_throughput") or {}).items()
        if _ok(m)
        for b, row in m["batches"].items()
    ]
    width = 0.8 / len(RUNS)
    for k, key in enumerate(RUNS):
        values = [row.get(key, {}).get("tokens_per_second", 0) for _, row in groups]
        xs = [i + (k - 1.5) * width for i in range(len(groups))]
        ax1.bar(xs, values, width, label=key.replace("_", " "))
    ax1.set_xticks(range(len(groups)), [g for g, _ in groups], fontsize=8)
    if groups:
        ax1.set_yscale("log")
    ax1.set_ylabel("output tokens / s")
    ax1.set_title("throughput: engine vs HF generate, constrained, overlap", fontsize=10)
    ax1.legend(fontsize=7)
    tier: dict[str, Any] = result.get("4_kv_tier") or {}
    contexts = [(c, row) for c, row in tier["contexts"].items() if _ok(row)] if _ok(tier) else []
    for j, key in enumerate(("hot_0x", "hot_1x")):
        xs = [i + (j - 0.5) * 0.4 for i in range(len(contexts))]
        ax2.bar(xs, [row[key]["step_ratio"] for _, row in contexts], 0.4, label=key)
    ax2.axhline(1.2, color="tab:red", ls="--", lw=0.8, label="target 1.2x")
    ax2.set_xticks(range(len(contexts)), [c for c, _ in contexts])
    ax2.set_xlabel("context (tokens)")
    ax2.set_title("Quest step: offloaded / resident", fontsize=10)
    ax2.legend(fontsize=7)
    env = result.get("environment", {})
    fig.suptitle(f"device check: {env.get('name', env.get('device'))}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tier_line(row: dict[str, Any]) -> str:
    """One context of step 4: resident step time, then each hot-set size against it."""
    parts = [f"resident {row['resident_step_ms']:.1f} ms"]
    for key in ("hot_1x", "hot_0x"):
        h = row[key]
        parts.append(
            f"{key}: {h['step_ratio']:.2f}x, {h['mib_per_step']:.1f} MiB/step, "
            f"{h['gb_per_s_over_step']:.1f} GB/s, same tokens {h['same_tokens']}"
        )
    return "; ".join(parts)
