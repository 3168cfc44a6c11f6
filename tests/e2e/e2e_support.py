"""Shared pieces of the end-to-end suite: the test tenants' keys (the service only ever sees their
sha256) and helpers to configure and wait for a deployment."""

from __future__ import annotations

import os
import socket

import pytest

from deployments import cli
from deployments.config import GrammarServiceConfig, LLMConfig, ServiceConfig

KEY_A, KEY_B, KEY_SLOW = "sk-test-tenant-a", "sk-test-tenant-b", "sk-test-limited"
KEY_ONE = "sk-test-one-at-a-time"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_url(db: int) -> str:
    base = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    return base.rsplit("/", 1)[0] + f"/{db}" if base.count("/") > 2 else f"{base}/{db}"


def wait_healthy(url: str, timeout_s: float = 300) -> None:
    if not cli.wait_healthy(url, timeout_s):
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
