"""The grammar layer: what a grammar is and how one is built, for every part that needs one.

The engine, the compile service (`services/compiler/`) and the HTTP layer (`deployments/`) all
stand on this package, and it imports none of them (tests/unit/test_layers.py holds it so):
- `structured`: `StructuredOutput`, the request's grammar and options, and the backend names;
- `canonical`: between `StructuredOutput` and the registry's `GrammarSpec`, and the one key;
- `backend`: the backend interface, `CompiledGrammar`, `GrammarError`, the shared bitmask;
- `xgrammar_backend`, `llguidance_backend`: the two backends; `backends`: the choice between
  them (`auto`) and `for_model`, the one factory of a model's backends;
- `fidelity`: the schema keywords a grammar cannot enforce; `finish`: number bounds and the
  repeat guard;
- `provider`: where the engine gets compiled grammars (`GrammarProvider`), and the in-process one;
- `workers`: threads that run mask fills under a deadline, leaving a straggler behind on idle
  cores (the engine's masks, the compile probe).

Names load on first use (PEP 562): `StructuredOutput` must not cost torch and xgrammar.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.grammar.backend import CompiledGrammar, GrammarBackend, GrammarError, GrammarState
    from services.grammar.backends import Backends
    from services.grammar.provider import GrammarProvider, LocalGrammarProvider
    from services.grammar.structured import StructuredOutput

_HOMES = {
    "CompiledGrammar": "backend",
    "GrammarBackend": "backend",
    "GrammarError": "backend",
    "GrammarState": "backend",
    "Backends": "backends",
    "GrammarProvider": "provider",
    "LocalGrammarProvider": "provider",
    "StructuredOutput": "structured",
}
__all__ = [
    "Backends",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarError",
    "GrammarProvider",
    "GrammarState",
    "LocalGrammarProvider",
    "StructuredOutput",
]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"services.grammar.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'services.grammar' has no attribute {name!r}")
