"""`structserve serve`: starts Ray locally, deploys the application, prints the URL and a key.
`structserve keys`: API keys kept in Redis, added and revoked while the service runs.

    structserve serve [--model DIR] [--port 8000] [--redis-url URL] [--api-key KEY] [--config F]
    structserve keys add TENANT [--key KEY] | keys revoke KEY_OR_SHA256 | keys list

Without `--redis-url` it uses `REDIS_URL` when set, else an in-process cache (registrations then
live as long as the service). Without any configured key it makes one for the default tenant, and
without `STRUCTSERVE_METRICS_TOKEN` a token for `/metrics` (both printed). A revoked key is refused
from the next request on, by every ingress replica. Ray's own listeners stay on loopback, behind a
token of this run (deployments/local_ray.py); `--host` moves the HTTP service only.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from deployments.service_config import ServiceConfig
from services import settings
from services.dialects import DIALECTS

LOCAL_REDIS = "redis://127.0.0.1:6379/0"


def load_config(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        return dict(yaml.safe_load(text) or {})
    return dict(json.loads(text))


def wait_healthy(url: str, timeout_s: float = 600) -> bool:
    """Polls `url/healthz` until it answers 200 (True) or `timeout_s` passes (False)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    return False


def build_config(args: argparse.Namespace) -> ServiceConfig:
    raw = load_config(args.config)
    if args.model:
        raw["model"] = args.model
    raw["redis_url"] = args.redis_url or raw.get("redis_url") or settings.redis_url()
    llm = dict(raw.get("llm", {}))
    for name in ("tool_call_format", "reasoning_format"):
        if getattr(args, name, None):
            llm[name] = getattr(args, name)
    if getattr(args, "engine_process", None) is not None:
        llm["engine_process"] = args.engine_process
    lora(args, raw, llm)
    raw["llm"] = llm
    ingress = dict(raw.get("ingress", {}))
    ingress.update({"port": args.port or ingress.get("port", 8000), "host": args.host})
    raw["ingress"] = ingress
    return ServiceConfig.model_validate(raw)


def lora(args: argparse.Namespace, raw: dict[str, Any], llm: dict[str, Any]) -> None:
    """vLLM's LoRA flags, into `llm.engine` and `adapters`."""
    engine = dict(llm.get("engine", {}))
    adapters = dict(raw.get("adapters", {}))
    if getattr(args, "lora_modules", None) or getattr(args, "adapter_store", None):
        engine["enable_lora"] = True
    for name in ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras"):
        if getattr(args, name, None):
            engine[name] = getattr(args, name)
    for item in getattr(args, "lora_modules", None) or []:
        name, sep, folder = item.partition("=")
        if not sep or not name or not folder:
            raise SystemExit(f"--lora-modules: {item!r} is not name=path")
        adapters.setdefault("modules", {})[name] = folder
    if getattr(args, "adapter_store", None):
        adapters["store"] = args.adapter_store
    if engine:
        llm["engine"] = engine
    if adapters:
        raw["adapters"] = adapters


