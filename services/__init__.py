"""structserve's long-running logic: the engine and the grammar compiler."""

from services.engine import (
    LLM,
    EngineConfig,
    KVPolicy,
    RequestOutput,
    SamplingParams,
    StructuredOutput,
)

__all__ = ["LLM", "EngineConfig", "KVPolicy", "RequestOutput", "SamplingParams", "StructuredOutput"]
