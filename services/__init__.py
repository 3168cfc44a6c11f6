"""structserve's long-running logic: the engine, the grammar compiler, the KV tier."""

from services.engine import (
    LLM,
    EngineConfig,
    KVPolicy,
    RequestOutput,
    SamplingParams,
    StructuredOutput,
)

__all__ = ["LLM", "EngineConfig", "KVPolicy", "RequestOutput", "SamplingParams", "StructuredOutput"]
