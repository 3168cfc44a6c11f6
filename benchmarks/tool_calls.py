"""Tool calling under load beside plain JSON-schema output, through the HTTP service.

Two workloads on the same service, streamed, greedy, at each concurrency level, interleaved level
by level so the machine's noise hits both alike:
- `json`: `response_format` with a JSON schema (the serving benchmark's);
- `tools`: `tool_choice="required"` over 4 tools (the structural tag of `deployments/tools.py`).
Reports output tokens per second (from each stream's usage), request throughput and the share of
answers whose calls (or JSON) validated. Writes `benchmarks/results/tool_calls.json`.

    .venv/bin/python benchmarks/tool_calls.py [--levels 1,4,8] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving import KEY, RESULTS, SCHEMA, TOPICS, deploy, sse_events, start_service


def _fn(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties, "required": list(properties)}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


STR, INT, NUM = {"type": "string"}, {"type": "integer"}, {"type": "number"}
TOOLS = [
    _fn("get_weather", "Current weather in a city", {"city": STR}),
    _fn("search_books", "Books on a topic", {"topic": STR, "limit": INT}),
    _fn("convert", "Convert an amount", {"amount": NUM, "to": STR}),
    _fn("book_train", "Book a train", {"origin": STR, "destination": STR}),
]


def body(kind: str, i: int, max_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": f"Help me with {TOPICS[i % len(TOPICS)]}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if kind == "tools":
        out |= {"tools": TOOLS, "tool_choice": "required"}
    else:
        out["response_format"] = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    return out


async def level(url: str, kind: str, n: int, concurrency: int, max_tokens: int) -> dict:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    tokens, validated, statuses = [0], [0], []

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        async with sem:
            headers = {"Authorization": f"Bearer {KEY}"}
            payload = body(kind, i, max_tokens)
            post = session.post(f"{url}/v1/chat/completions", json=payload, headers=headers)
            async with post as r:
                statuses.append(r.status)
                async for chunk in sse_events(r):
                    if chunk.get("usage"):
                        tokens[0] += chunk["usage"]["completion_tokens"]
                    if chunk.get("structserve", {}).get("validated"):
                        validated[0] += 1

    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        await asyncio.gather(*(one(session, i) for i in range(n)))
    wall = time.perf_counter() - start
    return {
        "requests": n,
        "seconds": wall,
        "tokens_per_s": tokens[0] / wall,
        "requests_per_s": n / wall,
        "validated": validated[0] / n,
        "non_200": sum(1 for s in statuses if s != 200),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--levels", default="1,4,8")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--requests", type=int, default=0, help="per level (default 2x level, >= 8)")
    p.add_argument("--port", type=int, default=8322)
    args = p.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    url = f"http://127.0.0.1:{args.port}"
    start_service(args.port)
    deploy(telemetry=False, port=args.port)
    from deployments.cli import wait_healthy

    if not wait_healthy(url):
        raise SystemExit("the service did not become healthy")
    for kind in ("json", "tools"):  # warm-up: compiles both grammars
        asyncio.run(level(url, kind, 2, 2, 8))
    rows = []
    for c in levels:
        n = args.requests or max(8, 2 * c)
        row: dict[str, Any] = {"concurrency": c}
        for kind in ("json", "tools"):
            row[kind] = asyncio.run(level(url, kind, n, c, args.max_tokens))
            print(f"c={c:<3} {kind:<5} {json.dumps(row[kind])}", flush=True)
        row["tools_over_json"] = row["tools"]["tokens_per_s"] / row["json"]["tokens_per_s"]
        rows.append(row)
    print("\n| concurrency | JSON tok/s | tools tok/s | tools/JSON | validated JSON / tools |")
    print("|---|---|---|---|---|")
    for r in rows:
        j, t = r["json"], r["tools"]
        print(
            f"| {r['concurrency']} | {j['tokens_per_s']:.1f} | {t['tokens_per_s']:.1f} | "
            f"{r['tools_over_json']:.2f} | {j['validated']:.2f} / {t['validated']:.2f} |"
        )
    RESULTS.mkdir(exist_ok=True)
    out = {"max_tokens": args.max_tokens, "levels": rows}
    (RESULTS / "tool_calls.json").write_text(json.dumps(out, indent=2))
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
