"""The grammar compile service: killable worker processes, limits, probe, verdict cache, tenants."""

from services.compiler.build import build_provider, provider_for
from services.compiler.service import CompilerConfig, CompileService
from services.compiler.service_provider import ServiceGrammarProvider

__all__ = [
    "CompileService",
    "CompilerConfig",
    "ServiceGrammarProvider",
    "build_provider",
    "provider_for",
]
