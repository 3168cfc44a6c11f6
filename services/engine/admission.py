"""What a request must pass before it is queued: its prompt's size, its context, its KV policy.

Checked in order of cost: characters before a tokenizer pass, the token count before the scan of
the vocabulary; every refusal names the field and the limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from services.engine.params import KVPolicy
from services.engine.request import Request

if TYPE_CHECKING:
    from services.engine.config import EngineConfig
    from services.engine.model_runner import ModelRunner

Prompt = str | Sequence[int]
# Streams under a re-rotating policy have no context limit of their own: this caps them
STREAM_LIMIT = 1 << 24
# Default cap on a prompt's characters, per token of context: ordinary text never packs this many
# characters into a token, so a longer prompt could not fit and is refused before it costs a
# tokenizer pass (`EngineConfig.max_prompt_chars` sets it outright).
CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class Limits:
    page_size: int
    pool_tokens: int  # the device KV pool
    model_len: int  # the model's trained context
    max_model_len: int  # the context a `full` request may use
    configured_len: int | None  # EngineConfig.max_model_len
    vocab_size: int
    max_prompt_chars: int
    tier_pages: int | None  # the host tier's pages (None: no tier)
    pool_pages: int
    can_rerotate: bool
    attention_variant: str | None = None  # what the model's attention adds (windows, soft-caps)

    @classmethod
    def of(
        cls,
        config: EngineConfig,
        runner: ModelRunner,
        model_len: int,
        max_model_len: int,
        tier_pages: int | None,
    ) -> Limits:
        pool_pages = runner.kv.num_pages
        return cls(
            page_size=config.page_size,
            pool_tokens=pool_pages * config.page_size,
            model_len=model_len,
            max_model_len=max_model_len,
            configured_len=config.max_model_len,
            vocab_size=runner.vocab_size,
            max_prompt_chars=config.max_prompt_chars or CHARS_PER_TOKEN * max_model_len,
            tier_pages=tier_pages,
            pool_pages=pool_pages,
            can_rerotate=runner.rotate is not None,
            attention_variant=runner.attention.describe(),
        )


def check_chars(chars: int, field: str, max_chars: int) -> None:
    if chars > max_chars:
        raise ValueError(
            f"{field}: {chars} characters exceed the limit of {max_chars} (max_prompt_chars)"
        )


def tokenize(tokenizer: Any, prompt: Prompt, max_chars: int) -> list[int]:
    if isinstance(prompt, str):
        check_chars(len(prompt), "prompt", max_chars)
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    try:
        return [int(t) for t in prompt]
    except (TypeError, ValueError) as exc:
        raise ValueError("prompt: token ids must be integers") from exc


def refusal(req: Request, lim: Limits) -> str | None:
    """Why the request cannot run here (None: it can); sets its policy's context limit, and
    lowers a `fit_max_tokens` request's max_tokens to the context left."""
    params, n = req.params, req.num_prompt_tokens
    if n == 0:
        return "prompt: is empty"
    limit = lim.max_model_len
    if req.kv_state is not None:
        refused = _kv_refusal(req.kv_state.policy, lim)
        if refused:
            return refused
        limit = req.context_limit = context_limit(req.kv_state.policy, lim)
    if n + params.max_tokens > limit and params.fit_max_tokens and params.min_tokens < limit - n:
        req.params = params = replace(params, max_tokens=limit - n)
    if n + params.max_tokens > limit:
        return (
            f"max_tokens: prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"maximum context of {limit} tokens"
        )
    vocab = lim.vocab_size  # scanned once the length is known to fit
    if bad := [t for t in req.prompt_token_ids if not 0 <= t < vocab]:
        return f"prompt: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})"
    for field, ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", params.logit_bias),
    ):
        if bad := [t for t in ids or () if t >= vocab]:
            return f"{field}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})"
    snapkv = req.kv_state is not None and req.kv_state.policy.kind == "snapkv"
    if snapkv and n > lim.pool_tokens:  # the whole prompt is cached until it has voted
        return f"prompt: {n} tokens do not fit the KV pool ({lim.pool_tokens} tokens)"
    return None


def _kv_refusal(kv: KVPolicy, lim: Limits) -> str | None:
    ps = lim.page_size
    if lim.attention_variant is not None:  # policies move entries off their positions
        return (
            f"kv.kind: {kv.kind!r} is not available on this model, whose attention has "
            f"{lim.attention_variant}; use the full cache (no kv policy)"
        )
    if kv.page_size is not None and kv.page_size != ps:
        return f"kv.page_size: must equal the engine's page size ({ps}), got {kv.page_size}"
    if kv.offload and lim.tier_pages is None:
        return "kv.offload: this engine has no host page tier (set kv_tier_pages)"
    if kv.rerotate and not lim.can_rerotate:
        return "kv.rerotate: this model has no rotary embedding to re-rotate keys with"
    room = min(lim.pool_tokens, lim.model_len)
    if kv.bounded and kv.budget + ps > room:
        return (
            f"kv.budget_tokens: {kv.budget} (+ one page) exceeds the KV pool or the model's "
            f"context ({room} tokens)"
        )
    return None


def context_limit(kv: KVPolicy, lim: Limits) -> int:
    """Bounded policies hold budget + one page, whatever the length; positions still grow,
    except under `rerotate`, where they stay inside the cache (StreamingLLM)."""
    trained = min(lim.configured_len or lim.model_len, lim.model_len)
    if kv.offload:  # parked pages live on the host: the pool no longer caps the context
        assert lim.tier_pages is not None
        return min(trained, (lim.pool_pages + lim.tier_pages) * lim.page_size)
    if not kv.bounded:
        return lim.max_model_len
    if kv.rerotate:
        return lim.configured_len or STREAM_LIMIT
    return trained
