"""Prefix caching over HTTP: what a shared system prompt costs with the cache and without, and
where two replicas' requests land with prefix-affinity routing and with Ray's default.

Starts the service (Ray Serve on this machine, loopback only) once per configuration and sends
chat requests with the real `openai` client (streamed, usage included). Every request carries a
~1,500-token system prompt (instructions, a tool list and a JSON schema, as extraction agents
send them) and a short distinct user turn, and asks for JSON by that schema (`response_format`).

1. One replica, 64 requests at concurrency 8, prefix caching on and off
   (`enable_prefix_caching`): time to first token p50/p99, output tokens/s, the share of prompt
   tokens served from the cache (`usage.prompt_tokens_details.cached_tokens`). Target: TTFT p50
   with the cache <= 0.3x without. Then isolation: tenant A's prompt cold, A's again, tenant B's
   same prompt (B must not hit: its TTFT stays cold), A's with another `cache_salt`.
2. Two replicas, each with a KV pool that holds about 5 of the 8 distinct system prompts sent
   (8 "applications" interleaved at random): the cache hit rate with `prefix_affinity` routing
   against `power_of_two` (Ray's default). With affinity each replica sees about half of the
   prompts, so its working set fits; with random routing each sees all 8 and they evict each other.

Writes `benchmarks/results/prefix_cache.json` and `prefix_cache.png`.

    .venv/bin/python benchmarks/prefix_cache.py [--requests 64] [--concurrency 8] [--parts 1,2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.measure import pct  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "SmolLM2-135M-Instruct"
KEYS = {"a": "sk-bench-prefix-a", "b": "sk-bench-prefix-b"}
PAGE_BYTES = 2 * 30 * 3 * 64 * 4 * 16  # SmolLM2 in float32: one 16-token page
SCHEMA = {
    "type": "object",
    "properties": {
        "vendor": {"type": "string", "maxLength": 40},
        "total": {"type": "number"},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
    },
    "required": ["vendor", "total", "currency"],
    "additionalProperties": False,
}
TOOLS = [
    ("lookup_vendor", "Find a vendor by name in the ledger and return its id and country."),
    ("convert_currency", "Convert an amount between two ISO currencies at today's rate."),
    ("flag_invoice", "Mark an invoice for human review, with a short reason."),
    ("fetch_purchase_order", "Return the purchase order an invoice refers to, by number."),
]


def system_prompt(app: int, tokens: int = 1500) -> str:
    """About `tokens` tokens of instructions, tools and schema, distinct per application."""
    rules = [
        f"Rule {i} of application {app}: when the invoice mentions item {i * 7 + app}, check the "
        f"quantity against the purchase order, keep amounts in the invoice currency, and never "
        f"invent a vendor that the document does not name."
        for i in range(tokens // 52)
    ]
    tools = "\n".join(f"- {name}: {doc}" for name, doc in TOOLS)
    return (
        f"You are invoice extractor number {app}.\n"
        + "\n".join(rules)
        + f"\nTools you may call:\n{tools}\nReply with JSON following this schema:\n"
        + json.dumps(SCHEMA)
    )


def user_turn(i: int) -> str:
    return f"Invoice {i}: ACME Tools Ltd, {i % 9 + 1} hammers, total {17.5 * (i % 13 + 1):.2f} EUR."


async def one(client: Any, system: str, user: str, salt: str | None = None) -> dict[str, Any]:
    start = time.perf_counter()
    first = None
    usage = None
    extra: dict[str, Any] = {"cache_salt": salt} if salt else {}
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        response_format={"type": "json_schema", "json_schema": {"name": "inv", "schema": SCHEMA}},
        extra_body=extra,
    )
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None
    details = usage.prompt_tokens_details
    return {
        "ttft_s": first if first is not None else time.perf_counter() - start,
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": (details.cached_tokens or 0) if details else 0,
        "completion_tokens": usage.completion_tokens,
    }


async def workload(url: str, jobs: list[tuple[str, str]], concurrency: int) -> dict[str, Any]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["a"], max_retries=0, timeout=600)
    queue = list(enumerate(jobs))
    results: list[dict[str, Any]] = []

    async def worker() -> None:
        while queue:
            _, (system, user) = queue.pop(0)
            results.append(await one(client, system, user))
            if len(results) % 16 == 0:
                print(f"  {len(results)}/{len(jobs)} requests", flush=True)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    ttft = [r["ttft_s"] for r in results]
    prompt = sum(r["prompt_tokens"] for r in results)
    return {
        "requests": len(results),
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p99_s": pct(ttft, 0.99),
        "output_tokens_per_s": sum(r["completion_tokens"] for r in results) / wall,
        "wall_s": wall,
        "prompt_tokens": prompt,
        "hit_rate": sum(r["cached_tokens"] for r in results) / max(1, prompt),
    }


async def isolation(url: str) -> dict[str, Any]:
    from openai import AsyncOpenAI

    a = AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["a"], max_retries=0, timeout=600)
    b = AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["b"], max_retries=0, timeout=600)
    system = system_prompt(99)
    out = {}
    for name, client, salt in (
        ("a_cold", a, None),
        ("a_warm", a, None),
        ("b_same_prompt", b, None),
        ("a_other_salt", a, "private"),
    ):
        r = await one(client, system, user_turn(1), salt)
        out[name] = {"ttft_s": r["ttft_s"], "cached_tokens": r["cached_tokens"]}
    return out


def deploy(port: int, caching: bool, replicas: int, pool_pages: int, routing: str) -> str:
    import redis
    from ray import serve

    from deployments.app import build_app
    from deployments.cli import wait_healthy
    from deployments.service_config import (
        IngressConfig,
        LLMConfig,
        RoutingConfig,
        ServiceConfig,
        TenantConfig,
        TenantLimits,
    )
    from deployments.tenants import digest

    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0").rsplit("/", 1)[0] + "/8"
    redis.Redis.from_url(redis_url).flushdb()
    wide = TenantLimits(requests_per_minute=1_000_000, max_concurrent=64, max_tokens=512)
    engine = {
        "kv_cache_memory": pool_pages * PAGE_BYTES,
        "max_num_seqs": 16,
        "enable_prefix_caching": caching,
    }
    cfg = ServiceConfig(
        redis_url=redis_url,
        ingress=IngressConfig(port=port, max_ongoing_requests=256),
        llm=LLMConfig(num_replicas=replicas, engine=engine, routing=RoutingConfig(policy=routing)),
        tenants=[
            TenantConfig(name=t, api_key_sha256=[digest(k)], limits=wide) for t, k in KEYS.items()
        ],
    )
    serve.run(build_app(cfg), name="bench", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    if not wait_healthy(url, 600):
        raise SystemExit("the service did not become healthy")
    return url


def run(
    args: argparse.Namespace,
    caching: bool,
    replicas: int,
    pool: int,
    routing: str,
    jobs: list[tuple[str, str]],
) -> dict[str, Any]:
    from ray import serve

    label = f"caching={caching} replicas={replicas} routing={routing}"
    print(f"{label}: deploying...", flush=True)
    url = deploy(args.port, caching, replicas, pool, routing)
    asyncio.run(workload(url, [(system_prompt(1000), user_turn(0))], 1))  # warm-up: compile
    print(f"{label}: {len(jobs)} requests at concurrency {args.concurrency}", flush=True)
    out = asyncio.run(workload(url, jobs, args.concurrency))
    if caching and replicas == 1:
        out["isolation"] = asyncio.run(isolation(url))
    serve.delete("bench")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--parts", default="1,2")
    p.add_argument("--port", type=int, default=8012)
    args = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("STRUCTSERVE_VERDICT_SECRET", "bench-verdict-secret-0123456789")
    import ray
    from ray import serve

    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    serve.start(proxy_location="Disabled")  # the ingress answers on its own port
    out: dict[str, Any] = {"requests": args.requests, "concurrency": args.concurrency}
    parts = args.parts.split(",")
    if "1" in parts:
        jobs = [(system_prompt(0), user_turn(i)) for i in range(args.requests)]
        out["cache_on"] = run(args, True, 1, 1024, "prefix_affinity", jobs)
        out["cache_off"] = run(args, False, 1, 1024, "prefix_affinity", jobs)
        on, off = out["cache_on"], out["cache_off"]
        out["ttft_p50_ratio"] = on["ttft_p50_s"] / off["ttft_p50_s"]
        print(
            f"\nTTFT p50 {on['ttft_p50_s']:.2f} s with the cache, {off['ttft_p50_s']:.2f} s "
            f"without: {out['ttft_p50_ratio']:.2f}x (target <= 0.3); p99 {on['ttft_p99_s']:.2f} "
            f"/ {off['ttft_p99_s']:.2f} s; output tokens/s {on['output_tokens_per_s']:.1f} / "
            f"{off['output_tokens_per_s']:.1f}; hit rate {on['hit_rate']:.2f}"
        )
        for name, r in on["isolation"].items():
            print(f"  {name:14} TTFT {r['ttft_s']:.2f} s, cached tokens {r['cached_tokens']}")
    if "2" in parts:
        rng = random.Random(0)
        apps = [rng.randrange(8) for _ in range(args.requests)]
        jobs = [(system_prompt(a + 1), user_turn(i)) for i, a in enumerate(apps)]
        pool = 5 * 100 + 32  # ~5 system prompts of ~95 pages, and room for the running requests
        for routing in ("prefix_affinity", "power_of_two"):
            out[f"two_replicas_{routing}"] = run(args, True, 2, pool, routing, jobs)
        aff, pow2 = out["two_replicas_prefix_affinity"], out["two_replicas_power_of_two"]
        print(
            f"\ntwo replicas, 8 system prompts: hit rate {aff['hit_rate']:.2f} with prefix "
            f"affinity, {pow2['hit_rate']:.2f} with Ray's default; TTFT p50 "
            f"{aff['ttft_p50_s']:.2f} / {pow2['ttft_p50_s']:.2f} s"
        )
    serve.shutdown()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prefix_cache.json").write_text(json.dumps(out, indent=2) + "\n")
    plot(out)


def plot(out: dict[str, Any]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    runs = [k for k in ("cache_off", "cache_on") if k in out]
    runs += [k for k in out if k.startswith("two_replicas_")]
    if not runs:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = [k.replace("two_replicas_", "2 replicas\n") for k in runs]
    left.bar(names, [out[k]["ttft_p50_s"] for k in runs], label="p50")
    left.scatter(names, [out[k]["ttft_p99_s"] for k in runs], color="black", label="p99", zorder=3)
    left.set_ylabel("time to first token (s)")
    left.legend()
    right.bar(names, [out[k]["hit_rate"] for k in runs])
    right.set_ylabel("prompt tokens served from the cache")
    right.set_ylim(0, 1)
    fig.suptitle("1,500-token shared system prompt, concurrency 8")
    fig.tight_layout()
    fig.savefig(RESULTS / "prefix_cache.png", dpi=120)


if __name__ == "__main__":
    main()
