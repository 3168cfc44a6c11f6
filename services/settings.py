"""Environment variables, read in this one module; the rest of the code takes arguments."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models are kept: `STRUCTSERVE_CACHE_DIR`, else the XDG cache folder."""
    explicit = os.environ.get("STRUCTSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "structserve"


def force_offline() -> None:
    """Never reach a model hub: weights come from local folders or packages."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def default_model() -> str | None:
    return os.environ.get("STRUCTSERVE_MODEL") or None


def api_key() -> str | None:
    """The default tenant's API key (`STRUCTSERVE_API_KEY`), if one is set."""
    return os.environ.get("STRUCTSERVE_API_KEY") or None


def metrics_token() -> str | None:
    """`STRUCTSERVE_METRICS_TOKEN`: when set, `/metrics` answers only `Bearer <token>`."""
    return os.environ.get("STRUCTSERVE_METRICS_TOKEN") or None


def verdict_secret() -> str | None:
    """`STRUCTSERVE_VERDICT_SECRET`: the key that signs compile verdicts kept in Redis (every
    process sharing that Redis needs the same one; the chart generates it)."""
    return os.environ.get("STRUCTSERVE_VERDICT_SECRET") or None


def redis_url() -> str | None:
    """`REDIS_URL`: the Redis the service uses when its config names none."""
    return os.environ.get("REDIS_URL") or None


def worker_env(import_roots: list[str]) -> dict[str, str]:
    """The environment of a compile worker process: ours, with `import_roots` first on its
    `PYTHONPATH` and one OpenMP thread (set before torch is imported)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*import_roots, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
