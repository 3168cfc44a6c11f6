"""The Batch API against the same lines sent online, and what a running batch costs an
interactive tenant.

Starts the service (Ray Serve on this machine, loopback only, its own Redis database) and uses the
real `openai` client.

1. `--lines` extraction lines (5 JSON schemas, one shared instruction as the system prompt, a
   short distinct document each, greedy) through the Batch API (`files.create`,
   `batches.create`, polled to completion), then the same lines sent online as chat requests at
   concurrency `--concurrency`. Throughput = lines / wall time; target batch / online >= 1.0.
   Grammar compiles during the batch (the `structserve_grammar_compile_seconds` count on
   /metrics) per distinct schema: target 1.
2. An interactive tenant's time to first token (streamed, `--probes` requests, two at a time)
   alone, then while a batch of `--lines` runs (from its first finished line: its grammars
   compiled, its lines decoding): target p99 with / alone <= 1.3.

Writes `benchmarks/results/batch.json`.

    .venv/bin/python benchmarks/batch.py [--lines 1000] [--concurrency 32] [--probes 100]
        [--parts throughput,ttft] [--batch-rows N] [--batch-prefill N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.measure import pct  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "SmolLM2-135M-Instruct"
KEYS = {"pipeline": "sk-bench-batch-pipeline", "chat": "sk-bench-batch-chat"}
INSTRUCTION = (
    "You extract structured records from business documents. Read the document, find every "
    "field the schema asks for, copy names exactly as written, and answer with JSON only. "
) * 4


def _obj(**props: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


S = {"type": "string", "maxLength": 24}
SCHEMAS = {
    "invoice": _obj(vendor=S, total={"type": "number"}, currency={"enum": ["EUR", "USD"]}),
    "contact": _obj(name=S, email=S),
    "event": _obj(title=S, day={"type": "integer", "minimum": 1, "maximum": 31}),
    "product": _obj(name=S, in_stock={"type": "boolean"}),
    "address": _obj(street=S, city=S),
}


def document(i: int, kind: str) -> str:
    return f"Document {i} ({kind}): ACME Trading {i % 97}, Rue {i % 13} Lyon, 12{i % 10}.50 EUR."


def body(i: int) -> dict[str, Any]:
    kind = list(SCHEMAS)[i % len(SCHEMAS)]
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": INSTRUCTION},
            {"role": "user", "content": document(i, kind)},
        ],
        "max_tokens": 48,
        "temperature": 0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": kind, "schema": SCHEMAS[kind]},
        },
    }


def compiles(url: str) -> float:
    import requests

    text = requests.get(f"{url}/metrics", timeout=30).text
    rows = [
        x for x in text.splitlines() if x.startswith("structserve_grammar_compile_seconds_count")
    ]
    return sum(float(x.rsplit(" ", 1)[1]) for x in rows)


def deploy(port: int, batch_rows: int | None, batch_prefill: int | None) -> str:
    import redis
    from ray import serve

    from deployments.app import build_app
    from deployments.cli import wait_healthy
    from deployments.service_config import (
        BatchesConfig,
        FilesConfig,
        IngressConfig,
        LLMConfig,
        ServiceConfig,
        TenantConfig,
        TenantLimits,
    )
    from deployments.tenants import digest

    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0").rsplit("/", 1)[0] + "/9"
    redis.Redis.from_url(redis_url).flushdb()
    wide = TenantLimits(requests_per_minute=1_000_000, max_concurrent=64, max_tokens=512)
    cfg = ServiceConfig(
        redis_url=redis_url,
        ingress=IngressConfig(port=port, max_ongoing_requests=256),
        llm=LLMConfig(
            engine={
                "kv_cache_memory": 1 << 30,
                "max_num_seqs": 32,
                "batch_rows_beside": batch_rows,
                "batch_prefill_tokens": batch_prefill,
            }
        ),
        batches=BatchesConfig(concurrency=32),
        files=FilesConfig(store=str(RESULTS / "batch-files")),
        tenants=[
            TenantConfig(name=t, api_key_sha256=[digest(k)], limits=wide) for t, k in KEYS.items()
        ],
    )
    serve.run(build_app(cfg), name="bench", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    if not wait_healthy(url, 600):
        raise SystemExit("the service did not become healthy")
    return url


def start_batch(url: str, n: int, offset: int = 0) -> tuple[Any, str]:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS["pipeline"], timeout=300)
    lines = [
        {"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions", "body": body(i)}
        for i in range(offset, offset + n)
    ]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    upload = client.files.create(file=("lines.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return client, batch.id


def wait_batch(client: Any, batch_id: str) -> Any:
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        counts = batch.request_counts
        print(f"  batch: {batch.status} {counts.completed}/{counts.total}", flush=True)
        time.sleep(5)


async def online(url: str, n: int, concurrency: int) -> float:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["pipeline"], timeout=300)
    todo = list(range(n))
    failures = 0

    async def worker() -> None:
        nonlocal failures
        while todo:
            i = todo.pop()
            try:
                await client.chat.completions.create(**body(i))
            except Exception:
                failures += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    if failures:
        print(f"  online: {failures} failures")
    return time.perf_counter() - start


async def probes(url: str, n: int) -> list[float]:
    """Streamed chat requests of the interactive tenant, two at a time: their TTFTs."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["chat"], timeout=300)
    ttfts: list[float] = []
    todo = list(range(n))

    async def worker() -> None:
        while todo:
            i = todo.pop()
            start = time.perf_counter()
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Give me a tip about topic {i}."}],
                max_tokens=16,
                stream=True,
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    ttfts.append(time.perf_counter() - start)
                    break
            await stream.close()
            await asyncio.sleep(0.2)

    await asyncio.gather(worker(), worker())
    return ttfts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lines", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--probes", type=int, default=100)  # p99 of fewer is the maximum
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--batch-rows", type=int, default=None, help="batch_rows_beside (32: no cap, the twin)"
    )
    p.add_argument("--batch-prefill", type=int, default=None, help="batch_prefill_tokens")
    p.add_argument(
        "--parts",
        default="throughput,ttft",
        help="throughput and/or ttft; batch: the batch's time alone",
    )
    args = p.parse_args()
    parts = set(args.parts.split(","))

    from deployments import local_ray

    os.environ.setdefault("STRUCTSERVE_VERDICT_SECRET", "bench-verdict-secret-0123456789")
    local_ray.environment()
    local_ray.start(num_cpus=2, log_to_driver=False)
    from ray import serve

    serve.start(proxy_location="Disabled")  # the ingress answers on its own port
    url = deploy(args.port, args.batch_rows, args.batch_prefill)
    out: dict[str, Any] = {"args": vars(args)}
    asyncio.run(probes(url, 4))  # warm-up

    if "throughput" in parts:
        out.update(throughput(url, args, online_too=True))
    elif "batch" in parts:  # the Batch API's part alone
        out.update(throughput(url, args, online_too=False))
    if "ttft" in parts:
        out["ttft_s"] = ttft(url, args)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "batch.json").write_text(json.dumps(out, indent=2))
    serve.delete("bench")


