"""Containment over HTTP: the trust boundary's classes (template, validation, body) sent by a
hostile tenant while a victim tenant streams, against the victim's stream alone.

Starts the service as `structserve serve` does (Ray on loopback, token auth; one ingress, the
default limits), then per case: the victim streams `--tokens` tokens alone, then again while the
hostile tenant keeps sending the case's request from `--senders` connections for the whole
stream, each at most `--rate` a second (2 x 5/s: the default tenant's 600 a minute), then alone
again; `--repeats` times. The `benign` row sends a plain `/tokenize` the same way: the price of
sharing two cores with any traffic at that rate; `benign_long_tool` a valid tool call whose
listing makes a prompt as long as the freezing tool's (its prefill is a step of seconds on a
CPU). The `slow_mask` rows send regexes whose masks cost seconds on the attacker's path, one
request at a time, each a new grammar (`SLOW_MASKS`). Reported per case: the victim's
inter-token gap p50 and p99 beside / alone (target: p99 <= 2), its time to first token beside /
alone, the hostile answers' statuses and their slowest answer, and whether `/healthz` stayed 200.

    .venv/bin/python benchmarks/containment.py --http [--tokens 64] [--repeats 2] [--rate 5]

Writes `benchmarks/results/containment_http.json`.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from hostile import FREEZER  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "SmolLM2-135M-Instruct"
KEYS = {"victim": "sk-bench-victim", "hostile": "sk-bench-hostile"}
ASK = [{"role": "user", "content": "Is the sky blue? Answer briefly."}]
LOOP = "{% for i in range(99999) %}{% endfor %}"
NESTED_LOOPS = {"chat_template": LOOP.replace("{% endfor %}", LOOP + "{% endfor %}", 1)}


def _chat(**extra: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 16, **extra}


def _tokenize(**extra: Any) -> tuple[str, dict[str, Any]]:
    return "/tokenize", {"model": MODEL, "messages": ASK, **extra}


# name -> (class, route, body)
PLAIN_TOOL = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(90)}}
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "benign": ("baseline", "/tokenize", {"model": MODEL, "prompt": "Is the sky blue?"}),
    # the tool's listing makes a prompt as long as the freezing one's (~1.4k tokens): what its
    # prefill costs the victim, validation aside
    "benign_long_tool": (
        "baseline",
        *_chat(
            max_tokens=48,
            tools=[{"type": "function", "function": {"name": "f", "parameters": PLAIN_TOOL}}],
            tool_choice="required",
        ),
    ),
    "own_template_chat": (
        "template",
        *_chat(chat_template_kwargs={"chat_template": "{{ 'hello ' * 6000000 }}"}),
    ),
    "own_template_tokenize": (
        "template",
        *_tokenize(chat_template_kwargs={"chat_template": "{{ 'hello ' * 6000000 }}"}),
    ),
    "nested_loop_template": ("template", *_tokenize(chat_template_kwargs=NESTED_LOOPS)),
    "template_tensors": ("template", *_tokenize(chat_template_kwargs={"return_tensors": "np"})),
    "freezing_schema": (
        "validation",
        *_chat(response_format={"type": "json_schema", "json_schema": {"schema": FREEZER}}),
    ),
    "freezing_tool_parameters": (
        "validation",
        *_chat(
            max_tokens=48,
            tools=[{"type": "function", "function": {"name": "f", "parameters": FREEZER}}],
            tool_choice="required",
        ),
    ),
    "110k_empty_messages": ("body", *_chat(messages=[{"role": "user", "content": ""}] * 110_000)),
    "deep_body": ("body", *_chat(metadata={"x": json.loads("[" * 600 + "]" * 600)})),
    "deep_schema_text": ("body", *_chat(guided_json='{"a":' * 900 + "1" + "}" * 900)),
    "surrogate_schema_text": ("body", *_chat(guided_json='{"enum": ["\\ud800"]}')),
}


def _letters(i: int) -> str:
    """A literal unique to request `i` (letters: digits would be counts, the same family)."""
    out = ""
    while True:
        i, r = divmod(i, 26)
        out += chr(ord("a") + r)
        if not i:
            return out


def _slow_mask(regex: Any, bias: bool = False) -> Any:
    """A slow-mask body per request `i` and the 'z' token's id (what `logit_bias` steers to)."""

    def body(i: int, z: int) -> dict[str, Any]:
        extra: dict[str, Any] = {"logit_bias": {str(z): 100}} if bias else {}
        return _chat(max_tokens=128, structured_outputs={"regex": regex(i)}, **extra)[1]

    return body