def serve_command(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    key = args.api_key or settings.api_key()
    made_key = False
    if not key and not cfg.tenants and not cfg.api_keys_file:
        key, made_key = "sk-" + secrets.token_urlsafe(24), True
    if key:
        os.environ["STRUCTSERVE_API_KEY"] = key  # the builder reads the default tenant's key here
    # /metrics names tenants and their traffic: never anonymous (the replicas inherit it)
    metrics_token = settings.metrics_token()
    made_token = metrics_token is None
    if metrics_token is None:
        metrics_token = os.environ["STRUCTSERVE_METRICS_TOKEN"] = "mt-" + secrets.token_urlsafe(24)
    # Verdicts in Redis are signed; without a secret of the operator's, one for this run (the
    # replicas inherit it: set before Ray starts). A new one only means recompiles.
    os.environ.setdefault("STRUCTSERVE_VERDICT_SECRET", secrets.token_urlsafe(32))

    from deployments import local_ray

    local_ray.environment()  # before ray is imported: it reads its settings then
    import ray
    from ray import serve

    from deployments.app import build_app

    local_ray.start(log_to_driver=args.verbose)
    if cfg.ingress.listener == "own":  # the ingress replicas listen (deployments/listener.py)
        serve.start(proxy_location="Disabled")
    else:
        serve.start(http_options={"host": cfg.ingress.host, "port": cfg.ingress.port})
    print(f"structserve: deploying {cfg.served_model_name} (first start converts the model)...")
    serve.run(build_app(cfg), name="structserve", route_prefix="/", blocking=False)
    url = f"http://{cfg.ingress.host}:{cfg.ingress.port}"
    if not wait_healthy(url):
        print("structserve: the service did not become healthy; see Ray's logs (--verbose)")
    print(f"structserve: ready at {url}/v1 (OpenAI API)")
    if made_key:
        print(f"structserve: API key for the default tenant: {key}")
    if made_token:
        print(f"structserve: /metrics answers `Authorization: Bearer {metrics_token}`")
    body = {"model": cfg.served_model_name, "messages": [{"role": "user", "content": "Hi"}]}
    print(
        f"  curl {url}/v1/chat/completions -H 'Authorization: Bearer $KEY' "
        f"-H 'Content-Type: application/json' -d '{json.dumps(body)}'"
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print("structserve: shutting down (requests in flight finish first)...")
    serve.shutdown()
    ray.shutdown()
    return 0


def keys_command(args: argparse.Namespace) -> int:
    import redis

    from deployments.tenants import add_key, list_keys, revoke_key

    url = args.redis_url or settings.redis_url() or LOCAL_REDIS  # `make serve`'s default
    client = redis.Redis.from_url(url, socket_timeout=5.0)
    if args.action == "add":
        key = args.key or "sk-" + secrets.token_urlsafe(24)
        try:
            digest = add_key(client, args.tenant, key)
        except ValueError as exc:
            print(f"structserve keys: {exc}", file=sys.stderr)
            return 2
        print(f"{key}\t{args.tenant}\tsha256:{digest}")
    elif args.action == "revoke":
        if not revoke_key(client, args.key):
            print("structserve keys: no such key", file=sys.stderr)
            return 1
        print("revoked")
    else:
        for digest, tenant in list_keys(client):
            print(f"sha256:{digest}\t{tenant}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="structserve", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the service on this machine")
    s.add_argument("--model", help="a local Hugging Face model folder (default: SmolLM2-135M)")
    s.add_argument("--port", type=int, default=None, help="HTTP port (default 8000)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    s.add_argument("--redis-url", help="Redis for the grammar cache and registrations")
    s.add_argument("--api-key", help="the default tenant's API key")
    s.add_argument("--config", help="a ServiceConfig as JSON or YAML")
    for what in ("tool-call", "reasoning"):
        help_ = f"the model's {what} dialect (default auto: read from its chat template)"
        s.add_argument(f"--{what}-format", choices=DIALECTS, help=help_)
    s.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run each replica's engine core in a process of its own (llm.engine_process)",
    )
    s.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    s.add_argument("--max-loras", type=int, help="adapters in one step (default 1)")
    s.add_argument("--max-lora-rank", type=int, help="the highest adapter rank (default 16)")
    s.add_argument("--max-cpu-loras", type=int, help="adapters parked in host memory")
    s.add_argument(
        "--lora-modules", nargs="+", metavar="NAME=PATH", help="adapters for every tenant"
    )
    store_help = "where tenants' adapters are registered from: a folder or s3://bucket/prefix"
    s.add_argument("--adapter-store", help=store_help)
    s.add_argument("--verbose", action="store_true", help="show Ray's logs")
    k = sub.add_parser("keys", help="add, revoke or list API keys kept in Redis")
    where = f"the service's Redis (default: REDIS_URL, else {LOCAL_REDIS})"
    k.add_argument("--redis-url", help=where)
    ks = k.add_subparsers(dest="action", required=True)
    add = ks.add_parser("add", help="a new key for TENANT (printed once; stored hashed)")
    add.add_argument("tenant")
    add.add_argument("--key", help="the key to store (default: a new random one)")
    rev = ks.add_parser("revoke", help="delete a key, by itself or its sha256 digest")
    rev.add_argument("key")
    ks.add_parser("list", help="every key's digest and tenant")
    args = p.parse_args(argv)
    return keys_command(args) if args.command == "keys" else serve_command(args)


if __name__ == "__main__":
    sys.exit(main())
