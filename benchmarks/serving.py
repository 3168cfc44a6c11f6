"""Serving: the HTTP service under load vs the same workload on the in-process engine.

Starts the service (Ray Serve on this machine, loopback only) unless `--url` is given, then for
each concurrency level sends a bounded number of streaming chat requests, half of them constrained
by a JSON schema, and measures time to first token, inter-token latency (p50/p99), request
throughput and 429s. The same requests then run through `AsyncLLM` in this process at the same
concurrency: the ratio is the serving overhead (HTTP, Ray handles, SSE).

`--telemetry off` serves with traces and metrics disabled; `--telemetry both` measures the service
with telemetry on (every request traced, spans kept in-process, metrics pushed to /metrics) and
off, alternating `--repeats` times, and prints the overhead (on / off) per level.

Its tool-calling workload (`tool_choice="required"` over 4 tools, tokens/s beside JSON-schema
output) is `benchmarks/tool_calls.py`, on the same service set-up.

    .venv/bin/python benchmarks/serving.py [--levels 1,8,32] [--max-tokens 32]
    .venv/bin/python benchmarks/serving.py --telemetry both --levels 1,8 --no-engine
    .venv/bin/python benchmarks/serving.py --engine-process both   # the two twins, one run
    .venv/bin/python benchmarks/serving.py --listener both   # own listener and Ray's proxy

`--listener`: how HTTP reaches the ingress (ingress.listener): `own` (the default: the ingress
replica answers on the port), `proxy` (Ray Serve's proxy, the plain twin), `both` (one deployment
answering on both: the proxy one port up; each level measured on each in turn).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.measure import pct  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KEY = os.environ.get("STRUCTSERVE_API_KEY", "sk-bench")  # --url: that service's key
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "year": {"type": "integer"}},
    "required": ["city", "year"],
}
TOPICS = ["a river", "a city", "a train", "the sea", "a mountain", "a library", "winter", "a cat"]


def workload(n: int) -> list[dict[str, Any]]:
    reqs = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": f"Tell me about {topic}."}],
            "constrained": i % 2 == 1,
        }
        reqs.append(body)
    return reqs


class Latencies:
    """Time to first chunk and gaps between chunks, over every request of a level."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.chunks = 0

    def stream(self) -> Callable[[], None]:
        """Starts one request's clock; call the result at each content chunk."""
        start = last = time.perf_counter()
        first = True

        def chunk() -> None:
            nonlocal last, first
            now = time.perf_counter()
            if first:
                self.ttft.append(now - start)
            else:
                self.itl.append(now - last)
            first, last = False, now
            self.chunks += 1

        return chunk


async def sse_events(response: Any) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an OpenAI-style SSE stream (an aiohttp response), `[DONE]` left out."""
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


async def http_level(url: str, reqs: list[dict], concurrency: int, max_tokens: int) -> dict:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    lat, statuses = Latencies(), []

    async def one(session: aiohttp.ClientSession, req: dict) -> None:
        body: dict[str, Any] = {
            "model": "SmolLM2-135M-Instruct",
            "messages": req["messages"],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": not req["constrained"],
            "stream": True,
        }
        if req["constrained"]:
            body["response_format"] = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
        async with sem:
            tick = lat.stream()
            headers = {"Authorization": f"Bearer {KEY}"}
            async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
                statuses.append(r.status)
                if r.status != 200:
                    return
                async for chunk in sse_events(r):
                    if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                        tick()

    start = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(session, r) for r in reqs))
    wall = time.perf_counter() - start
    return summary(lat, wall, len(reqs), statuses)


async def engine_level(llm: Any, reqs: list[dict], concurrency: int, max_tokens: int) -> dict:
    from services import SamplingParams, StructuredOutput

    sem = asyncio.Semaphore(concurrency)
    lat = Latencies()

    async def one(req: dict) -> None:
        structured = StructuredOutput(json_schema=SCHEMA) if req["constrained"] else None
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0,
            ignore_eos=not req["constrained"],
            structured=structured,
        )
        async with sem:
            prompt = llm.engine.apply_chat_template(req["messages"])
            tick = lat.stream()
            async for out in llm.add_request(prompt, params):
                if out.delta_text:
                    tick()

    start = time.perf_counter()
    await asyncio.gather(*(one(r) for r in reqs))
    wall = time.perf_counter() - start
    return summary(lat, wall, len(reqs), [200] * len(reqs))


def summary(lat: Latencies, wall: float, n: int, statuses: list[int]) -> dict:
    ttft, itl = lat.ttft, lat.itl
    return {
        "requests": n,
        "seconds": wall,
        "requests_per_s": n / wall,
        "chunks_per_s": lat.chunks / wall,
        "ttft_p50_ms": pct(ttft, 0.5) * 1e3,
        "ttft_p99_ms": pct(ttft, 0.99) * 1e3,
        "itl_p50_ms": pct(itl, 0.5) * 1e3,
        "itl_p99_ms": pct(itl, 0.99) * 1e3,
        "status_429": statuses.count(429),
        "status_other": sum(1 for s in statuses if s not in (200, 429)),
    }


def start_service(port: int, listener: str = "own") -> None:
    """Ray and Serve; Ray's proxy only where `listener` asks for it (`both`: one port up)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["STRUCTSERVE_API_KEY"] = KEY
    import ray
    from ray import serve

    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    if listener == "own":
        serve.start(proxy_location="Disabled")
    else:
        serve.start(http_options={"host": "127.0.0.1", "port": port + (listener == "both")})