# The straggler the design warns of (masks of seconds on the attacker's path), sent one at a time
# by one tenant, each request a new grammar: other counts (the probe follows the family's slow
# text), and new families the probe's walk cannot reach (only the mask deadline stands there).
SLOW_MASKS: dict[str, Any] = {
    "deep_variants": _slow_mask(lambda i: f"([ab]\\n){{{12 + i}}}(.?){{0,1000}}"),
    "rare_steered_variants": _slow_mask(
        lambda i: f"(c[a-y ]{{0,40}}|zqxjv(.?){{{i % 50},1000}})", bias=True
    ),
    "deep_new_families": _slow_mask(lambda i: f"{_letters(i)}([ab]\\n){{40}}(.?){{0,1000}}"),
}


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def victim_stream(url: str, tokens: int) -> tuple[float, list[float]]:
    """(time to first token, inter-token gaps) of one streamed chat of the victim tenant."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about lighthouses."}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {KEYS['victim']}"}
    start, arrivals = time.perf_counter(), []
    with requests.post(
        f"{url}/v1/chat/completions", json=body, headers=headers, stream=True, timeout=300
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: {") and b'"content"' in line:
                arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(arrivals[1:])]  # the first token excluded
    return arrivals[0] - start, gaps


class Hostile:
    """`senders` threads sending the case's request until stopped; statuses and answer times."""

    def __init__(
        self, url: str, route: str, body: dict[str, Any] | Any, senders: int, rate: float
    ) -> None:
        """`body`: the request, or a function of the request's number making each one."""
        self.url, self.route = url, route
        raw = json.dumps(body).encode() if not callable(body) else b""
        self.body = body if callable(body) else (lambda i: raw)
        self.sent = itertools.count()
        self.period = 1.0 / rate
        self.stop = threading.Event()
        self.statuses: Counter[int] = Counter()
        self.slowest = 0.0
        self.threads = [threading.Thread(target=self._send, daemon=True) for _ in range(senders)]

    def _send(self) -> None:
        headers = {"Authorization": f"Bearer {KEYS['hostile']}", "Content-Type": "application/json"}
        while not self.stop.is_set():
            start = time.perf_counter()
            raw = self.body(next(self.sent))
            raw = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
            try:
                r = requests.post(f"{self.url}{self.route}", data=raw, headers=headers, timeout=300)
                status = r.status_code
            except requests.RequestException:
                status = -1
            self.statuses[status] += 1
            took = time.perf_counter() - start
            self.slowest = max(self.slowest, took)
            self.stop.wait(max(0.0, self.period - took))

    def __enter__(self) -> Hostile:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(300)


def health_watch(url: str, stop: threading.Event, seen: Counter[int]) -> None:
    while not stop.is_set():
        try:
            seen[requests.get(f"{url}/healthz", timeout=10).status_code] += 1
        except requests.RequestException:
            seen[-1] += 1
        stop.wait(0.5)


def _token_id(url: str, text: str) -> int:
    headers = {"Authorization": f"Bearer {KEYS['victim']}"}
    body = {"model": MODEL, "prompt": text}
    r = requests.post(f"{url}/tokenize", json=body, headers=headers, timeout=60)
    r.raise_for_status()
    return int(r.json()["tokens"][-1])  # after a start token, where the tokenizer adds one


def warm_up(url: str) -> None:
    """What the first structured request of a fresh service starts (compile workers, validation
    workers in the replica and the ingress) starts here, not beside the first case's victim."""
    victim_stream(url, 8)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    headers = {"Authorization": f"Bearer {KEYS['victim']}"}
    for extra in (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
        {"tools": [tool], "tool_choice": "required"},
    ):
        _, body = _chat(max_tokens=16, **extra)
        url_ = f"{url}/v1/chat/completions"
        requests.post(url_, json=body, headers=headers, timeout=300).raise_for_status()


