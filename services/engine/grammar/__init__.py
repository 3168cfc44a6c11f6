from services.engine.grammar.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarState,
)
from services.engine.grammar.provider import GrammarProvider, LocalGrammarProvider

__all__ = [
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarError",
    "GrammarProvider",
    "GrammarState",
    "LocalGrammarProvider",
]