def deploy(
    telemetry: bool,
    engine_process: bool = True,
    threads: int | None = None,
    port: int = 8321,
    listener: str = "own",
) -> None:
    """(Re)deploys the service, with telemetry on (sampling every request) or off, the engine
    core in a process of its own or on a replica thread, on `threads` torch threads (None: the
    CPUs the replica may use), answering on `port` (its own listener, unless `listener` is
    "proxy")."""
    from ray import serve

    from deployments.app import build_app
    from deployments.service_config import (
        GrammarServiceConfig,
        IngressConfig,
        LLMConfig,
        ServiceConfig,
        TelemetryConfig,
    )

    cfg = ServiceConfig(
        llm=LLMConfig(
            engine={"kv_cache_memory": 512 << 20, "num_threads": threads},
            max_ongoing_requests=64,
            engine_process=engine_process,
        ),
        grammar=GrammarServiceConfig(workers=1),
        telemetry=TelemetryConfig(enabled=telemetry, sampling_ratio=1.0),
        ingress=IngressConfig(port=port, listener="proxy" if listener == "proxy" else "own"),
    )
    if "bench" in serve.status().applications:
        serve.delete("bench")  # a fresh set of replicas: no state carried between modes
    serve.run(build_app(cfg), name="bench", route_prefix="/", blocking=False)


def http_levels(url: str, levels: list[int], plan: dict, max_tokens: int, tag: str) -> dict:
    from deployments.cli import wait_healthy

    if not wait_healthy(url):
        raise SystemExit("the service did not become healthy")
    asyncio.run(http_level(url, workload(2), 2, 4))  # warm-up: compiles the schema, loads paths
    out = {}
    for c in levels:
        out[c] = asyncio.run(http_level(url, plan[c], c, max_tokens))
        print(f"http {tag:<4} c={c:<3} {json.dumps(out[c])}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--levels", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=0, help="per level (default 2x level, >= 8)")
    p.add_argument("--url", help="an already running service (its key in STRUCTSERVE_API_KEY)")
    p.add_argument("--port", type=int, default=8321)
    p.add_argument(
        "--telemetry",
        choices=["on", "off", "both"],
        default="on",
        help="the service's traces and metrics; both: measure each, print on/off",
    )
    p.add_argument("--repeats", type=int, default=1, help="rounds (with a both)")
    p.add_argument("--no-engine", action="store_true", help="skip the in-process engine peer")
    p.add_argument(
        "--engine-process",
        choices=["on", "off", "both"],
        default="on",
        help="llm.engine_process: the engine core in its own process; both: each twin in turn",
    )
    p.add_argument("--engine-threads", type=int, help="engine.num_threads (default: every CPU)")
    p.add_argument("--listener", choices=["own", "proxy", "both"], default="own")
    args = p.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    url = args.url or f"http://127.0.0.1:{args.port}"
    plan = {c: workload(args.requests or max(8, 2 * c)) for c in levels}
    modes = ["on", "off"] if args.telemetry == "both" else [args.telemetry]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    cores: list[dict] = []  # with --engine-process both: the core process twin's runs
    proxied: list[dict] = []  # with --listener both: through Ray's proxy
    if args.url:  # someone else's service: its own telemetry setting
        runs[modes[0]].append(http_levels(url, levels, plan, args.max_tokens, "url"))
    else:
        start_service(args.port, args.listener)
        twins = ["off", "on"] if args.engine_process == "both" else [args.engine_process]
        rounds = args.repeats if len(modes) > 1 or args.listener == "both" else 1
        for i in range(rounds):
            for mode in modes:
                for twin in twins:
                    on = (mode == "on", twin == "on")
                    deploy(*on, args.engine_threads, args.port, args.listener)
                    tag = mode if len(twins) == 1 else f"core={twin}"
                    if args.listener == "both":  # A B B A
                        proxy_url = f"http://127.0.0.1:{args.port + 1}"
                        for way in ("own", "proxy") if i % 2 == 0 else ("proxy", "own"):
                            at = url if way == "own" else proxy_url
                            result = http_levels(at, levels, plan, args.max_tokens, way)
                            (runs[mode] if way == "own" else proxied).append(result)
                        continue
                    result = http_levels(url, levels, plan, args.max_tokens, tag)
                    (runs[mode] if twin == twins[0] else cores).append(result)
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    http = {c: best(run[c] for run in runs[modes[0]]) for c in levels}
    if len(modes) > 1:
        telemetry_report(levels, runs, args)
    if args.no_engine:
        return

    from services.engine.async_llm import AsyncLLM
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine

    llm = AsyncLLM(LLMEngine(EngineConfig(kv_cache_memory=512 << 20)))

    async def offline() -> dict:
        await engine_level(llm, workload(2), 2, 4)
        out = {}
        for c in levels:
            out[c] = await engine_level(llm, plan[c], c, args.max_tokens)
            print(f"engine c={c:<3} {json.dumps(out[c])}", flush=True)
        return out

    engine = asyncio.run(offline())
    llm.shutdown()
    report(levels, http, engine, args)
    if proxied:
        print("\nthrough Ray Serve's proxy (ingress.listener=proxy):")
        report(levels, {c: best(r[c] for r in proxied) for c in levels}, engine, args, "_proxy")
    if cores:
        print("\nthe engine core in its own process (llm.engine_process=true):")
        report(levels, {c: best(r[c] for r in cores) for c in levels}, engine, args, "_core")


