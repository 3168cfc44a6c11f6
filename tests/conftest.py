from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# compile verdicts in Redis are signed (grammar_registry/cache.py); Ray's workers inherit it
os.environ.setdefault("STRUCTSERVE_VERDICT_SECRET", "structserve-test-verdict-secret")

import torch  # it does not import triton; transformers and xgrammar do

if not torch.cuda.is_available():
    # Triton kernels (kvcache/triton_attention.py) run here through Triton's interpreter, which
    # must be on before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from services.models import LoadedModel, load_model


@pytest.fixture(scope="session")
def loaded_model() -> LoadedModel:
    """The real default model (SmolLM2-135M-Instruct), loaded once for the whole run."""
    return load_model()


@pytest.fixture(scope="session")
def tokenizer(loaded_model: LoadedModel):  # type: ignore[no-untyped-def]
    return loaded_model.tokenizer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):  # type: ignore[no-untyped-def]
    """Starts private redis-server processes (for tests that kill one): `start() -> (url, proc)`.
    Skips when the binary is missing; every process started is killed at the end."""
    import shutil
    import socket
    import subprocess
    import time

    import redis

    if shutil.which("redis-server") is None:
        pytest.skip("needs the redis-server binary")
    procs: list[subprocess.Popen] = []

    def start() -> tuple[str, subprocess.Popen]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        proc = subprocess.Popen(
            ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
            cwd=tmp_path_factory.mktemp("redis"),
            stdout=subprocess.DEVNULL,
        )
        procs.append(proc)
        client = redis.Redis(port=port)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        return f"redis://127.0.0.1:{port}/0", proc

    yield start
    for proc in procs:
        proc.kill()
