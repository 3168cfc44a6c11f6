"""Log-probabilities on the wire: the engine's `TokenLogprob`s as OpenAI's two shapes.

The replica turns each streamed step's entries into plain dicts with the tokens' text (`entries`,
`prompt_entries`); the ingress shapes them as chat (`logprobs.content[]` with `top_logprobs`)
or completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`). Masked tokens have a
log-probability of -inf, which JSON cannot carry: -9999.0 stands for it, as in vLLM.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from services.engine.params import RequestOutput

FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


class TokenText:
    """A token's text and bytes, cached by id (one decode per distinct token)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.of = functools.lru_cache(maxsize=65536)(self._of)

    def _of(self, token_id: int) -> tuple[str, list[int]]:
        text = self._tokenizer.decode([token_id])
        return text, list(text.encode("utf-8"))


def entries(out: RequestOutput, text: TokenText) -> list[dict[str, Any]] | None:
    """The delta's tokens, each `{"token", "bytes", "logprob", "top": [...]}` (None: not asked)."""
    if out.logprobs is None:
        return None
    new = out.logprobs[len(out.logprobs) - len(out.delta_token_ids) :]
    result = []
    for lp in new:
        token, raw = text.of(lp.token_id)
        top = []
        for tid, value in lp.top:
            t, b = text.of(tid)
            top.append({"token": t, "bytes": b, "logprob": _finite(value)})
        result.append({"token": token, "bytes": raw, "logprob": _finite(lp.logprob), "top": top})
    return result


def prompt_entries(out: RequestOutput, text: TokenText) -> list[Any] | None:
    """vLLM's `prompt_logprobs`: None for the first token, then `{id: {logprob, decoded_token}}`."""
    if out.prompt_logprobs is None:
        return None
    ids = out.prompt_token_ids
    shaped: list[Any] = [None]
    for tid, value in zip(ids[1:], out.prompt_logprobs, strict=False):
        shaped.append({str(tid): {"logprob": _finite(value), "decoded_token": text.of(tid)[0]}})
    return shaped


def chat(items: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    if items is None:
        return None
    content = [
        {
            "token": e["token"],
            "logprob": e["logprob"],
            "bytes": e["bytes"],
            "top_logprobs": [
                {"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]}
                for t in e["top"]
            ],
        }
        for e in items
    ]
    return {"content": content, "refusal": None}


def completion(items: list[dict[str, Any]] | None, offset: int) -> dict[str, Any] | None:
    """`offset`: characters of the completion text before these tokens."""
    if items is None:
        return None
    offsets, at = [], offset
    for e in items:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in items],
        "token_logprobs": [e["logprob"] for e in items],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top"]} for e in items],
        "text_offset": offsets,
    }
