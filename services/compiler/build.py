"""An engine's grammar provider when it has no compile service to share: `provider_for`."""

from __future__ import annotations

import math

from services import settings
from services.compiler.local_builds import LocalBuilds
from services.compiler.service import CompilerConfig, CompileService
from services.compiler.service_provider import ServiceGrammarProvider
from services.grammar.backend import MASK_BUDGET_MS
from services.grammar.backends import Backends
from services.grammar.provider import LocalGrammarProvider, ProviderFactory
from services.grammar.xgrammar_backend import XGrammarBackend


def provider_for(
    workers: int,
    redis_url: str | None = None,
    mask_budget_ms: float = MASK_BUDGET_MS,
    config: CompilerConfig | None = None,
) -> ProviderFactory:
    """What an engine of its own (offline, or one-process serving) compiles with: a compile
    service of its own with `workers` killable worker processes (`redis_url`: its verdict
    cache; the probe refuses grammars whose masks take over `mask_budget_ms`), or for 0
    in-process with no guard (the plain twin). `config`: the service's other settings.

    Its compiles queue for as long as they need: the batch is the caller's own, so a compile
    waiting for a worker (or behind the batch's other compiles) is never refused for capacity,
    only for what the grammar itself is."""
    if workers == 0:
        return LocalGrammarProvider
    base = (config or CompilerConfig()).model_copy(update={"mask_budget_ms": mask_budget_ms})
    return lambda backends: build_provider(backends, workers, redis_url, base, math.inf)


def build_provider(
    backend: XGrammarBackend | Backends,
    workers: int,
    redis_url: str | None = None,
    config: CompilerConfig | None = None,
    busy_wait_s: float = 120.0,
) -> ServiceGrammarProvider:
    """An engine's provider with its own compile service; given every backend, llguidance
    grammars are built in this process (`LocalBuilds`)."""
    local = None
    base = config or CompilerConfig()
    if isinstance(backend, Backends):
        local = LocalBuilds.from_config(backend, base)
        backend = backend.xgrammar
    client = None
    if redis_url:
        import redis

        client = redis.Redis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
    cfg = base.model_copy(update={"workers": workers})
    if client is not None and cfg.verdict_secret is None:
        cfg = cfg.model_copy(update={"verdict_secret": settings.verdict_secret()})
    service = CompileService(backend.tokenizer_info, cfg, redis=client)
    return ServiceGrammarProvider(
        backend, service, owns_service=True, local=local, busy_wait_s=busy_wait_s
    )
