"""One Ray session and one HTTP proxy for the whole end-to-end suite; the main application is
deployed once (replicas take no CPUs, so everything fits on 2 cores)."""

from __future__ import annotations

import os
import socket
import time

import pytest
import requests
from e2e_keys import KEY_A, KEY_B, KEY_ONE, KEY_SLOW

from deployments.config import (
    GrammarServiceConfig,
    LLMConfig,
    ServiceConfig,
    TenantConfig,
    TenantLimits,
)
from deployments.tenants import digest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_url(db: int) -> str:
    base = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    return base.rsplit("/", 1)[0] + f"/{db}" if base.count("/") > 2 else f"{base}/{db}"


def wait_healthy(url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/healthz", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    pytest.fail(f"{url} did not become healthy in {timeout_s:.0f} s")


def small_config(**overrides) -> ServiceConfig:
    base = {
        "llm": LLMConfig(
            engine={"kv_cache_memory": 128 << 20, "max_num_seqs": 16},
            max_ongoing_requests=8,
            max_queued_requests=4,
        ),
        "grammar": GrammarServiceConfig(workers=1, deadline_s=5.0),
    }
    return ServiceConfig(**{**base, **overrides})


@pytest.fixture(scope="session")
def proxy():
    """The Ray session and Serve's HTTP proxy: (base URL, serve module)."""
    import ray
    from ray import serve

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        include_dashboard=False,
        num_cpus=2,
        object_store_memory=200 << 20,
        log_to_driver=False,
        configure_logging=False,
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}", serve
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def server(proxy):
    import redis

    from deployments.app import build_app

    base, serve = proxy
    redis.Redis.from_url(redis_url(11)).flushdb()
    cfg = small_config(
        redis_url=redis_url(11),
        tenants=[
            TenantConfig(name="tenant-a", api_key_sha256=[digest(KEY_A)]),
            TenantConfig(name="tenant-b", api_key_sha256=[digest(KEY_B)]),
            TenantConfig(
                name="tenant-limited",
                api_key_sha256=[digest(KEY_SLOW)],
                limits=TenantLimits(requests_per_minute=3, max_concurrent=1, max_tokens=64),
            ),
            TenantConfig(
                name="tenant-one",
                api_key_sha256=[digest(KEY_ONE)],
                limits=TenantLimits(max_concurrent=1),
            ),
        ],
    )
    serve.run(build_app(cfg), name="structserve", route_prefix="/", blocking=False)
    wait_healthy(base)
    return base
