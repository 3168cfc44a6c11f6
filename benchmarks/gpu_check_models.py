"""The models and budget of `benchmarks/gpu_check.py`: random-weight Llama shapes built on the
device itself, the JSON schemas of the constrained runs, and the run's clock.

Random weights cost nothing to make on the device and time the same as trained ones; only the
tokenizer is real (a folder: the GPU machine gets it carried, without the model package).
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import torch

from kvcache.pages import KVLayout
from services import LLM
from services.models import LoadedModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PAGE = 16  # the engine's default page size

# SmolLM2-135M's shape (its config.json), the model our tests run trained.
SMOLLM2_135M: dict[str, Any] = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
)
# Llama-3.2-1B and Llama-3-8B shapes, with the SmolLM2 vocabulary (49,152 instead of 128,256):
# 1.07B and 7.4B parameters. The 1B model's context covers the host-tier step's 32k prompts.
LLAMA_1B: dict[str, Any] = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=65536,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)
LLAMA_8B: dict[str, Any] = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)
LLAMA_TINY: dict[str, Any] = dict(  # --tiny: seconds on two CPU cores, long enough for step 4
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
# Step 2's weights: peaked logits, so greedy choices are rarely near-ties (tests/families.py's
# reason too); the default 0.02 gives near-uniform logits where any rounding flips a token.
PEAKED_INIT = 0.2

SCHEMAS: list[dict[str, Any]] = [  # small real-world shapes: records, enums, arrays, tool calls
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "temperature": {"type": "number"},
            "unit": {"enum": ["C", "F"]},
        },
        "required": ["city", "temperature", "unit"],
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["id", "tags"],
        },
        "minItems": 1,
    },
    {
        "type": "object",
        "properties": {
            "tool": {"enum": ["search", "calculator", "weather"]},
            "arguments": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
        "required": ["tool", "arguments"],
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "done": {"type": "boolean"},
            "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["title", "done", "priority"],
    },
    {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "price": {"type": "number"},
            "stock": {"type": "integer"},
        },
        "required": ["sku", "price", "stock"],
    },
]


class Clock:
    """The run's time budget: a sub-run starts only while time is left (the device is lent for
    minutes; a skipped entry says so rather than the whole run being killed)."""

    def __init__(self, budget_s: float) -> None:
        self.start = time.monotonic()
        self.end = self.start + budget_s

    def left(self) -> float:
        return self.end - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start


SKIPPED = {"skipped": "time budget spent"}


def random_llama(
    shape: dict[str, Any],
    tokenizer: Any,
    folder: Path,
    device: torch.device,
    dtype: torch.dtype,
    init_range: float = 0.02,
    seed: int = 0,
) -> LoadedModel:
    """A random-weight Llama of `shape` with the real tokenizer, built on `device` directly."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=init_range,
        **shape,
    )
    torch.manual_seed(seed)
    with torch.device(device):  # 8B parameters: never materialized on the host
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return LoadedModel(
        name=f"random-llama-{seed}", path=folder, model=model.eval(), tokenizer=tokenizer
    )


def describe(loaded: LoadedModel) -> dict[str, Any]:
    config = loaded.config
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    return {
        "parameters": sum(p.numel() for p in loaded.model.parameters()),
        **{k: getattr(config, k) for k in keys},
        "vocab_size": config.vocab_size,
    }


def pool_bytes(loaded: LoadedModel, tokens: int, dtype: torch.dtype) -> int:
    """KV pool bytes for `tokens` tokens in whole pages, plus slack pages for page rounding."""
    c = loaded.config
    heads = c.num_attention_heads
    layout = KVLayout(
        num_layers=c.num_hidden_layers,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        page_size=PAGE,
        dtype=dtype,
    )
    return (-(-tokens // PAGE) + 64) * layout.bytes_per_page


def drop(*llms: LLM) -> None:
    """Stops each engine's threads and gives its KV pool back before the next model is built."""
    for llm in llms:
        llm.engine.grammars.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
