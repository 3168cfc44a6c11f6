"""Small random-weight models of the decoder families the engine serves, built from their
transformers configs and saved as model folders with the SmolLM2 tokenizer (tests compare the
engine with transformers on them: weights need not be trained, only the same on both sides).

Windows are shorter than the test prompts, so sliding-window layers really slide.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

WINDOW = 24  # tokens a sliding-window layer sees (its own included)
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    initializer_range=0.2,  # peaked logits: greedy choices are not near-ties
)


def configs() -> dict[str, tuple[str, dict[str, Any]]]:
    """family -> (transformers config class, its arguments beyond SMALL)."""
    return {
        "llama": ("LlamaConfig", {}),
        "qwen2": (  # windows on the layers from max_window_layers on: mixed local and global
            "Qwen2Config",
            {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
        ),
        "qwen3": ("Qwen3Config", {"head_dim": 16}),  # q/k norms before RoPE
        "mistral": ("MistralConfig", {"sliding_window": WINDOW}),
        "gemma2": (  # local and global layers in turn, soft-capped logits, query pre-scaling
            "Gemma2Config",
            {
                "head_dim": 16,
                "sliding_window": WINDOW,
                "attn_logit_softcapping": 20.0,
                "final_logit_softcapping": 15.0,
                "query_pre_attn_scalar": 24,
            },
        ),
        "gemma3": (  # 2 local : 1 global, local RoPE base, q/k norms
            "Gemma3TextConfig",
            {
                "head_dim": 16,
                "sliding_window": WINDOW,
                "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
                "query_pre_attn_scalar": 24,
            },
        ),
        "phi3": ("Phi3Config", {"sliding_window": WINDOW, "pad_token_id": 0}),
        # not a family the engine names: its layers pass no keywords through (the batch comes
        # from `kvcache.attention.stepping`), partial rotary, LayerNorm
        "stablelm": ("StableLmConfig", {}),
    }


# Families the paged attention cannot serve, and what the refusal at load names.
REFUSED = {
    "gpt_oss": (  # attention sinks: a learned logit per head the softmax must include
        "GptOssConfig",
        {"num_local_experts": 2, "num_experts_per_tok": 1, "head_dim": 16},
        "s_aux",
    ),
    "bloom": ("BloomConfig", {"n_head": 4}, "call the attention interface"),  # ALiBi, its own
}


def build(family: str, folder: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Saves a random-weight `family` model with the tokenizer of `tokenizer_dir` in `folder`."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, extra = configs()[family] if family in configs() else REFUSED[family][:2]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = getattr(transformers, name)(vocab_size=len(tokenizer), **SMALL, **ids, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
