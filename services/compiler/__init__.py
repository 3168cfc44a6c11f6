"""The grammar compile service: killable worker processes, limits, probe, verdict cache, tenants."""

from services.compiler.build import build_provider
from services.compiler.provider import ServiceGrammarProvider
from services.compiler.service import CompilerConfig, CompileService

__all__ = [
    "CompileService",
    "CompilerConfig",
    "ServiceGrammarProvider",
    "build_provider",
]