def throughput(url: str, args: argparse.Namespace, online_too: bool) -> dict[str, Any]:
    print(f"1. {args.lines} lines through the Batch API", flush=True)
    before = compiles(url)
    start = time.perf_counter()
    client, batch_id = start_batch(url, args.lines)
    batch = wait_batch(client, batch_id)
    batch_s = time.perf_counter() - start
    per_schema = (compiles(url) - before) / len(SCHEMAS)
    counts = batch.request_counts
    print(f"  {batch.status}: {counts.completed} ok, {counts.failed} failed in {batch_s:.1f} s")
    if not online_too:
        return {"batch_s": batch_s, "compiles_per_schema": per_schema}
    print(f"2. the same lines online at concurrency {args.concurrency}", flush=True)
    online_s = asyncio.run(online(url, args.lines, args.concurrency))
    ratio = online_s / batch_s
    print(
        f"throughput: batch {args.lines / batch_s:.2f} lines/s, online "
        f"{args.lines / online_s:.2f} req/s: batch / online = {ratio:.2f} (target >= 1.0); "
        f"compiles per schema during the batch: {per_schema:.1f} (target 1)"
    )
    return {
        "throughput": {"batch_s": batch_s, "online_s": online_s, "ratio": ratio},
        "compiles_per_schema": per_schema,
        "counts": counts.model_dump(),
    }


def ttft(url: str, args: argparse.Namespace) -> dict[str, Any]:
    print(f"3. the interactive tenant's TTFT alone, then beside a batch of {args.lines}")
    alone = asyncio.run(probes(url, args.probes))
    client, batch_id = start_batch(url, args.lines, offset=args.lines)
    while not client.batches.retrieve(batch_id).request_counts.completed:
        time.sleep(0.5)  # under way: its grammars compiled, its lines decoding
    beside = asyncio.run(probes(url, args.probes))
    client.batches.cancel(batch_id)
    wait_batch(client, batch_id)
    p99 = pct(beside, 0.99) / pct(alone, 0.99)
    print(
        f"TTFT p50/p99 alone {pct(alone, 0.5) * 1000:.0f}/{pct(alone, 0.99) * 1000:.0f} ms, "
        f"beside the batch {pct(beside, 0.5) * 1000:.0f}/{pct(beside, 0.99) * 1000:.0f} ms: "
        f"p99 ratio {p99:.2f} (target <= 1.3)"
    )
    return {"alone": alone, "beside": beside, "p99_ratio": p99}


if __name__ == "__main__":
    main()
