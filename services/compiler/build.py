"""`build_provider`: an engine's grammar provider with a compile service of its own."""

from __future__ import annotations

from services import settings
from services.compiler.local_builds import LocalBuilds
from services.compiler.provider import ServiceGrammarProvider
from services.compiler.service import CompilerConfig, CompileService
from services.engine.grammar.backends import Backends
from services.engine.grammar.xgrammar_backend import XGrammarBackend


def build_provider(
    backend: XGrammarBackend | Backends,
    workers: int,
    redis_url: str | None = None,
    config: CompilerConfig | None = None,
) -> ServiceGrammarProvider:
    """An engine's provider with its own compile service (offline use and one-process serving);
    given every backend, llguidance grammars are built in this process (`LocalBuilds`)."""
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
    return ServiceGrammarProvider(backend, service, owns_service=True, local=local)
