"""Fair shares over HTTP: a steady tenant's time to first token while a greedy one abuses the
service, and the tokens two backlogged tenants get against their weights.

Starts the service (Ray Serve on this machine, loopback only; two ingress replicas, limits in the
Redis at `REDIS_URL`), then runs each pattern for `--seconds`: the greedy tenant A abuses the
service in one way while the steady tenant B sends one streaming request after another, every
other one with a JSON schema it has not sent before (so each needs a compile). Reported per
pattern: B's TTFT p50 and p99 divided by B's alone (target: p99 <= 2), B's errors and 429s, and
what A got (statuses). Then two tenants of weights 1 and 2 keep more streams open than the batch
has slots, and their shares of the tokens made are set against 1/3 and 2/3.

Patterns of A: n=16 floods; slow bodies (headers sent, the body never finished, up to A's
concurrency); abort storms (streams dropped before and just after their first byte); slow
grammars (fresh schemas that take long to compile); deadline grammars (schemas over the compile
deadline, whose workers are killed and restarted); oversized grammars (fresh schemas over the
static limits, ~350 KB each: refused at the ingress). Writes `benchmarks/results/fair_http.json`
(with B's p50 and p99 for its plain and its schema requests apart, `b_ttft_by_kind_s`).

    .venv/bin/python benchmarks/fair_http.py [--seconds 30] [--patterns n16,slow_bodies,...]
    .venv/bin/python benchmarks/fair_http.py --engine-process both   # both twins, one run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.measure import pct  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "SmolLM2-135M-Instruct"
KEYS = {"greedy": "sk-bench-greedy", "steady": "sk-bench-steady", "heavy": "sk-bench-heavy"}
PATTERNS = (
    "n16",
    "slow_bodies",
    "abort_storm",
    "slow_grammars",
    "deadline_grammars",
    "oversized_grammars",
)
DEADLINE_S = 2.0  # the compile deadline of this deployment


def fresh_schema(tag: str, fields: int) -> dict[str, Any]:
    """A schema nobody sent before (its property names carry `tag`): a compile, not a hit."""
    props = {f"{tag}_{i}": {"type": "string", "maxLength": 8} for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props)}


def slow_schema(tag: str) -> dict[str, Any]:
    """Fresh and slow to compile: many optional properties of nested shapes."""
    item = {
        "type": "object",
        "properties": {f"k{j}": {"type": ["string", "integer", "null"]} for j in range(12)},
    }
    props = {f"{tag}_{i}": {"type": "array", "items": item, "maxItems": 4} for i in range(40)}
    return {"type": "object", "properties": props}


def deadline_schema(tag: str) -> dict[str, Any]:
    """Fresh, within the static limits, and past the compile deadline (about 7 s to compile on 2
    cores): a worker is killed for each one."""
    words = {"type": "string", "pattern": "[a-z]{1,999}"}
    one = [
        {"type": "object", "properties": {f"{tag}_{i}": words}, "required": [f"{tag}_{i}"]}
        for i in range(60)
    ]
    names = ["p0", "p1", "p2"]
    return {"type": "object", "properties": {n: {"anyOf": one} for n in names}, "required": names}


def oversized_schema(tag: str) -> dict[str, Any]:
    """Over the static limits (160 branches of 24-field objects, ~350 KB): refused (400)."""
    item = {
        "type": "object",
        "properties": {f"k{j}": {"type": ["string", "integer", "null"]} for j in range(24)},
    }
    props = {f"{tag}_{i}": {"anyOf": [item, {"type": "array", "items": item}]} for i in range(160)}
    return {"type": "object", "properties": props, "anyOf": [{"required": [k]} for k in props]}


class Steady:
    """Tenant B: one streaming request after another, TTFT of each."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.kinds: dict[str, list[float]] = {"plain": [], "schema": []}
        self.statuses: Counter[int] = Counter()
        self.sent = 0

    async def run(self, session: Any, url: str, until: float) -> None:
        while time.monotonic() < until:
            self.sent += 1
            body: dict[str, Any] = {
                "model": MODEL,
                "prompt": "Name a colour:",
                "max_tokens": 8,
                "temperature": 0,
                "stream": True,
            }
            if self.sent % 2 == 0:
                schema = fresh_schema(f"b{self.sent}_{int(until)}", 2)
                body["structured_outputs"] = {"json": schema}
            start = time.perf_counter()
            headers = {"Authorization": f"Bearer {KEYS['steady']}"}
            async with session.post(f"{url}/v1/completions", json=body, headers=headers) as r:
                self.statuses[r.status] += 1
                if r.status != 200:
                    await r.read()
                    continue
                first = None
                async for raw in r.content:
                    line = raw.decode().strip()
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter() - start
                if first is not None:
                    self.ttft.append(first)
                    self.kinds["schema" if "structured_outputs" in body else "plain"].append(first)


