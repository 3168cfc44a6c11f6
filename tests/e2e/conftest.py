"""One Ray session and one HTTP proxy for the whole end-to-end suite; the main application is
deployed once (replicas take no CPUs, so everything fits on 2 cores)."""

from __future__ import annotations

import os

import pytest
from e2e_support import (
    KEY_A,
    KEY_B,
    KEY_FUZZ,
    KEY_GREEDY,
    KEY_ONE,
    KEY_SLOW,
    KEY_STEADY,
    METRICS_TOKEN,
    OtlpReceiver,
    free_port,
    redis_url,
    small_config,
    wait_healthy,
)

from deployments import local_ray
from deployments.service_config import (
    AdaptersConfig,
    BatchesConfig,
    FilesConfig,
    GrammarServiceConfig,
    IngressConfig,
    TelemetryConfig,
    TenantConfig,
    TenantLimits,
)
from deployments.tenants import digest
from services.batches.files import FileCaps
from services.lora.registry import AdapterCaps

# Ray as `structserve serve` runs it (listeners on loopback, token auth on): set before any test
# module imports ray, which reads its auth mode on import
local_ray.environment()


@pytest.fixture(scope="session")
def proxy():
    """The Ray session and Serve's HTTP proxy: (base URL, serve module). Ray starts as
    `structserve serve` starts it: its listeners on loopback, token auth on."""
    import ray
    from ray import serve

    # Ray's processes inherit the environment at ray.init; this process gets its own back after,
    # so the tests that follow in it see no metrics token
    before = os.environ.get("STRUCTSERVE_METRICS_TOKEN")
    os.environ["STRUCTSERVE_METRICS_TOKEN"] = METRICS_TOKEN
    local_ray.start(num_cpus=2, object_store_memory=200 << 20, log_to_driver=False)
    if before is None:
        del os.environ["STRUCTSERVE_METRICS_TOKEN"]
    else:
        os.environ["STRUCTSERVE_METRICS_TOKEN"] = before
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}", serve
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def otlp():
    """Where the main application sends its spans (OTLP over HTTP)."""
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="session")
def adapter_store(tmp_path_factory):
    """The main application's LoRA adapter store (the tests write their adapters into it)."""
    return tmp_path_factory.mktemp("adapter-store")


@pytest.fixture(scope="session")
def server(proxy, otlp, adapter_store):
    """The main application, on its own listener (the default: both ingress replicas answer on one
    port; Ray's proxy routes "/" to it too, the plain twin): two ingress replicas (tenant limits
    must hold for the service) and two grammar-service replicas (so `/metrics` must add up
    several), spans exported to the `otlp` receiver; LoRA on (two adapters a step), tenants'
    adapters from `adapter_store`."""
    import dataclasses

    import redis

    from deployments.app import build_app

    _, serve = proxy
    own_port = free_port()
    redis.Redis.from_url(redis_url(11)).flushdb()
    llm = small_config().llm
    engine = dataclasses.replace(llm.engine, enable_lora=True, max_loras=2, max_cpu_loras=4)
    cfg = small_config(
        llm=llm.model_copy(update={"engine": engine}),
        adapters=AdaptersConfig(store=str(adapter_store), caps=AdapterCaps(max_adapters=3)),
        batches=BatchesConfig(concurrency=4, lease_s=3),
        files=FilesConfig(
            store=str(adapter_store.parent / "files"), caps=FileCaps(max_file_bytes=1 << 20)
        ),
        redis_url=redis_url(11),
        ingress=IngressConfig(num_replicas=2, body_timeout_s=3.0, port=own_port),
        # two workers each: one is kept for tenants with no compile running
        grammar=GrammarServiceConfig(workers=2, deadline_s=5.0, num_replicas=2),
        # tenant labels on: the observability tests follow each tenant's series (the default is off)
        telemetry=TelemetryConfig(
            otlp_endpoint=otlp.url, export_interval_s=1.0, tenant_labels=True
        ),
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
            TenantConfig(
                name="tenant-fuzz",
                api_key_sha256=[digest(KEY_FUZZ)],
                limits=TenantLimits(requests_per_minute=100_000, max_concurrent=4, max_tokens=8),
            ),
            TenantConfig(
                name="tenant-greedy",
                api_key_sha256=[digest(KEY_GREEDY)],
                limits=TenantLimits(requests_per_minute=100_000, max_concurrent=32, max_tokens=16),
            ),
            TenantConfig(name="tenant-steady", api_key_sha256=[digest(KEY_STEADY)]),
        ],
    )
    serve.run(build_app(cfg), name="structserve", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{own_port}"
    wait_healthy(base)
    return base
