from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.llm import LLM
from services.engine.params import (
    KVPolicy,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    StructuredOutput,
)
from services.lora.manager import LoRARequest

__all__ = [
    "LLM",
    "EngineConfig",
    "KVPolicy",
    "LLMEngine",
    "LoRARequest",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
]