async def greedy(pattern: str, session: Any, url: str, until: float, got: Counter[Any]) -> None:
    """Tenant A, abusing the service in one way until `until`; `got` counts its statuses."""
    headers = {"Authorization": f"Bearer {KEYS['greedy']}"}
    seq = 0

    async def post(body: dict[str, Any], hang_up: bool = False) -> None:
        try:
            async with session.post(f"{url}/v1/completions", json=body, headers=headers) as r:
                got[r.status] += 1
                if hang_up:
                    return  # the connection is dropped with the stream running
                await r.read()
        except Exception as exc:  # a dropped connection is the point of some patterns
            got[type(exc).__name__] += 1

    async def loop(make: Any, hang_up: bool = False) -> None:
        nonlocal seq
        while time.monotonic() < until:
            seq += 1
            await post(make(seq), hang_up)

    base = {"model": MODEL, "prompt": "Count:", "temperature": 0}
    if pattern == "n16":
        flood = {**base, "n": 16, "max_tokens": 48, "ignore_eos": True}
        await asyncio.gather(*(loop(lambda _: flood) for _ in range(2)))
    elif pattern == "slow_bodies":
        await asyncio.gather(*(slow_body(url, until, got) for _ in range(32)))
    elif pattern == "abort_storm":
        stream = {**base, "max_tokens": 512, "stream": True, "ignore_eos": True}
        await asyncio.gather(*(loop(lambda _: stream, hang_up=True) for _ in range(8)))
    elif pattern in ("slow_grammars", "deadline_grammars", "oversized_grammars"):
        schema = {
            "slow_grammars": slow_schema,
            "deadline_grammars": deadline_schema,
            "oversized_grammars": oversized_schema,
        }[pattern]
        tag = f"a{int(until)}"

        def constrained(i: int) -> dict[str, Any]:
            return {**base, "max_tokens": 8, "structured_outputs": {"json": schema(f"{tag}_{i}")}}

        await asyncio.gather(*(loop(constrained) for _ in range(6)))


async def slow_body(url: str, until: float, got: Counter[Any]) -> None:
    """Headers and half a body, then nothing: the ingress answers 408 at its body deadline."""
    host, port = url.removeprefix("http://").split(":")
    while time.monotonic() < until:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            (
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                f"Authorization: Bearer {KEYS['greedy']}\r\nContent-Type: application/json\r\n"
                f'Content-Length: 400\r\n\r\n{{"model": "{MODEL}", "prompt": "Hi'
            ).encode()
        )
        await writer.drain()
        try:
            line = await asyncio.wait_for(reader.readline(), max(0.1, until - time.monotonic()))
            got[int(line.split()[1]) if line else 0] += 1
        except TimeoutError:
            got["open at the end"] += 1
        writer.close()


async def pattern_run(url: str, pattern: str | None, seconds: float) -> dict[str, Any]:
    import aiohttp

    until = time.monotonic() + seconds
    b, got = Steady(), Counter()
    timeout = aiohttp.ClientTimeout(total=600)
    async with (
        aiohttp.ClientSession(timeout=timeout) as sb,
        aiohttp.ClientSession(timeout=timeout) as sa,
    ):
        tasks = [b.run(sb, url, until)]
        if pattern is not None:
            tasks.append(greedy(pattern, sa, url, until, got))
        await asyncio.gather(*tasks)
    return {
        "b_requests": b.sent,
        "b_statuses": dict(b.statuses),
        "b_ttft_p50_s": pct(b.ttft, 0.5),
        "b_ttft_p99_s": pct(b.ttft, 0.99),
        "b_ttft_by_kind_s": {k: [pct(v, 0.5), pct(v, 0.99)] for k, v in b.kinds.items()},
        "a_statuses": {str(k): v for k, v in got.items()},
    }


async def weights_run(url: str, seconds: float) -> dict[str, Any]:
    """Tenants of weights 1 (greedy) and 2 (heavy), each with 16 streams open (32 > the batch's
    16 slots): the tokens each one receives during the window."""
    import aiohttp

    until = time.monotonic() + seconds
    tokens: Counter[str] = Counter()
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 64, "ignore_eos": True}
    body |= {"stream": True, "temperature": 0}

    async def stream(session: Any, tenant: str) -> None:
        headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
        while time.monotonic() < until:
            async with session.post(f"{url}/v1/completions", json=body, headers=headers) as r:
                async for raw in r.content:
                    if raw.startswith(b"data: {") and time.monotonic() < until:
                        tokens[tenant] += 1  # one token per event without a grammar

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*(stream(s, t) for t in ("greedy", "heavy") for _ in range(16)))
    total = sum(tokens.values()) or 1
    return {
        "tokens": dict(tokens),
        "share_weight_1": tokens["greedy"] / total,
        "share_weight_2": tokens["heavy"] / total,
    }