def deploy(port: int) -> str:
    import redis

    from deployments import local_ray

    local_ray.environment()  # before ray is imported
    from ray import serve

    from deployments.app import build_app
    from deployments.cli import wait_healthy
    from deployments.service_config import (
        IngressConfig,
        ServiceConfig,
        TenantConfig,
        TenantLimits,
    )
    from deployments.tenants import digest

    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0").rsplit("/", 1)[0] + "/8"
    redis.Redis.from_url(redis_url).flushdb()
    os.environ.setdefault("STRUCTSERVE_VERDICT_SECRET", "bench-verdict-secret-0123456789")
    local_ray.start(log_to_driver=False)
    serve.start(proxy_location="Disabled")  # the ingress answers on its own port
    hostile = TenantLimits(requests_per_minute=1_000_000, max_concurrent=8, max_tokens=256)
    cfg = ServiceConfig(
        redis_url=redis_url,
        ingress=IngressConfig(port=port),
        tenants=[
            TenantConfig(name="victim", api_key_sha256=[digest(KEYS["victim"])]),
            TenantConfig(name="hostile", api_key_sha256=[digest(KEYS["hostile"])], limits=hostile),
        ],
    )
    serve.run(build_app(cfg), name="bench", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    if not wait_healthy(url, 600):
        raise SystemExit("the service did not become healthy")
    return url


def run(
    tokens: int, repeats: int, senders: int, rate: float, wanted: set[str], port: int = 8012
) -> None:
    url = deploy(port)
    warm_up(url)
    z = _token_id(url, "z")
    cases = {name: (group, route, body, senders) for name, (group, route, body) in CASES.items()}
    for name, make in SLOW_MASKS.items():  # one request at a time
        cases[name] = ("slow_mask", "/v1/chat/completions", lambda i, m=make: m(i, z), 1)
    rows = []
    for name, (group, route, body, senders) in cases.items():
        if wanted and name not in wanted:
            continue
        alone: list[float] = []
        beside: list[float] = []
        ttft_alone: list[float] = []
        ttft_beside: list[float] = []
        health: Counter[int] = Counter()
        statuses: Counter[int] = Counter()
        slowest = 0.0
        for _ in range(repeats):
            t, g = victim_stream(url, tokens)
            ttft_alone.append(t)
            alone += g
            stop = threading.Event()
            watch = threading.Thread(target=health_watch, args=(url, stop, health), daemon=True)
            watch.start()
            with Hostile(url, route, body, senders, rate) as hostile:
                time.sleep(0.3)  # the hostile requests are in flight when the victim starts
                t, g = victim_stream(url, tokens)
            stop.set()
            watch.join(30)
            ttft_beside.append(t)
            beside += g
            statuses.update(hostile.statuses)
            slowest = max(slowest, hostile.slowest)
            t, g = victim_stream(url, tokens)
            ttft_alone.append(t)
            alone += g
        row = {
            "case": name,
            "group": group,
            "p50_ratio": statistics.median(beside) / statistics.median(alone),
            "p99_ratio": p99(beside) / p99(alone),
            "ttft_ratio": statistics.median(ttft_beside) / statistics.median(ttft_alone),
            "alone_p99_ms": 1000 * p99(alone),
            "beside_p99_ms": 1000 * p99(beside),
            "ttft_alone_s": ttft_alone,
            "ttft_beside_s": ttft_beside,
            "hostile_statuses": dict(statuses),
            "hostile_slowest_s": slowest,
            "healthz": dict(health),
        }
        rows.append(row)
        print(
            f"{group:10s} {name:26s} p50 {row['p50_ratio']:.2f}x  p99 {row['p99_ratio']:.2f}x  "
            f"ttft {row['ttft_ratio']:.2f}x  hostile {dict(statuses)} (slowest {slowest:.1f} s)  "
            f"healthz {dict(health)}",
            flush=True,
        )
    worst = max(rows, key=lambda r: r["p99_ratio"])
    print(f"worst p99 ratio: {worst['p99_ratio']:.2f} ({worst['case']}); target <= 2")
    RESULTS.mkdir(exist_ok=True)
    out = {"tokens": tokens, "repeats": repeats, "senders": senders, "rate": rate, "rows": rows}
    (RESULTS / "containment_http.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS / 'containment_http.json'}")
