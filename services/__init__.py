"""structserve's long-running logic: the engine and the grammar compiler.

The public names load on first use (PEP 562): a worker process that runs one of our modules
(`python -m services.sandbox.worker`) imports this package first, and must not pay for torch and
the engine to validate a schema or render a template.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.engine import (
        LLM,
        EngineConfig,
        KVPolicy,
        LoRARequest,
        RequestOutput,
        SamplingParams,
        StructuredOutput,
    )

__all__ = [
    "LLM",
    "EngineConfig",
    "KVPolicy",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("services.engine"), name)
    raise AttributeError(f"module 'services' has no attribute {name!r}")