def deploy(port: int, engine_process: bool = True) -> str:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    import redis
    from ray import serve

    from deployments.app import build_app
    from deployments.cli import wait_healthy
    from deployments.service_config import (
        GrammarServiceConfig,
        IngressConfig,
        LLMConfig,
        ServiceConfig,
        TenantConfig,
        TenantLimits,
    )
    from deployments.tenants import digest

    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0").rsplit("/", 1)[0] + "/9"
    redis.Redis.from_url(redis_url).flushdb()
    os.environ.setdefault("STRUCTSERVE_VERDICT_SECRET", "bench-verdict-secret-0123456789")
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
        serve.start(proxy_location="Disabled")  # the ingress answers on its own port
    if "bench" in serve.status().applications:
        serve.delete("bench")  # a fresh set of replicas for each twin
    wide = TenantLimits(requests_per_minute=1_000_000, max_concurrent=32, max_tokens=512)
    cfg = ServiceConfig(
        redis_url=redis_url,
        ingress=IngressConfig(
            port=port, num_replicas=2, body_timeout_s=5.0, max_ongoing_requests=256
        ),
        llm=LLMConfig(
            engine={"kv_cache_memory": 512 << 20, "max_num_seqs": 16},
            engine_process=engine_process,
        ),
        grammar=GrammarServiceConfig(workers=2, deadline_s=DEADLINE_S),
        tenants=[
            TenantConfig(name="greedy", api_key_sha256=[digest(KEYS["greedy"])], limits=wide),
            TenantConfig(name="steady", api_key_sha256=[digest(KEYS["steady"])]),
            TenantConfig(
                name="heavy", api_key_sha256=[digest(KEYS["heavy"])], limits=wide, weight=2
            ),
        ],
    )
    serve.run(build_app(cfg), name="bench", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    if not wait_healthy(url, 600):
        raise SystemExit("the service did not become healthy")
    return url


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=30.0, help="per pattern")
    p.add_argument("--patterns", default=",".join(PATTERNS))
    p.add_argument("--port", type=int, default=8011)
    p.add_argument(
        "--engine-process",
        choices=["on", "off", "both"],
        default="on",
        help="llm.engine_process: the engine core in its own process; both: each twin in turn",
    )
    args = p.parse_args()
    twins = ["off", "on"] if args.engine_process == "both" else [args.engine_process]
    everything = {}
    for twin in twins:
        print(f"llm.engine_process={twin == 'on'}", flush=True)
        everything[f"engine_process_{twin}"] = one_twin(args, twin == "on")
    RESULTS.mkdir(exist_ok=True)
    name = "fair_http.json" if len(twins) == 1 else "fair_http_twins.json"
    (RESULTS / name).write_text(json.dumps(everything, indent=2) + "\n")


def one_twin(args: argparse.Namespace, engine_process: bool) -> dict[str, Any]:
    url = deploy(args.port, engine_process)
    asyncio.run(pattern_run(url, None, 5.0))  # warm-up: the first compile, the first forward
    out: dict[str, Any] = {"seconds": args.seconds}
    print(f"B alone for {args.seconds:g} s...", flush=True)
    alone = out["alone"] = asyncio.run(pattern_run(url, None, args.seconds))
    rows = []
    for pattern in args.patterns.split(","):
        print(f"A: {pattern} for {args.seconds:g} s...", flush=True)
        r = out[pattern] = asyncio.run(pattern_run(url, pattern, args.seconds))
        r["p50_ratio"] = r["b_ttft_p50_s"] / alone["b_ttft_p50_s"]
        r["p99_ratio"] = r["b_ttft_p99_s"] / alone["b_ttft_p99_s"]
        rows.append((pattern, r))
    print(f"weights 1 and 2, both backlogged, for {args.seconds:g} s...", flush=True)
    out["weights"] = asyncio.run(weights_run(url, args.seconds))
    print(
        f"\nB alone: TTFT p50 {alone['b_ttft_p50_s'] * 1e3:.0f} ms, "
        f"p99 {alone['b_ttft_p99_s'] * 1e3:.0f} ms, {alone['b_requests']} requests"
    )
    print(f"{'pattern of A':18} {'B p50':>7} {'B p99':>7} {'B reqs':>7} {'B non-200':>10}  A got")
    for name, r in rows:
        bad = {k: v for k, v in r["b_statuses"].items() if k != 200}
        print(
            f"{name:18} {r['p50_ratio']:7.2f} {r['p99_ratio']:7.2f} {r['b_requests']:7d} "
            f"{sum(bad.values()):10d}  {r['a_statuses']}"
        )
    w = out["weights"]
    print(
        f"tokens by weight: weight 1 {w['share_weight_1']:.2f} (1/3 expected), "
        f"weight 2 {w['share_weight_2']:.2f} (2/3 expected); {w['tokens']}"
    )
    return out


if __name__ == "__main__":
    main()