def best(results: Any) -> dict:
    """Of repeated runs of one level, the one with the highest throughput (the least noise)."""
    return max(results, key=lambda r: r["requests_per_s"])


def telemetry_report(levels: list[int], runs: dict, args: argparse.Namespace) -> None:
    rows = []
    print(
        "\n| concurrency | req/s on | req/s off | on/off | TTFT p50 ms on/off | ITL p50 ms on/off |"
    )
    print("|---|---|---|---|---|---|")
    for c in levels:
        on, off = best(r[c] for r in runs["on"]), best(r[c] for r in runs["off"])
        ratio = on["requests_per_s"] / off["requests_per_s"]
        rows.append({"concurrency": c, "on": on, "off": off, "on_over_off": ratio})
        print(
            f"| {c} | {on['requests_per_s']:.2f} | {off['requests_per_s']:.2f} | {ratio:.3f} | "
            f"{on['ttft_p50_ms']:.0f}/{off['ttft_p50_ms']:.0f} | "
            f"{on['itl_p50_ms']:.1f}/{off['itl_p50_ms']:.1f} |"
        )
    RESULTS.mkdir(exist_ok=True)
    out = {"max_tokens": args.max_tokens, "repeats": args.repeats, "levels": rows}
    (RESULTS / "serving_telemetry.json").write_text(json.dumps(out, indent=2))


def report(
    levels: list[int], http: dict, engine: dict, args: argparse.Namespace, suffix: str = ""
) -> None:
    rows = []
    print(
        "\n| concurrency | HTTP req/s | engine req/s | HTTP/engine | TTFT p50/p99 ms (HTTP) "
        "| ITL p50/p99 ms (HTTP) | TTFT p50 ms (engine) | 429s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for c in levels:
        h, e = http[c], engine[c]
        ratio = h["requests_per_s"] / e["requests_per_s"]
        rows.append({"concurrency": c, "http": h, "engine": e, "http_over_engine": ratio})
        print(
            f"| {c} | {h['requests_per_s']:.2f} | {e['requests_per_s']:.2f} | {ratio:.2f} | "
            f"{h['ttft_p50_ms']:.0f}/{h['ttft_p99_ms']:.0f} | "
            f"{h['itl_p50_ms']:.0f}/{h['itl_p99_ms']:.0f} | {e['ttft_p50_ms']:.0f} | "
            f"{h['status_429']} |"
        )
    RESULTS.mkdir(exist_ok=True)
    out = {"max_tokens": args.max_tokens, "levels": rows}
    (RESULTS / f"serving{suffix}.json").write_text(json.dumps(out, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(levels, [http[c]["requests_per_s"] for c in levels], "o-", label="HTTP service")
    ax.plot(levels, [engine[c]["requests_per_s"] for c in levels], "s-", label="in-process engine")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("requests / s")
    ax.set_title(f"Serving overhead ({args.max_tokens} tokens, half JSON-constrained)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"serving{suffix}.png", dpi=120)


if __name__ == "__main__":
    main()
